"""The registries and what is derived from them stay equal: the schema, conf/, the checks, --help (#29)."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest

from mlptrain.base.backend import get_backend
from mlptrain.base.errors import ConfigError, DeviceError
from mlptrain.base.registry import Range
from mlptrain.cli.help import settings_help
from mlptrain.cli.main import CONF_DIR
from mlptrain.config.schema import OptimizerConfig, PrecisionConfig, TrainConfig
from mlptrain.nn.epilogs import EPILOG_INPUTS
from mlptrain.nn.execution import ACTIVATIONS
from mlptrain.nn.layers import Param
from mlptrain.nn.losses import LOSSES
from mlptrain.step.checks import uses, validate
from mlptrain.step.choices import REGISTRIES
from mlptrain.step.optim import OPTIMIZERS, Optimizer, OptimizerSpec, setting_ranges
from mlptrain.step.precision import PRECISIONS, SETTINGS, get_precision

SCHEDULE_KEYS = {"schedule", "warmup_steps", "min_lr_ratio"}  # the learning-rate schedule's, not an optimizer's


def _choice_fields() -> dict[str, dataclasses.Field]:
    """The schema's settings whose help lists a registry (``choices`` in their metadata)."""
    cfg, out = TrainConfig(), {}
    for group in dataclasses.fields(cfg):
        node = getattr(cfg, group.name)
        for f in dataclasses.fields(node) if dataclasses.is_dataclass(node) else []:
            if f.metadata.get("choices"):
                out[f"{group.name}.{f.name}"] = f
    return out


def test_the_schema_names_each_registry_once_and_its_defaults_are_registered() -> None:
    fields = _choice_fields()
    assert set(fields) == set(REGISTRIES) == {"model.activation", "model.loss", "optimizer.name", "precision.name"}
    defaults = TrainConfig()
    for key, registry in REGISTRIES.items():
        group, name = key.split(".")
        assert getattr(getattr(defaults, group), name) in registry, key


@pytest.mark.parametrize(("group", "registry"), [("optimizer", OPTIMIZERS), ("precision", PRECISIONS)])
def test_conf_has_one_file_per_registered_name(group: str, registry: object) -> None:
    assert sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")) == sorted(registry.names())  # type:
    # ignore[attr-defined]


def test_help_lists_the_registered_names_as_it_always_did() -> None:
    text = settings_help()
    for expected in (
        "hidden layers: relu, gelu (the tanh form) or none",
        "cross_entropy (classification) or mse (regression, or one-hot)",
        "sgd, adam or adamw (optimizer=<name> selects its group)",
        "fp64, fp32, tf32, fp16, bf16 or fp8 (precision=<name>); fp8: FP8 GEMMs on Hopper",
    ):
        assert expected in text
    assert "{choices}" not in text


def test_every_optimizer_setting_is_in_the_schema_and_read_by_someone() -> None:
    schema = {f.name for f in dataclasses.fields(OptimizerConfig)} - {"name"}
    declared = set(setting_ranges())  # COMMON and every registered optimizer's settings, one range each
    assert declared <= schema, declared - schema
    assert schema - declared == SCHEDULE_KEYS
    common = {f"optimizer.{k}" for k in Optimizer.COMMON}  # lr, weight_decay, state_dtype: read by every optimizer
    assert {k for k in uses() if k.startswith("optimizer.")} == {f"optimizer.{k}" for k in declared} - common | {
        "optimizer.min_lr_ratio"
    }


def test_every_precision_setting_is_declared() -> None:
    assert set(SETTINGS) == {f.name for f in dataclasses.fields(PrecisionConfig)} - {"name"}
    assert {k for k in uses() if k.startswith("precision.")} == {f"precision.{k}" for k in SETTINGS}


def _outside(r: Range) -> float:
    return (r.low - 1 if r.low is not None else (r.high or 0) + 1) if not r.low_open else float(r.low or 0)


def _all_ranges() -> list[tuple[str, Range]]:
    out = [(f"optimizer.{k}", r) for k, r in setting_ranges().items() if r is not None]
    return out + [(f"precision.{k}", r) for k, (_, _, r) in SETTINGS.items() if r is not None]


