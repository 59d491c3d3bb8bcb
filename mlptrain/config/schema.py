"""Typed configuration: the dataclass schema Hydra validates against, one help text per key.

The schema is stored in Hydra's ConfigStore as ``train_schema`` (:func:`mlptrain.cli.help.register_configs`)
and listed first in ``conf/config.yaml``'s defaults, so Hydra rejects unknown keys, wrong types and unknown
enum values while composing. :mod:`mlptrain.step.checks` checks what types cannot (ranges, keys that the
chosen options do not use). Every field carries its help text in ``metadata["help"]``, which
``python -m mlptrain --help`` lists (:mod:`mlptrain.cli.help`): the schema is the one place a setting is
described. It imports nothing of mlptrain.

The settings that name a registered option (``model.activation``, ``model.loss``, ``optimizer.name``,
``precision.name``) are ``str``: their options are the entries of a registry, which grows when an
option registers (:mod:`mlptrain.step.choices`); :mod:`mlptrain.step.checks` refuses an unknown name and
``--help`` lists the registered ones in place of ``{choices}`` in their help.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional


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
    ``auto``: per layer shape, the one measured faster (see :mod:`mlptrain.nn.execution`).
    """

    auto = "auto"
    drelu_bgrad = "drelu_bgrad"
    bgradb = "bgradb"


class Init(str, Enum):
    he = "he"  # N(0, 2/in) for ReLU/GELU layers, LeCun N(0, 1/in) for the output layer; zero biases
    lecun = "lecun"  # N(0, 1/in); zero biases
    torch = "torch"  # PyTorch's nn.Linear default: weights and biases U(-1/sqrt(in), 1/sqrt(in)), every layer


class DatasetName(str, Enum):
    digits = "digits"
    mnist1d = "mnist1d"
    mnist = "mnist"
    fashion_mnist = "fashion_mnist"
    synthetic = "synthetic"
    file = "file"


class Task(str, Enum):
    auto = "auto"
    classification = "classification"
    regression = "regression"


class Normalize(str, Enum):
    standard = "standard"
    minmax = "minmax"
    robust = "robust"
    quantile = "quantile"
    none = "none"


class Residency(str, Enum):
    auto = "auto"
    device = "device"
    host = "host"
    stream = "stream"


class TargetScaling(str, Enum):
    standard = "standard"
    none = "none"


class Schedule(str, Enum):
    constant = "constant"
    cosine = "cosine"


class Logger(str, Enum):
    none = "none"
    tensorboard = "tensorboard"


class ComputeCopy(str, Enum):
    auto = "auto"  # the precision's own: kept for fp16 and bf16, cast for fp8
    kept = "kept"
    cast = "cast"


def values(enum: type[Enum], *, but: Enum | None = None) -> tuple[str, ...]:
    """The names ``enum`` accepts, in its order (``but``: one left out, ``auto``, which picks among the others).

    The code that takes these settings as plain strings (the network, the torch front end, the
    scikit-learn estimators, the benchmarks) checks them against these lists, so each is spelled once.
    """
    return tuple(str(m.value) for m in enum if m is not but)


BGRAD_STRATEGIES = values(Bgrad, but=Bgrad.auto)  # what one hidden layer takes: drelu_bgrad, bgradb
COMPUTE_COPIES = values(ComputeCopy, but=ComputeCopy.auto)  # kept, cast
TASKS = values(Task, but=Task.auto)  # a dataset's task: classification, regression
SCHEDULES = values(Schedule)
NORMALIZATIONS = values(Normalize)


