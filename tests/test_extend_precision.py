"""A new precision from outside the package: one row, and one YAML (#29).

``fp32_scaled``: float32 storage and GEMMs with fp16's dynamic loss scaling, on the CPU. A power-of-two
scale is exact in float32, so its run must lose exactly what precision=fp32 loses, step by step,
while its scale grows every ``growth_interval`` clean steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mlptrain import train
from mlptrain.base.errors import ConfigError
from mlptrain.cli.help import settings_help
from mlptrain.cli.main import compose_config
from mlptrain.run import checkpoint
from mlptrain.run.metrics import read_metrics
from mlptrain.step.precision import PRECISIONS, PrecisionSpec


@pytest.fixture
def registered(tmp_path: Path) -> Iterator[list[str]]:
    PRECISIONS.add("fp32_scaled", PrecisionSpec("float32", "float32", loss_scaling="dynamic", cpu=True))
    (tmp_path / "conf" / "precision").mkdir(parents=True)
    (tmp_path / "conf" / "precision" / "fp32_scaled.yaml").write_text(
        "name: fp32_scaled\ninit_scale: 1024.0\ngrowth_interval: 4\n"
    )
    try:
        yield [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "device=cpu", "progress=false", "model.hidden=[32]"]
    finally:
        PRECISIONS.remove("fp32_scaled")


def _losses(run: Path) -> list[float]:
    return [r["train/loss"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "step"]


def test_a_run_trains_with_it(registered: list[str], tmp_path: Path) -> None:
    train(compose_config([*registered, "precision=fp32_scaled", "epochs=1", "log_every=1"]), tmp_path / "scaled")
    train(compose_config([*registered, "precision=fp32", "epochs=1", "log_every=1"]), tmp_path / "fp32")
    scaled = _losses(tmp_path / "scaled")
    assert len(scaled) == 21 and scaled == _losses(tmp_path / "fp32")
    assert scaled[-1] < 0.7 * scaled[0]
    meta = checkpoint.load(tmp_path / "scaled" / "checkpoints" / "last.npz").meta
    assert meta["precision"] == "fp32_scaled" and meta["param_dtype"] == meta["compute_dtype"] == "float32"
    assert meta["scaler"] == {"scale": 1024.0 * 2 ** (21 // 4), "growth_tracker": 21 % 4, "consecutive_skips": 0}


def test_help_and_the_checks_know_it(registered: list[str]) -> None:
    line = next(x for x in settings_help().splitlines() if "precision.name =" in x)
    assert "fp64, fp32, tf32, fp16, bf16, fp8 or fp32_scaled (precision=<name>)" in line
    scale = next(x for x in settings_help().splitlines() if "precision.init_scale =" in x)
    assert scale.split(maxsplit=3)[3] == "fp16, fp32_scaled: initial loss scale"
    with pytest.raises(ConfigError, match=r"precision\.init_scale=-1\.0 must be positive"):
        compose_config([*registered, "precision=fp32_scaled", "precision.init_scale=-1"])
    with pytest.raises(ConfigError, match=r"precision\.backoff_factor=1\.5 must be in \(0, 1\)"):
        compose_config([*registered, "precision=fp32_scaled", "precision.backoff_factor=1.5"])
    # its loss-scaling settings apply to it, and to no precision that does not scale
    compose_config([*registered, "precision=fp32_scaled", "precision.growth_factor=4"])
    with pytest.raises(ConfigError, match=r"it applies to precision=fp16 and fp32_scaled \(dynamic loss scaling\)"):
        compose_config([*registered, "precision=fp32", "precision.growth_factor=4"])
    with pytest.raises(ConfigError, match=r"precision.compute_copy=cast is not used with precision=fp32_scaled"):
        compose_config([*registered, "precision=fp32_scaled", "precision.compute_copy=cast"])


def test_gone_once_removed() -> None:
    assert PRECISIONS.names() == ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8")
