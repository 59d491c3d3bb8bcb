"""What the types of the schema cannot check: ranges, and settings that would be silently ignored.

:func:`validate` raises one :class:`~mlptrain.base.errors.ConfigError` listing every problem, each with
its key: a value out of range or not finite; a key that is no setting at all (``+optimizer.lrr``,
with the real key to use: :func:`mlptrain.config.keys.suggest`); and a setting that the chosen options do not use
(``data.features`` with ``data=digits``, ``optimizer.momentum`` with ``optimizer=adam``), so that
a configuration never ignores what was said. A setting counts as said when it differs from the
schema's default; :func:`uses` says where each option-specific setting applies: :data:`USES` for
the fixed options, and what the registries declare for the registered ones (the settings each
optimizer reads, :attr:`mlptrain.step.optim.Optimizer.settings`; each precision's,
:data:`mlptrain.step.precision.SETTINGS`). The ranges of those settings come from the same declarations,
worded as :class:`mlptrain.base.registry.Range` words them, and a name no registry holds is refused
(:mod:`mlptrain.step.choices`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from typing import Any

from mlptrain.base.errors import ConfigError
from mlptrain.base.optim_state import state_dtype_problem
from mlptrain.base.registry import joined
from mlptrain.config.keys import suggest
from mlptrain.config.schema import DataConfig, OptimizerConfig, TrainConfig, ensemble_members, flatten, to_plain
from mlptrain.data.sources import mnist1d_samples_problem
from mlptrain.nn import embedding, scores
from mlptrain.nn.losses import class_weight_problem, regression_losses
from mlptrain.step import optim
from mlptrain.step.choices import unknown_names
from mlptrain.step.precision import PRECISIONS, SETTINGS

Uses = dict[str, tuple[Callable[[TrainConfig], bool], str]]
MAX_LOG_EVERY = 1_000_000  # 28 MB of ring on the device (StepLog), and as much on the host
SEEDS = 2**32  # seeds are below this: NumPy's legacy seeding and scikit-learn's random_state take no more
_OPTIMIZER_FIELDS = {f.name for f in fields(OptimizerConfig)}


def _data(*names: str) -> Callable[[TrainConfig], bool]:
    return lambda c: c.data.name.value in names


def _named(group: str, names: list[str]) -> Callable[[TrainConfig], bool]:
    """Whether ``<group>.name`` is one of ``names``."""
    return lambda c: getattr(c, group).name in names


def _launched() -> bool:
    """Started by torchrun or mpirun as one rank of a group (:mod:`mlptrain.distributed.launch`)."""
    return any(k in os.environ for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))


def _gpu(c: TrainConfig) -> bool:
    return c.device.value != "cpu"


# Option-specific settings of the fixed options: key -> (whether the chosen options use it, where it applies).
USES: Uses = {
    "data.samples": (_data("synthetic", "mnist1d"), "data=synthetic and data=mnist1d"),
    "data.features": (_data("synthetic", "file"), "data=synthetic (a count) and data=file (a list of columns)"),
    "data.classes": (_data("synthetic"), "data=synthetic"),
    "data.root": (_data("mnist", "fashion_mnist"), "data=mnist and data=fashion_mnist"),
    "data.download": (_data("mnist", "fashion_mnist"), "data=mnist and data=fashion_mnist"),
    "data.path": (_data("file"), "data=file"),
    "data.test_path": (_data("file"), "data=file"),
    "data.target": (_data("file"), "data=file"),
    "data.task": (_data("file"), "data=file"),
    "data.cache": (_data("file"), "data=file"),
    "data.missing": (_data("file"), "data=file"),
    **{f"data.{k}": (_data("file"), "data=file") for k in ("drop", "categorical", "min_frequency", "impute", "weight")},
    "data.test_fraction": (
        lambda c: c.data.name.value in ("digits", "synthetic", "file") and not c.data.test_path,
        "datasets without a test split of their own (digits, synthetic, data=file without data.test_path)",
    ),
    "optimizer.min_lr_ratio": (lambda c: c.optimizer.schedule.value == "cosine", "optimizer.schedule=cosine"),
    "execution.bgrad": (lambda c: c.execution.mode.value == "fused", "execution=fused"),
    "execution.head_kernel": (lambda c: c.execution.mode.value == "fused" and _gpu(c), "execution=fused on a GPU"),
    "execution.autotune": (_gpu, "the GPU"),
    "execution.precompile": (_gpu, "the GPU"),
    "execution.plan_cache": (_gpu, "the GPU"),
    "execution.wgrad_stream": (_gpu, "the GPU"),
    "execution.workspace_mib": (_gpu, "the GPU"),
    "graph": (_gpu, "the GPU"),
    "distributed.bucket_mib": (
        lambda c: c.distributed.gpus > 1 or _launched(),
        "data parallel runs (distributed.gpus > 1, torchrun, mpirun)",
    ),
    "distributed.verify": (
        lambda c: c.distributed.gpus > 1 or _launched(),
        "data parallel runs (distributed.gpus > 1, torchrun, mpirun)",
    ),
    "distributed.timeout_s": (
        lambda c: c.distributed.gpus > 1 or _launched(),
        "data parallel runs (distributed.gpus > 1, torchrun, mpirun)",
    ),
}


def uses() -> Uses:
    """:data:`USES`, and the settings of the registered options: those of the losses, optimizers and
    precisions registered now (a registry may have grown since import)."""
    out = dict(USES)
    regressions = regression_losses()
    out["data.target_scaling"] = (
        lambda c: c.model.loss in regressions,
        f"regressions ({joined([f'model.loss={n}' for n in regressions], 'or')})",
    )
    for key in optim.setting_ranges():
        if (names := optim.users(key)) and key in _OPTIMIZER_FIELDS:
            where = joined([f"optimizer={n}" for n in names])
            out[f"optimizer.{key}"] = (_named("optimizer", names), where)
    for key, (reads, what, _) in SETTINGS.items():
        names = [n for n, spec in PRECISIONS.items() if reads(spec)]
        out[f"precision.{key}"] = (_named("precision", names), f"precision={joined(names)} ({what})")
    return out


def validate(cfg: TrainConfig, *, data_parallel: bool = False) -> TrainConfig:
    """Check what the types cannot; raise one ConfigError listing every problem. Returns ``cfg``.

    ``data_parallel``: this process is one rank of a group (the ``distributed.*`` settings apply)."""
    check_ensemble(cfg, data_parallel)  # (its own message: what an ensemble does not run with)
    problems = unknown_keys(cfg) + _ranges(cfg) + _unused(cfg, data_parallel) + _class_weight(cfg)
    problems += embedding.problems(cfg, data_parallel)  # model.embedding_*: values, and what it does not run with
    if problems:
        raise ConfigError("invalid configuration: " + "; ".join(problems))
    return cfg


def check_ensemble(cfg: TrainConfig, data_parallel: bool = False) -> None:
    """ConfigError for an ensemble setting out of range, or combined with what an ensemble does not run yet."""
    e, members = cfg.ensemble, ensemble_members(cfg)
    given = f"ensemble.folds={e.folds}" if e.folds else f"ensemble.size={members}"  # the setting that made them
    if isinstance(e.size, bool) or not isinstance(e.size, int) or e.size < 1:
        raise ConfigError(f"ensemble.size={e.size!r} must be a positive integer (1: one model)")
    if e.folds and (e.folds < 2 or e.size not in (1, e.folds)):
        raise ConfigError(
            f"ensemble.folds={e.folds} with ensemble.size={e.size}: folds need at least 2, and make one member per "
            "fold (leave ensemble.size at 1)"
        )
    for key in ("lr", "weight_decay"):
        values = getattr(e, key)
        if values is None:
            continue
        if members == 1 or len(values) != members:
            counted = f"{given}: {members} members" if e.folds else given
            raise ConfigError(
                f"ensemble.{key}={list(values)} has {len(values)} values; a batched sweep gives one per member "
                f"({counted}, at least 2)"
            )
        if any(not math.isfinite(v) or (v <= 0 if key == "lr" else v < 0) for v in values):
            bound = "> 0" if key == "lr" else ">= 0"
            raise ConfigError(f"ensemble.{key}={list(values)}: each must be a finite number {bound}")
    if members == 1:
        return
    refused = {
        "precision=fp8": cfg.precision.name == "fp8",
        "data parallel (distributed.gpus > 1, torchrun, mpirun)": data_parallel or cfg.distributed.gpus > 1,
        "precision.compute_copy=cast": cfg.precision.compute_copy.value == "cast",
        f"data.residency={cfg.data.residency.value}": cfg.data.residency.value in ("host", "stream"),
        f"data.weight={cfg.data.weight} (row weights)": cfg.data.weight is not None,
    }
    found = [name for name, on in refused.items() if on]
    if found:
        raise ConfigError(
            f"{given} does not run with {', '.join(found)} yet; leave "
            f"{'it' if len(found) == 1 else 'them'} at the default, or train the members as separate runs"
        )


def _weight_taken(d: Any) -> bool:
    """Whether the ``data.weight`` column is a target or dropped as well."""
    targets = [d.target] if isinstance(d.target, str) else list(d.target or [])
    return d.weight is not None and (d.weight in targets or d.weight in list(d.drop or []))


def _class_weight(cfg: TrainConfig) -> list[str]:
    """``model.class_weight``: its form (its length is checked against the classes when the data is loaded)."""
    spec = cfg.model.class_weight
    if spec is None:
        return []
    if (problem := class_weight_problem(spec)) is not None:
        return [problem]
    if cfg.model.loss != "cross_entropy":
        return [f"model.class_weight weights the cross_entropy loss; model.loss={cfg.model.loss} takes none"]
    return []


def unknown_keys(node: Any, prefix: str = "") -> list[str]:
    """Attributes of the config that are no setting (``+optimizer.lrr=0.1`` adds one), each with a suggestion."""
    known = {f.name for f in fields(node)}
    problems = []
    for name, value in vars(node).items():
        if name not in known:
            problems.append(f"{prefix}{name} is not a setting{suggest(prefix + name, value)}")
        elif is_dataclass(value):
            problems += unknown_keys(value, f"{prefix}{name}.")
    return problems


def _unused(cfg: TrainConfig, data_parallel: bool = False) -> list[str]:
    """Settings changed from their default that the chosen options do not use."""
    default, now = flatten(to_plain(TrainConfig())), flatten(to_plain(cfg))
    problems = []
    for key, (applies, where) in uses().items():
        if data_parallel and key.startswith("distributed."):
            continue
        if now.get(key) != default[key] and not applies(cfg):
            problems.append(f"{key}={_yaml(now[key])} is not used with {_chosen(cfg, key)}: it applies to {where}")
    return problems


def _chosen(cfg: TrainConfig, key: str) -> str:
    """The choice that leaves ``key`` unused, for the message."""
    group = key.split(".")[0]
    if key == "data.test_fraction":
        name = cfg.data.name.value
        return "data=file with data.test_path" if name == "file" else f"data={name}, which has a test split of its own"
    if key == "data.target_scaling":
        return f"model.loss={cfg.model.loss}"
    if group == "data":
        return f"data={cfg.data.name.value}"
    if key == "optimizer.min_lr_ratio":
        return f"optimizer.schedule={cfg.optimizer.schedule.value}"
    if group == "optimizer":
        return f"optimizer={cfg.optimizer.name}"
    if group == "precision":
        return f"precision={cfg.precision.name}"
    if key == "execution.bgrad" or (key == "execution.head_kernel" and cfg.execution.mode.value == "naive"):
        return f"execution={cfg.execution.mode.value}"
    return f"device={cfg.device.value}"


def _yaml(value: Any) -> str:
    """A value as it is written on the command line (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


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


def _registered(cfg: TrainConfig) -> list[str]:
    """The registered options' settings out of their declared ranges, and names no registry holds."""
    o, problems = cfg.optimizer, unknown_names(cfg)
    for key, r in optim.setting_ranges().items():
        if key not in _OPTIMIZER_FIELDS:
            readers = joined([f"optimizer={n}" for n in optim.users(key)])
            problems.append(
                f"{readers} reads optimizer.{key}, which is no field of OptimizerConfig (mlptrain/config/schema.py)"
            )
        elif r is not None and (problem := r.problem(f"optimizer.{key}", getattr(o, key))):
            problems.append(problem)
    if o.name in optim.OPTIMIZERS:
        problems += optim.OPTIMIZERS[o.name].cls.config_problems(o)
    for key, (_, _, r) in SETTINGS.items():
        if r is not None and (problem := r.problem(f"precision.{key}", getattr(cfg.precision, key))):
            problems.append(problem)
    return problems


def _ranges(cfg: TrainConfig) -> list[str]:
    m, d, o = cfg.model, cfg.data, cfg.optimizer
    rules = [(math.isfinite(v), f"{k}={v} must be a finite number") for k, v in _floats(cfg)]
    rules += [(w >= 1, f"model.hidden[{i}]={w} must be a positive layer width") for i, w in enumerate(m.hidden)]
    rules += [
        (m.in_features is None or m.in_features >= 1, f"model.in_features={m.in_features} must be >= 1 or null"),
        (m.out_features is None or m.out_features >= 1, f"model.out_features={m.out_features} must be >= 1 or null"),
        (d.batch_size >= 1, f"data.batch_size={d.batch_size} must be a positive integer"),
        (
            cfg.execution.workspace_mib is None or cfg.execution.workspace_mib >= 1,
            f"execution.workspace_mib={cfg.execution.workspace_mib} must be a positive number of MiB or null",
        ),
        (d.eval_batch_size >= 1, f"data.eval_batch_size={d.eval_batch_size} must be a positive integer"),
        (0.0 <= d.val_fraction < 1.0, f"data.val_fraction={d.val_fraction} must be in [0, 1)"),
        (0.0 < d.test_fraction < 1.0, f"data.test_fraction={d.test_fraction} must be in (0, 1)"),
        (d.val_fraction + d.test_fraction < 1.0, "data.val_fraction + data.test_fraction must be below 1"),
        (d.missing in ("error", "drop"), f"data.missing={d.missing!r} must be error or drop"),
        (0 <= d.split_seed < SEEDS, f"data.split_seed={d.split_seed} must be an integer in [0, 2**32)"),
        (d.samples is None or d.samples >= 2, f"data.samples={d.samples} must be at least 2 or null"),
        (d.name.value != "mnist1d" or not mnist1d_samples_problem(d.samples), str(mnist1d_samples_problem(d.samples))),
        (d.name.value != "synthetic" or _positive(d.features), f"data.features={d.features} must be positive"),
        (d.name.value != "file" or _columns(d.features), f"data.features={d.features} must be a list of columns"),
        (_names(d.drop) and _names(d.categorical), "data.drop and data.categorical must be lists of column names"),
        (d.impute in ("fill", "error"), f"data.impute={d.impute!r} must be fill or error"),
        (d.weight is None or isinstance(d.weight, str), f"data.weight={d.weight!r} must be one column's name or null"),
        (not _weight_taken(d), f"data.weight={d.weight} is named by data.target or data.drop too; name it once"),
        (d.min_frequency >= 1, f"data.min_frequency={d.min_frequency} must be a positive number of rows"),
        (d.classes >= 2, f"data.classes={d.classes} must be at least 2"),
        (d.name.value != "file" or bool(d.path), "data=file needs data.path=<the training file>"),
        (_target_ok(d.target), f"data.target={d.target!r} must be a column name or a list of column names"),
        (o.warmup_steps >= 0, f"optimizer.warmup_steps={o.warmup_steps} must be >= 0"),
        (0.0 <= o.min_lr_ratio <= 1.0, f"optimizer.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]"),
        (state_dtype_problem(o.state_dtype) is None, str(state_dtype_problem(o.state_dtype))),
        (0 <= cfg.seed < SEEDS, f"seed={cfg.seed} must be an integer in [0, 2**32)"),
        (cfg.epochs >= 1, f"epochs={cfg.epochs} must be a positive integer"),
        (
            1 <= cfg.log_every <= MAX_LOG_EVERY,  # the step metrics' ring holds log_every slots on the device
            f"log_every={cfg.log_every} must be in [1, {MAX_LOG_EVERY}] (its steps' metrics are held until read)",
        ),
        (cfg.checkpoint_every >= 0, f"checkpoint_every={cfg.checkpoint_every} must be >= 0"),
        (cfg.checkpoint_steps >= 0, f"checkpoint_steps={cfg.checkpoint_steps} must be >= 0 (0: off)"),
        (cfg.max_steps is None or cfg.max_steps >= 1, f"max_steps={cfg.max_steps} must be positive or null"),
        *_early_stopping(cfg),
        (cfg.distributed.gpus >= 1, f"distributed.gpus={cfg.distributed.gpus} must be a positive number of GPUs"),
        (
            cfg.distributed.gpus == 1 or cfg.device.value != "cpu",
            f"distributed.gpus={cfg.distributed.gpus} needs GPUs (device=gpu or auto); "
            "data parallelism runs on NCCL, which the CPU does not have",
        ),
        (cfg.distributed.timeout_s > 0, f"distributed.timeout_s={cfg.distributed.timeout_s} must be positive"),
        (cfg.distributed.bucket_mib >= 0, f"distributed.bucket_mib={cfg.distributed.bucket_mib} must be >= 0"),
        (
            cfg.distributed.gpus == 1 or cfg.data.batch_size >= cfg.distributed.gpus,
            f"data.batch_size={cfg.data.batch_size} is the global batch and must be at least distributed.gpus="
            f"{cfg.distributed.gpus} (one row per GPU)",
        ),
        (
            cfg.logger.value != "tensorboard" or _importable("tensorboardX"),
            "logger=tensorboard needs tensorboardX: pip install -e '.[tensorboard]', or use logger=none",
        ),
    ]
    return [msg for ok, msg in rules if not ok] + _registered(cfg)


EPOCH_METRICS = (
    "train/loss",
    "train/acc",
    "val/loss",
    "val/acc",
    *(f"val/{k}" for k in (*scores.CLASSIFICATION_SCORES, "roc_auc", *scores.REGRESSION_SCORES)),
)


def _early_stopping(cfg: TrainConfig) -> list[tuple[bool, str]]:
    es = cfg.early_stopping
    return [
        (es.patience >= 0, f"early_stopping.patience={es.patience} must be >= 0 (0: off)"),
        (
            es.metric == "auto" or es.metric in EPOCH_METRICS,
            f"early_stopping.metric={es.metric} must be auto or "
            f"one of {', '.join(EPOCH_METRICS)} (the test split never selects a model)",
        ),
        (es.mode in ("auto", "max", "min"), f"early_stopping.mode={es.mode} must be auto, max or min"),
        (es.min_delta >= 0, f"early_stopping.min_delta={es.min_delta} must be >= 0"),
    ]


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _target_ok(target: Any) -> bool:
    if isinstance(target, str):
        return bool(target)
    return isinstance(target, (list, tuple)) and len(target) > 0 and all(isinstance(t, str) and t for t in target)


def _positive(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _columns(features: Any) -> bool:
    """``data.features`` of ``data=file``: a list of columns, or None (all); synthetic's count at its default
    (a config built in Python keeps the schema's 32) is not one either."""
    return _names(features, True) or features == DataConfig.features


def _names(names: Any, none: bool = False) -> bool:
    """A list of column names (``none``: or None)."""
    if names is None:
        return none
    return not isinstance(names, (str, int)) and all(isinstance(n, str) and n for n in names)