def _f(default: Any, help: str, factory: Any = None, choices: bool = False, users: bool = False) -> Any:
    """A schema field with its help text (``python -m mlptrain --help`` lists them); ``choices``: the
    setting names a registered option, listed from its registry in place of ``{choices}``; ``users``:
    the registered options that read the setting replace ``{users}``."""
    metadata = {"help": help, "choices": choices, "users": users}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    """An MLP: ``in_features -> hidden[0] -> ... -> hidden[-1] -> out_features``."""

    hidden: list[int] = _f(None, "widths of the hidden layers", factory=lambda: [128, 128])
    in_features: Optional[int] = _f(None, "input width; null: the dataset's (if given, it must match)")
    out_features: Optional[int] = _f(None, "output width; null: the dataset's classes or targets")
    activation: str = _f("relu", "hidden layers: {choices}", choices=True)
    init: Init = _f(
        Init.he, "initial weights: he, lecun, or torch (nn.Linear's default, biases too; data=file's: a table's recipe)"
    )
    loss: str = _f("cross_entropy", "{choices}", choices=True)
    class_weight: Any = _f(
        None,
        "cross_entropy: each row's loss weighted by its class, the weighted mean sum(w_i l_i) / sum(w_i) (torch's "
        "CrossEntropyLoss(weight=...)); null: unweighted; balanced: n_samples / (n_classes * count) on the training "
        "split (scikit-learn's); or a list of one weight >= 0 per class, in the classes' order",
    )
    embedding_dim: Optional[int] = _f(
        None,
        "data=file: each categorical column with at least model.embedding_min_levels one-hot columns goes through a "
        "learned embedding of this width before the first layer (the factorised first layer, folded into a plain MLP "
        "for predict and export; docs/data.md); null or 0: every one-hot column goes into the first layer",
    )
    embedding_min_levels: int = _f(
        64, "model.embedding_dim: the one-hot columns a categorical column needs to be embedded"
    )


@dataclass
class DataConfig:
    name: DatasetName = _f(DatasetName.digits, "the dataset (data=<name> selects its config group)")
    batch_size: int = _f(64, "training batch size")
    eval_batch_size: int = _f(1024, "batch size of evaluation")
    drop_last: bool = _f(False, "drop the last, short training batch of an epoch")
    normalize: Normalize = _f(
        Normalize.standard,
        "feature scaling from the train split's statistics (in float64): standard (x - mean) / std, minmax, "
        "robust (x - median) / IQR (std where the IQR is 0), quantile (through the column's training quantiles to a "
        "standard normal, scikit-learn's QuantileTransformer: 1000 quantiles of a 10,000-row sample seeded by "
        "data.split_seed) or none; every column that varies is scaled whatever its spread, a constant one becomes 0; "
        "the column plan's 0/1 columns (<name>_missing, one-hot) stay 0/1, as scikit-learn's ColumnTransformer "
        "leaves one-hot columns",
    )
    target_scaling: TargetScaling = _f(
        TargetScaling.standard,
        "regression: targets standardised with the train split's mean and std for training (outputs and losses "
        "stay in the target's units); none: trained as given",
    )
    val_fraction: float = _f(0.1, "share of the training data held out for validation (stratified)")
    test_fraction: float = _f(0.2, "share held out for testing, where the dataset has no test split of its own")
    split_seed: int = _f(0, "seed of the validation and test splits (and of synthetic data); seed does not change them")
    root: Optional[str] = _f(None, "mnist, fashion_mnist: download cache folder; null: $MLPTRAIN_DATA or ~/.cache")
    download: bool = _f(True, "mnist, fashion_mnist: download missing files")
    samples: Optional[int] = _f(
        None,
        "synthetic, mnist1d: number of samples; null: the dataset's own (synthetic 10000; mnist1d 5000, its standard "
        "draw of 4000 training and 1000 test samples)",
    )
    features: Any = _f(
        32, "synthetic: number of features; file: the only feature columns to keep, a list ([a,b]; null: all)"
    )
    classes: int = _f(10, "synthetic: number of classes")
    path: Optional[str] = _f(None, "file: the training data (CSV/TSV with a header, .gz, NPZ, Parquet)")
    test_path: Optional[str] = _f(None, "file: a test file with the same columns; null: split from path")
    target: Any = _f("label", "file: the target column, or a list of columns (regression)")
    task: Task = _f(
        Task.auto,
        "file: classification or regression (which sets model.loss=mse where model.loss is not given); auto: a "
        "regression loss (mse) or the target columns decide",
    )
    cache: bool = _f(True, "file: keep a binary copy of a parsed file, memory-mapped by the next run")
    missing: str = _f("error", "file: rows whose target is empty, NA, null or NaN: error (names them) or drop")
    drop: list[str] = _f(None, "file: columns to leave out (ids, leakage), a list: data.drop=[id]", factory=list)
    categorical: list[str] = _f(
        None, "file: numeric columns that are categories (integer codes); any column with text is one already", list
    )
    min_frequency: int = _f(
        1, "file: a category level of fewer training rows is grouped into one <rare> column (1: none grouped)"
    )
    weight: Optional[str] = _f(
        None,
        "file: a column of row weights (numbers >= 0), taken out of the features: the training loss is the weighted "
        "mean sum(w_i l_i)/sum(w_i) (times model.class_weight where both are set); the validation and test losses "
        "and scores are unweighted; predict and evaluate ignore the column",
    )
    impute: str = _f(
        "fill",
        "file: empty feature cells: fill (numeric: the training median and a 0/1 <name>_missing column; "
        "categorical: a level of its own) or error",
    )
    residency: Residency = _f(
        Residency.auto,
        "where the splits live: device (copied to the GPU once, batches gathered there), host (batches gathered in "
        "host memory and copied ahead of each step: data larger than the GPU), stream (as host, but no split is "
        "made: each batch's rows read from the memory-mapped table and normalised as they are gathered: data larger "
        "than host memory); auto: device where the splits fit, else host, else stream",
    )


