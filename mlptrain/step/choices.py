"""The schema's settings that name a registered option, and their registries.

``model.activation``, ``model.loss``, ``optimizer.name`` and ``precision.name`` are ``str`` in the
schema (:mod:`mlptrain.config.schema`): the options are the entries of each concept's
:class:`~mlptrain.base.registry.Registry`, which a new option joins when it registers, after the schema's
types are fixed. :mod:`mlptrain.step.checks` refuses a name no registry holds; ``--help`` lists them.
"""

from __future__ import annotations

from typing import Any

from mlptrain.base.registry import Registry
from mlptrain.nn.execution import ACTIVATIONS
from mlptrain.nn.losses import LOSSES
from mlptrain.step.optim import OPTIMIZERS, users
from mlptrain.step.precision import PRECISIONS, SETTINGS

REGISTRIES: dict[str, Registry[Any]] = {r.key: r for r in (ACTIVATIONS, LOSSES, OPTIMIZERS, PRECISIONS)}


def help_of(key: str) -> str:
    """The registered names of setting ``key`` as ``--help`` lists them (``a, b (a note) or c``)."""
    return REGISTRIES[key].help()


def users_of(key: str) -> list[str]:
    """The registered options that read setting ``key`` (``optimizer.eps``: adam, adamw; ``precision.margin``: fp8)."""
    group, name = key.split(".")
    if group == "optimizer":
        return users(name)
    reads = SETTINGS[name][0]
    return [n for n, row in PRECISIONS.items() if reads(row)]


def unknown_names(cfg: Any) -> list[str]:
    """A problem for each of these settings of ``cfg`` whose name no registry holds."""
    problems = []
    for key, registry in REGISTRIES.items():
        group, name = key.split(".")
        value = getattr(getattr(cfg, group), name)
        if value not in registry:
            problems.append(registry.unknown(value))
    return problems
