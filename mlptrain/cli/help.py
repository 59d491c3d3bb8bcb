"""``python -m mlptrain --help``: every setting of the schema, one line each, with its value and help; and
``--version``: mlptrain's version with the stack under it.

The schema (:mod:`mlptrain.config.schema`) holds each setting's help text; this renders it, filling in
the names each registry holds now (``{choices}``, ``{users}``: :mod:`mlptrain.step.choices`), and stores
the schema in Hydra's ConfigStore with the resolver that ``conf/config.yaml``'s help template calls.
Rendering lives here, above the registries, so that the schema imports nothing of mlptrain.
"""

from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass
from enum import Enum
from typing import Any

from mlptrain.config.schema import TrainConfig
from mlptrain.step.choices import help_of, users_of


def settings_help(node: Any = None, prefix: str = "", values: Any = None) -> str:
    """Every setting of the schema, one line each: ``key = value  description`` (``--help`` shows it).

    ``values``: the composed config whose values to show (the command line's overrides and chosen
    groups applied); default the schema's defaults.
    """
    node = TrainConfig if node is None else node
    lines = []
    for f in fields(node):
        default = f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]
        value = default if values is None else values.get(f.name, default)
        if is_dataclass(default):
            lines.append(settings_help(default, f"{prefix}{f.name}.", value if values is not None else None))
            continue
        shown = value.value if isinstance(value, Enum) else value
        if hasattr(shown, "_content") or isinstance(shown, (list, tuple)):  # an OmegaConf ListConfig, a list
            shown = "[" + ", ".join(map(str, shown)) + "]"
        shown = "null" if shown is None else str(shown).lower() if isinstance(shown, bool) else shown
        lines.append(f"  {prefix + f.name + ' = ' + str(shown):<36} {_help(f, prefix)}")
    return "\n".join(lines)


def _help(f: Any, prefix: str) -> str:
    """A field's help, the registered names in place of ``{choices}`` (:mod:`mlptrain.step.choices`)."""
    text = f.metadata.get("help", "")
    if not (f.metadata.get("choices") or f.metadata.get("users")):
        return text
    if f.metadata.get("users"):
        return text.format(users=", ".join(users_of(prefix + f.name)))
    return text.format(choices=help_of(prefix + f.name))


def task_loss(task: Any) -> str:
    """``model.loss`` where a config leaves it to the task (``conf/data/file.yaml``): ``mse`` for
    ``data.task=regression``, else ``cross_entropy`` (``auto`` keeps the classification loss: a fractional
    target is then refused with the fix, as ``data.task`` says). ``model.loss=...`` given still wins."""
    return "mse" if str(getattr(task, "value", task)) == "regression" else "cross_entropy"


def table_metric(val_fraction: Any, folds: Any = 0) -> str:
    """``early_stopping.metric`` of a table's recipe (``conf/data/file.yaml``): the validation loss, or the
    training loss where ``data.val_fraction=0`` leaves no validation split and no ``ensemble.folds`` makes one
    (a cross-validation's ``val/`` is out of fold, whatever ``data.val_fraction``)."""
    return "val/loss" if float(val_fraction) > 0 or int(folds) > 0 else "train/loss"


def register_configs() -> None:
    """Store :class:`TrainConfig` in Hydra's ConfigStore as ``train_schema``.

    ``conf/config.yaml`` lists ``train_schema`` first in its defaults, so the group files
    (``model/``, ``data/``, ...) and command-line overrides merge into typed nodes and a typo
    fails at compose time. No per-group schemas are stored: each would show up as a selectable
    group option named after it. Safe to call more than once.
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    # conf/data/file.yaml's model.loss: the loss of the task data.task names (a regression: mse)
    OmegaConf.register_new_resolver("mlptrain_task_loss", task_loss, replace=True)
    OmegaConf.register_new_resolver("mlptrain_table_metric", table_metric, replace=True)
    # conf/config.yaml's help template lists the settings from the schema: written once, here
    # ($ doubled: Hydra fills the template with string.Template)
    OmegaConf.register_new_resolver(
        "mlptrain_settings", lambda *, _root_: settings_help(values=_root_).replace("$", "$$"), replace=True
    )


def version() -> str:
    """mlptrain's version and the stack under it (``python -m mlptrain --version``)."""
    import platform

    import hydra
    import numpy as np
    import omegaconf

    from mlptrain import __version__
    from mlptrain.base.backend import get_backend, probe_gpu

    line = (
        f"mlptrain {__version__} (Python {platform.python_version()}, NumPy {np.__version__}, "
        f"Hydra {hydra.__version__}, OmegaConf {omegaconf.__version__}"
    )
    available, reason = probe_gpu()
    if not available:
        return line + f"; no GPU: {reason})"
    gpu = get_backend("gpu")
    v = gpu.versions()
    line += f", CuPy {v['cupy']}, nvmath-python {v['nvmath']}, CUDA runtime {v['cuda_runtime']}"
    return line + f"; {gpu.describe()})"
