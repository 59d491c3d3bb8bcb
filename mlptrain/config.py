"""Typed configuration: the dataclass schema Hydra validates against, and semantic checks.

The schema is stored in Hydra's ConfigStore as ``train_schema`` and listed first in
``conf/config.yaml``'s defaults, so Hydra rejects unknown keys, wrong types and unknown enum
values while composing. :func:`validate` then checks what types cannot (positive learning
rate, widths, precision a device can run) and raises one :class:`ConfigError` listing every
problem with its key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any, Optional

from mlptrain.errors import ConfigError


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    gpu = "gpu"


class Mode(str, Enum):
    fused = "fused"
    naive = "naive"


class Bgrad(str, Enum):
    """Where a ReLU layer's bias gradient is computed in the fused backward.

    ``drelu_bgrad``: in the input-gradient GEMM of the layer above (DRELU_BGRAD epilog).
    ``bgradb``: in the layer's own weight-gradient GEMM (DRELU above, BGRADB here).
    ``auto``: per layer shape, the one measured faster (see :mod:`mlptrain.execution`).
    """

    auto = "auto"
    drelu_bgrad = "drelu_bgrad"
    bgradb = "bgradb"


class Activation(str, Enum):
    relu = "relu"
    none = "none"


class Init(str, Enum):
    he = "he"
    lecun = "lecun"


class LossName(str, Enum):
    cross_entropy = "cross_entropy"
    mse = "mse"


class DatasetName(str, Enum):
    digits = "digits"
    mnist1d = "mnist1d"
    mnist = "mnist"
    fashion_mnist = "fashion_mnist"
    synthetic = "synthetic"


class Normalize(str, Enum):
    standard = "standard"
    minmax = "minmax"
    none = "none"


class OptimizerName(str, Enum):
    sgd = "sgd"
    adam = "adam"
    adamw = "adamw"


class Schedule(str, Enum):
    constant = "constant"
    cosine = "cosine"


class PrecisionName(str, Enum):
    fp64 = "fp64"
    fp32 = "fp32"
    tf32 = "tf32"
    fp16 = "fp16"
    bf16 = "bf16"


@dataclass
class ModelConfig:
    """An MLP: ``in_features -> hidden[0] -> ... -> hidden[-1] -> out_features``."""

    hidden: list[int] = field(default_factory=lambda: [128, 128])
    # None: taken from the dataset. If given, it must match the dataset.
    in_features: Optional[int] = None
    out_features: Optional[int] = None
    activation: Activation = Activation.relu
    init: Init = Init.he
    loss: LossName = LossName.cross_entropy


@dataclass
class DataConfig:
    name: DatasetName = DatasetName.digits
    batch_size: int = 64
    eval_batch_size: int = 1024
    drop_last: bool = False
    normalize: Normalize = Normalize.standard
    val_fraction: float = 0.1
    # Used only by datasets without an official test split (digits, synthetic).
    test_fraction: float = 0.2
    # Cache folder for downloaded files; None: $MLPTRAIN_DATA or ~/.cache/mlptrain.
    root: Optional[str] = None
    download: bool = True
    # synthetic only
    samples: int = 10000
    features: int = 32
    classes: int = 10


@dataclass
class OptimizerConfig:
    name: OptimizerName = OptimizerName.sgd
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    schedule: Schedule = Schedule.cosine
    warmup_steps: int = 0
    # cosine decays to lr * min_lr_ratio at the last step
    min_lr_ratio: float = 0.0


@dataclass
class ExecutionConfig:
    mode: Mode = Mode.fused
    bgrad: Bgrad = Bgrad.auto
    # GPU only: time cuBLASLt's candidate algorithms per planned GEMM (in a CUDA graph), keep the fastest.
    autotune: bool = False
    # GPU only: remember planned (and autotuned) algorithms on disk per GPU model, shape and dtype.
    plan_cache: bool = True
    # GPU only: weight-gradient GEMMs on a second CUDA stream, concurrent with the input-gradient
    # chain (mlptrain.network._WgradStream); false runs the backward on one stream.
    wgrad_stream: bool = True
    # GPU only, small heads (batch <= 1024, classes <= 32) with cross-entropy and ReLU: one small
    # kernel computes the output layer's input gradient with its dReLU and bias-gradient sum
    # (mlptrain.head), replacing a K = classes GEMM; false runs that GEMM with DRELU(_BGRAD).
    head_kernel: bool = True


@dataclass
class PrecisionConfig:
    name: PrecisionName = PrecisionName.fp32
    # Dynamic loss scaling (fp16 only; ignored otherwise), torch GradScaler semantics.
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    # Stop the run after this many consecutive skipped (overflowing) steps.
    max_consecutive_skips: int = 50


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    device: Device = Device.auto
    seed: int = 0
    epochs: int = 20
    # Read metrics back from the device every log_every steps (the only host syncs of a step).
    log_every: int = 10
    # None: progress bars when stderr is a terminal; true/false forces them on/off.
    progress: Optional[bool] = None
    # Checkpoints: save `last` every checkpoint_every epochs (0: only at the end).
    checkpoint_every: int = 1
    # Also save `last` every this many optimizer steps (0: off), so a killed run loses at most that many.
    checkpoint_steps: int = 0
    # Resume from a checkpoint path, or "last" for the run directory's last checkpoint.
    resume: Optional[str] = None
    # GPU: replay the training step from a CUDA graph (None: on when a GPU is used; false: off).
    graph: Optional[bool] = None
    # Stop after this many optimizer steps (None: run all epochs). For tests and benchmarks.
    max_steps: Optional[int] = None


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check what the types cannot; raise one ConfigError listing every problem.

    Returns ``cfg`` unchanged so the call can be chained.
    """
    problems: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            problems.append(msg)

    m, d, o, p = cfg.model, cfg.data, cfg.optimizer, cfg.precision
    for key, value in _floats(cfg):
        need(math.isfinite(value), f"{key}={value} must be a finite number")
    need(cfg.seed >= 0, f"seed={cfg.seed} must be a non-negative integer")
    for i, w in enumerate(m.hidden):
        need(w >= 1, f"model.hidden[{i}]={w} must be a positive layer width")
    for key in ("in_features", "out_features"):
        v = getattr(m, key)
        need(v is None or v >= 1, f"model.{key}={v} must be a positive width or null (taken from the dataset)")
    need(d.batch_size >= 1, f"data.batch_size={d.batch_size} must be a positive integer")
    need(d.eval_batch_size >= 1, f"data.eval_batch_size={d.eval_batch_size} must be a positive integer")
    need(0.0 <= d.val_fraction < 1.0, f"data.val_fraction={d.val_fraction} must be in [0, 1)")
    need(0.0 < d.test_fraction < 1.0, f"data.test_fraction={d.test_fraction} must be in (0, 1)")
    need(d.val_fraction + d.test_fraction < 1.0, "data.val_fraction + data.test_fraction must be below 1")
    need(d.samples >= 2, f"data.samples={d.samples} must be at least 2")
    need(d.features >= 1, f"data.features={d.features} must be positive")
    need(d.classes >= 2, f"data.classes={d.classes} must be at least 2")
    need(o.lr > 0, f"optimizer.lr={o.lr} must be positive")
    need(0.0 <= o.momentum < 1.0, f"optimizer.momentum={o.momentum} must be in [0, 1)")
    need(not o.nesterov or o.momentum > 0, "optimizer.nesterov=true needs optimizer.momentum > 0")
    need(o.weight_decay >= 0, f"optimizer.weight_decay={o.weight_decay} must be >= 0")
    need(0.0 <= o.beta1 < 1.0, f"optimizer.beta1={o.beta1} must be in [0, 1)")
    need(0.0 <= o.beta2 < 1.0, f"optimizer.beta2={o.beta2} must be in [0, 1)")
    need(o.eps > 0, f"optimizer.eps={o.eps} must be positive")
    need(o.warmup_steps >= 0, f"optimizer.warmup_steps={o.warmup_steps} must be >= 0")
    need(0.0 <= o.min_lr_ratio <= 1.0, f"optimizer.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    need(p.init_scale > 0, f"precision.init_scale={p.init_scale} must be positive")
    need(p.growth_factor > 1, f"precision.growth_factor={p.growth_factor} must be > 1")
    need(0 < p.backoff_factor < 1, f"precision.backoff_factor={p.backoff_factor} must be in (0, 1)")
    need(p.growth_interval >= 1, f"precision.growth_interval={p.growth_interval} must be >= 1")
    need(p.max_consecutive_skips >= 1, f"precision.max_consecutive_skips={p.max_consecutive_skips} must be >= 1")
    need(cfg.epochs >= 1, f"epochs={cfg.epochs} must be a positive integer")
    need(cfg.log_every >= 1, f"log_every={cfg.log_every} must be a positive integer")
    need(cfg.checkpoint_every >= 0, f"checkpoint_every={cfg.checkpoint_every} must be >= 0")
    need(cfg.checkpoint_steps >= 0, f"checkpoint_steps={cfg.checkpoint_steps} must be >= 0 (0: off)")
    need(cfg.max_steps is None or cfg.max_steps >= 1, f"max_steps={cfg.max_steps} must be positive or null")
    if problems:
        raise ConfigError("invalid configuration: " + "; ".join(problems))
    return cfg


def _floats(node: Any, prefix: str = "") -> list[tuple[str, float]]:
    """Every float setting of a config dataclass, by dotted key."""
    out: list[tuple[str, float]] = []
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            out += _floats(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            out.append((f"{prefix}{f.name}", value))
    return out


def register_configs() -> None:
    """Store :class:`TrainConfig` in Hydra's ConfigStore as ``train_schema``.

    ``conf/config.yaml`` lists ``train_schema`` first in its defaults, so the group files
    (``model/``, ``data/``, ...) and command-line overrides merge into typed nodes and a typo
    fails at compose time. No per-group schemas are stored: each would show up as a selectable
    group option named after it. Safe to call more than once.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def to_plain(cfg: TrainConfig) -> dict[str, Any]:
    """The config as plain JSON-ready data (enums as their values), for run records."""
    from dataclasses import asdict

    def fix(v: Any) -> Any:
        if isinstance(v, Enum):
            return v.value
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    return fix(asdict(cfg))


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: nested config dicts as dotted keys, for comparing configs."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
