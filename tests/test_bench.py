"""mlptrain.bench on the CPU: the composed configurations of the step benchmarks, the override strings,
the bisection of the largest model, and the tables' number format. (Timing needs a GPU.)"""

from __future__ import annotations

import pytest

from mlptrain.cli.main import compose_config
from mlptrain.config.schema import TrainConfig, flatten
from mlptrain.tools.bench import largest_model
from mlptrain.tools.bench.medians import fmt
from mlptrain.tools.bench.step_trainer import digits_overrides, step_config, step_overrides


def _flat(cfg: TrainConfig) -> dict:
    from omegaconf import OmegaConf

    return flatten(OmegaConf.to_container(OmegaConf.structured(cfg)))


def test_step_overrides_are_hydra_command_line_values() -> None:
    got = step_overrides([784, 1024, 1024, 10], 256, "fp16", wgrad_stream=None, workspace_mib=64)
    assert "model.hidden=[1024,1024]" in got and "execution.wgrad_stream=null" in got
    assert "graph=true" in got and "progress=false" in got and "execution.workspace_mib=64" in got
    assert not any(o.startswith("precision.compute_copy=") for o in got)  # the precision's own unless asked
    assert "precision.compute_copy=kept" in step_overrides([8, 16], 16, "fp16", compute_copy="kept")
    assert "precision.compute_copy=kept" in step_overrides([8, 16], 16, "fp8", compute_copy="kept")
    assert "precision.compute_copy=kept" not in step_overrides([8, 4], 16, "fp32", compute_copy="kept")
    assert not any(o.startswith("execution.workspace_mib=") for o in step_overrides([8, 4], 16, "fp32"))


@pytest.mark.parametrize(
    ("widths", "batch", "precision", "options"),
    [
        ([784, 1024, 1024, 10], 256, "fp16", {}),
        ([4096] * 5, 8192, "bf16", {"mode": "naive", "graph": False, "compute_copy": "cast"}),
        ([64, 32, 10], 128, "fp32", {"wgrad_stream": False, "workspace_mib": None, "bgrad": "bgradb"}),
        ([64, 10], 128, "fp16", {"activation": "gelu", "optimizer": "adam", "autotune": True, "head_kernel": False}),
    ],
)
def test_step_config_sets_what_the_benchmark_asks_and_keeps_the_defaults(widths, batch, precision, options) -> None:
    cfg = step_config(widths, batch, precision, **options)
    assert cfg.device.value == "gpu" and cfg.precision.name == precision
    assert list(cfg.model.hidden) == widths[1:-1] and cfg.data.batch_size == batch
    assert cfg.execution.mode.value == options.get("mode", "fused") and cfg.graph is options.get("graph", True)
    assert cfg.execution.wgrad_stream is options.get("wgrad_stream") and cfg.progress is False
    assert cfg.optimizer.name == options.get("optimizer", "sgd") and cfg.optimizer.lr == 1e-3
    assert cfg.optimizer.schedule.value == "constant"
    assert cfg.model.activation == options.get("activation", "relu")
    if "workspace_mib" in options:
        assert cfg.execution.workspace_mib == options["workspace_mib"]
    if precision in ("fp16", "bf16"):
        assert cfg.precision.compute_copy.value == options.get("compute_copy", "auto")
    # Everything the benchmark does not set is the command line's default.
    asked = {o.split("=", 1)[0] for o in step_overrides(widths, batch, precision, **options)}
    default, composed = _flat(TrainConfig()), _flat(cfg)
    assert {k: v for k, v in composed.items() if k not in asked and default.get(k) != v} == {}


def test_step_config_is_checked_as_a_command_line_is() -> None:
    from mlptrain.base.errors import ConfigError

    with pytest.raises(ConfigError, match="execution.bgrad=bgradb is not used with execution=naive"):
        step_config([64, 10], 128, "fp32", mode="naive", bgrad="bgradb")


def test_digits_overrides_compose_and_take_extra_keys() -> None:
    cfg = compose_config(digits_overrides(True, **{"precision.name": "fp8", "epochs": 2}))
    assert cfg.data.name.value == "digits" and cfg.data.batch_size == 64 and cfg.optimizer.name == "adam"
    assert cfg.precision.name == "fp8" and cfg.epochs == 2 and cfg.execution.bgrad.value == "bgradb"


def test_largest_bisects_to_the_widest_width_that_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    tried = []

    def fake_trial(side: str, width: int, batch: int) -> dict | None:
        tried.append(width)
        return {"peak_gib": width / 1024} if width <= 45056 else None

    monkeypatch.setattr(largest_model, "run_trial", fake_trial)
    width, rec = largest_model.largest("mlptrain", 16384, 32768, 81920)
    assert width == 45056 and rec == {"peak_gib": 44.0}
    assert tried[0] == 32768 and all(w % 1024 == 0 for w in tried)
    # lo that does not train: halved until one does
    tried.clear()
    width, rec = largest_model.largest("mlptrain", 16384, 65536, 81920)
    assert width == 45056 and tried[:2] == [65536, 32768]


def test_fmt() -> None:
    assert fmt(None) == "-" and fmt(1.23456) == "1.235" and fmt(2.0, 2) == "2.00"


# --- the ISLP tables of benchmarks/bench_tables.py --suite islp -------------------------------------------------


def test_islp_tables_without_their_csvs_are_one_error_naming_the_install(tmp_path, monkeypatch) -> None:
    from mlptrain.tools.bench import islp

    monkeypatch.setattr(islp.importlib.util, "find_spec", lambda name: None)  # ISLP not installed
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps ISLP==0\.6\.0"):
        islp.data_folder()
    with pytest.raises(FileNotFoundError, match="no Default.csv"):
        islp.data_folder(tmp_path)


def test_islp_hitters_loses_the_rows_without_a_salary_and_its_variant_empties_a_tenth_of_the_features(
    tmp_path,
) -> None:
    import numpy as np
    import pandas as pd

    from mlptrain.tools.bench import islp

    rng = np.random.default_rng(0)
    n = 400
    salary = np.where(rng.random(n) < 0.2, np.nan, rng.uniform(100, 2000, n))
    frame = pd.DataFrame({"AtBat": rng.integers(100, 600, n), "League": rng.choice(["A", "N"], n), "Salary": salary})
    frame.to_csv(tmp_path / "Hitters.csv", index=False)
    (tmp_path / "Default.csv").write_text("default,balance\nNo,1.0\n")
    make = islp.islp_tables(islp.data_folder(tmp_path))
    plain, empty = make["Hitters"](), make["Hitters_empty"]()
    kept = int(np.isfinite(salary).sum())
    assert plain.rows == empty.rows == kept and plain.task == "regression" and plain.target == "Salary"
    assert plain.train["Salary"].notna().all() and plain.test["Salary"].notna().all()
    both = pd.concat([empty.train, empty.test])
    share = both[["AtBat", "League"]].isna().to_numpy().mean()
    assert 0.07 < share < 0.13 and both["Salary"].notna().all()  # the target cells are kept