@pytest.mark.parametrize(("key", "r"), _all_ranges(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_value_out_of_its_declared_range_reads_the_same_everywhere(key: str, r: Range) -> None:
    cfg = TrainConfig()
    group, name = key.split(".")
    value = type(getattr(getattr(cfg, group), name))(_outside(r))
    assert not r.holds(value)
    setattr(getattr(cfg, group), name, value)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    message = f"{key}={value} must be {r.describe()}"
    assert message in str(info.value)
    if group == "optimizer":  # the constructor of each optimizer that reads it says the same
        for _, spec in OPTIMIZERS.items():
            if name in {**Optimizer.COMMON, **spec.cls.settings}:
                with pytest.raises(
                    ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                ):
                    spec.build(getattr(cfg, group), [Param("w", np.zeros(2), np.float64)])


def test_the_range_words() -> None:
    assert [r.describe() for r in (Range(0, low_open=True), Range(0), Range(1, low_open=True))] == [
        "positive",
        ">= 0",
        "> 1",
    ]
    assert Range(0, 1, high_open=True).describe() == "in [0, 1)" and Range(0, 1).describe() == "in [0, 1]"
    assert Range(0, note="a power of two of headroom").problem("precision.margin", -1) == (
        "precision.margin=-1 must be >= 0 (a power of two of headroom)"
    )
    assert math.isclose(_outside(Range(0, 1, high_open=True)), -1)


# The precisions as they were before the registry (precision.py's table): storage, compute, and flags.
TABLE = {
    "fp64": ("float64", "float64", False, False, False, True),
    "fp32": ("float32", "float32", False, False, False, True),
    "tf32": ("float32", "float32", True, False, False, False),
    "fp16": ("float32", "float16", False, True, False, False),
    "bf16": ("float32", "bfloat16", False, False, False, False),
    "fp8": ("float32", "bfloat16", False, False, True, True),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_each_precision_row_makes_the_policy_it_made(name: str) -> None:
    storage, compute, tf32, dynamic, fp8, cpu = TABLE[name]
    row = PRECISIONS[name]
    assert (row.storage, row.compute, row.tf32, row.loss_scaling == "dynamic", row.gemm_scales, row.cpu) == TABLE[name]
    if not cpu:
        with pytest.raises(DeviceError, match="use precision=fp32 or fp64 on the CPU"):
            get_precision(name, get_backend("cpu"))
        return
    p = get_precision(name, get_backend("cpu"))
    assert (np.dtype(p.param_dtype).name, np.dtype(p.compute_dtype).name) == (storage, compute)
    assert (p.tf32, p.loss_scaling, p.fp8, p.checked) == (tf32, dynamic, fp8, name == "fp8")


def test_the_rows_skip_steps_where_they_check_them() -> None:
    used = {k: [n for n, row in PRECISIONS.items() if reads(row)] for k, (reads, _, _) in SETTINGS.items()}
    assert used["init_scale"] == ["fp16"] and used["max_consecutive_skips"] == ["fp16", "fp8"]
    assert used["amax_history"] == ["fp8"] and used["compute_copy"] == ["fp16", "bf16", "fp8"]


def test_each_activation_names_epilogs_of_the_contract() -> None:
    assert ACTIVATIONS.names() == ("relu", "gelu", "none")
    for name, spec in ACTIVATIONS.items():
        epilogs = (spec.forward, spec.infer, spec.backward, spec.backward_bgrad)
        assert all(e is None for e in epilogs) if name == "none" else all(e in EPILOG_INPUTS for e in epilogs)
        assert bool(spec.aux) == (name != "none")
        bias_free = (spec.forward_no_bias, spec.infer_no_bias)  # both or neither; neither: the bias epilogs read zeros
        assert all(e in EPILOG_INPUTS for e in bias_free) or bias_free == (None, None)
        assert (spec.forward_no_bias is None) == (name in ("relu", "none"))


def test_each_loss_is_callable_with_the_head_s_signature() -> None:
    z, y = np.array([[2.0, -1.0, 0.5], [0.0, 0.3, 0.1]]), np.array([0, 2])
    for _, spec in LOSSES.items():
        loss, d, correct, db = spec.fn(z.copy(), y, 1.0, bias_grad=True)
        assert d.shape == z.shape and db.shape == (3,) and int(correct) == 1 and float(loss) > 0


def test_the_docs_steps_name_files_that_exist() -> None:
    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "architecture.md").read_text()
    section = text.split("## Where to change: an optimizer, a loss, a precision", 1)[1].split("\n## ", 1)[0]
    paths = {w for w in re.findall(r"`([^`\s<(]+)`", section) if "/" in w or w.endswith(".py")}
    assert len(paths) >= 8, paths
    assert all((root / p).exists() for p in paths), sorted(p for p in paths if not (root / p).exists())


def test_an_optimizer_reading_a_setting_the_schema_lacks_is_refused_by_name() -> None:
    class Rho(Optimizer):
        settings = {"rho": None}

    OPTIMIZERS.add("rho_opt", OptimizerSpec(Rho))
    try:
        with pytest.raises(ConfigError, match=r"optimizer=rho_opt reads optimizer.rho, which is no field of Optimizer"):
            validate(TrainConfig())
    finally:
        OPTIMIZERS.remove("rho_opt")