@dataclass
class OptimizerConfig:
    name: str = _f("sgd", "{choices} (optimizer=<name> selects its group)", choices=True)
    lr: float = _f(0.05, "learning rate (the peak of the schedule)")
    momentum: float = _f(0.9, "{users}: momentum", users=True)
    nesterov: bool = _f(False, "{users}: Nesterov momentum", users=True)
    weight_decay: float = _f(0.0, "L2 weight decay (decoupled for adamw)")
    beta1: float = _f(0.9, "{users}: decay of the first moment", users=True)
    beta2: float = _f(0.999, "{users}: decay of the second moment", users=True)
    eps: float = _f(1e-8, "{users}: added to the denominator", users=True)
    state_dtype: Optional[str] = _f(None, "the state's dtype: null (the master's) or bfloat16 (not Adam's 2nd moment)")
    schedule: Schedule = _f(Schedule.cosine, "learning-rate schedule after warm-up")
    warmup_steps: int = _f(0, "linear warm-up steps")
    min_lr_ratio: float = _f(0.0, "cosine: the last step's rate as a share of lr")


@dataclass
class ExecutionConfig:
    mode: Mode = _f(Mode.fused, "fused: bias, ReLU and their gradients in cuBLASLt epilogs; naive: separate ops")
    bgrad: Bgrad = _f(Bgrad.auto, "fused: where a hidden layer's bias gradient is reduced; auto: measured (GPU)")
    autotune: bool = _f(False, "GPU: time cuBLASLt's candidate algorithms per GEMM and keep the fastest")
    plan_cache: bool = _f(True, "GPU: remember planned algorithms and measured choices on disk")
    wgrad_stream: Optional[bool] = _f(
        None,
        "GPU: weight gradients on a second stream, beside the input-gradient chain; null: where the step is "
        "small (below 1e11 GEMM FLOPs) or data parallel; one stream needs less memory",
    )
    head_kernel: bool = _f(True, "GPU, fused, small heads: the output layer's input gradient as one kernel")
    epilogue_kernels: Optional[bool] = _f(
        None,
        "GPU, fused, bf16: DRELU(_BGRAD) and BGRADB as the plain GEMM and mlptrain's kernels, not cuBLASLt's; "
        "null: for an ensemble's batched GEMMs and single ones of at least 2^31 multiply-adds (M N K)",
    )
    precompile: bool = _f(
        True,
        "GPU: compile the run's CuPy kernels on threads during start-up, before their first launch; false: each "
        "compiles at its first launch (to measure what compiling ahead saves: docs/benchmarks.md)",
    )
    workspace_mib: Optional[int] = _f(
        64, "GPU: cap on each GEMM's cuBLASLt workspace, MiB; null: nvmath's default (up to 80% of the memory)"
    )


@dataclass
class PrecisionConfig:
    name: str = _f(
        "fp32",
        "{choices} (precision=<name>); fp8: FP8 GEMMs on Hopper, worth it where the step is GEMM-bound (hidden "
        "widths of thousands), emulated and slow on the CPU",
        choices=True,
    )
    init_scale: float = _f(65536.0, "{users}: initial loss scale", users=True)
    growth_factor: float = _f(2.0, "{users}: the scale grows by this after growth_interval clean steps", users=True)
    backoff_factor: float = _f(0.5, "{users}: the scale shrinks by this after an overflow", users=True)
    growth_interval: int = _f(2000, "{users}: clean steps before the scale grows", users=True)
    max_consecutive_skips: int = _f(50, "{users}: stop after this many skipped (inf/NaN) steps in a row", users=True)
    amax_history: int = _f(
        16, "{users}: steps of amax history each FP8 tensor's scale is taken from (delayed scaling)", users=True
    )
    margin: int = _f(0, "{users}: each scale leaves 2^margin of headroom below the FP8 format's max", users=True)
    compute_copy: ComputeCopy = _f(
        ComputeCopy.auto,
        "{users}: kept: a half-precision copy of every parameter, refreshed by the optimizer; cast: none, "
        "each layer's cast just before its GEMMs (less memory for the largest models, a cast kernel per layer; "
        "fp8: the FP8 casts read the float32 weights, only biases and the head are cast); auto: kept for "
        "fp16 and bf16, cast for fp8",
        users=True,
    )


@dataclass
class EarlyStoppingConfig:
    patience: int = _f(0, "stop after this many epochs without an improvement of the metric (0: off; data=file: 10)")
    metric: str = _f(
        "auto",
        "the epoch metric that selects best.npz and stops early: train/loss, train/acc, val/loss, val/acc, "
        "val/balanced_acc, val/f1_macro, val/precision_macro, val/recall_macro, val/log_loss, val/roc_auc (two "
        "classes), val/rmse, val/mae, val/r2; auto: val/acc or val/loss (data=file: val/loss, or train/loss with "
        "data.val_fraction=0 and no ensemble.folds)",
    )
    mode: str = _f(
        "auto",
        "max or min; auto: max for an accuracy or a score (balanced_acc, f1, roc_auc, r2), min for a loss or an error",
    )
    min_delta: float = _f(0.0, "an improvement must be larger than this")


@dataclass
class DistributedConfig:
    gpus: int = _f(1, "data parallel: one process per GPU on this host (torchrun and mpirun: their ranks)")
    timeout_s: float = _f(300.0, "data parallel: a rank that makes no progress for this long stops the run")
    verify: bool = _f(False, "data parallel: check at every log interval that every rank holds the same parameters")
    bucket_mib: float = _f(25.0, "data parallel: weight gradients go in all-reduces of at least this size, MiB")


@dataclass
class EnsembleConfig:
    """K models of one shape in one run, trained as one batched GEMM per layer role (docs/ensembles.md)."""

    size: int = _f(1, "members trained together, seeds seed..seed+size-1 (1: one model, the usual run)")
    folds: int = _f(
        0,
        "K-fold cross-validation in one run (K >= 2, sets size=K): member k trains on every fold of the training "
        "and validation rows but k (stratified, seeded by seed) and validates on fold k; val/ scores are out of fold",
    )
    lr: Optional[list[float]] = _f(None, "per-member learning rates (length size), a batched sweep; null: optimizer.lr")
    weight_decay: Optional[list[float]] = _f(
        None, "per-member weight decay (length size), a batched sweep; null: optimizer.weight_decay"
    )


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    ensemble: EnsembleConfig = field(default_factory=EnsembleConfig)
    device: Device = _f(Device.auto, "auto (the GPU when there is one), cpu or gpu")
    seed: int = _f(0, "seed of the initial weights and the data order")
    epochs: int = _f(
        20,
        "epochs to train (data=file: 200, with early_stopping.patience=10 on val/loss, optimizer=adam, batch 200, "
        "model.init=torch)",
    )
    log_every: int = _f(10, "read the metrics back from the device every this many steps (one sync)")
    progress: Optional[bool] = _f(None, "progress bars; null: when stderr is a terminal")
    checkpoint_every: int = _f(1, "save checkpoints/last.npz every this many epochs (0: only at the end)")
    checkpoint_steps: int = _f(
        0, "also save last every this many steps (0: off); a kill loses at most 2x this many (one write at a time)"
    )
    resume: Optional[str] = _f(None, "continue a run: last, best, or the path of a checkpoint or run directory")
    graph: Optional[bool] = _f(None, "GPU: replay the step as a CUDA graph; null: on")
    max_steps: Optional[int] = _f(None, "stop after this many steps (null: all epochs)")
    logger: Logger = _f(Logger.none, "tensorboard: also write event files into <run dir>/tensorboard")
    optimized_metric: Optional[str] = _f(None, "the summary value returned to a Hydra sweeper; null: the best metric")


def ensemble_members(cfg: TrainConfig) -> int:
    """The models a run trains: ``ensemble.folds`` (cross-validation), else ``ensemble.size`` (1: one model)."""
    return cfg.ensemble.folds or cfg.ensemble.size


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
