"""The settings of the run a resume continues: restored from its checkpoint, refused where they contradict it.

:func:`restore` comes first, before the trainer is built: a resume continues with the run's own
settings, read from its checkpoint (the truth of what the run was), so that ``hydra.run.dir=<run>
resume=last`` alone continues it. A setting the user set that contradicts the run's is refused,
naming the run's value, except those of :data:`MAY_CHANGE` (honoured, and logged) and
:data:`LAUNCH_KEYS` (this process's: how it is launched and shown, never taken from the run).
What counts as set: the CLI's overrides; from Python, what differs from ``TrainConfig()``.

A stored config holds resolved values (written from the dataclass, after OmegaConf resolved the
command line): a ``${...}`` in one read back is text, never an interpolation to resolve on the
reading machine (``${oc.env:HOME}`` stays those characters; :func:`literal`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mlptrain.base.errors import ConfigError
from mlptrain.config import shell
from mlptrain.config.schema import TrainConfig, flatten, to_plain
from mlptrain.run import checkpoint
from mlptrain.run.resume import resume_path
from mlptrain.run.rundir import RUN_RECORD, FrontEnd, RunDirectory

log = logging.getLogger(__name__)

# This process's settings: how the run is launched and shown. Never taken from the run, never refused.
LAUNCH_KEYS = (
    "resume",
    "progress",
    "device",
    "distributed.gpus",
    "distributed.timeout_s",
    "distributed.verify",
    "distributed.bucket_mib",
    "execution.precompile",  # when the kernels compile (ahead or at first launch): no number changes
)
# Settings that may change on resume: the run's own unless set, and honoured (logged) when set.
# Where the data is (a moved file), how far to train, how often to log and save, and patience.
MAY_CHANGE = (
    "epochs",
    "max_steps",
    "log_every",
    "checkpoint_every",
    "checkpoint_steps",
    "logger",
    "graph",
    "optimized_metric",
    "early_stopping.patience",
    "data.path",
    "data.test_path",
    "data.root",
    "data.download",
    "data.cache",
)
# What a config group's option (``optimizer=adam``) sets on the command line: the key that names it.
# Its other values are the run's unless they are set one by one (``optimizer.lr=...``).
GROUP_KEYS = {
    "model": "model.hidden",
    "data": "data.name",
    "optimizer": "optimizer.name",
    "execution": "execution.mode",
    "precision": "precision.name",
}


def restore(
    cfg: TrainConfig,
    out_dir: Path,
    overrides: Sequence[str] | None = None,
    check: Callable[[TrainConfig], Any] | None = None,
) -> TrainConfig:
    """``cfg`` with the settings of the run it resumes, from that run's checkpoint (or ``run.json``, for a
    run killed before its first checkpoint); ``cfg`` itself when it starts a run.

    Args:
        overrides: the settings the user set. From the CLI its overrides as Hydra received them
            (``model.hidden=[64,64]``; a group's option, ``optimizer=adam``, sets the key that names it,
            :data:`GROUP_KEYS`); None from Python, where a setting counts as set when it differs
            from :class:`~mlptrain.config.schema.TrainConfig`'s default.
        check: validates a config (:func:`mlptrain.step.checks.validate`); before a contradiction is refused,
            what was asked is checked among the run's own settings, so that a bad value given is named
            as such first, and an option is judged with the run's (``data.task`` with the run's ``data=file``,
            not the default dataset's).

    Raises:
        ConfigError: a setting that was set contradicts the run's and may not change on resume.
        CheckpointError: the checkpoint that ``cfg.resume`` names is missing or damaged.
    """
    if cfg.resume is None:
        return cfg
    source, saved = saved_settings(cfg.resume, RunDirectory(out_dir))
    if source is None or saved is None:
        return cfg
    now = flatten(to_plain(cfg))
    given = set_keys(overrides, now)
    merged, refused, changed = dict(now), [], []
    for key, value in now.items():
        if key in LAUNCH_KEYS or key not in saved or saved[key] == value:
            continue
        if key not in given:
            merged[key] = saved[key]
        elif key in MAY_CHANGE:
            changed.append(f"{key} {shell.hydra_value(saved[key])} -> {shell.hydra_value(value)}")
        else:
            refused.append(key)
    if refused:
        if check is not None:
            check(from_flat(merged))  # the settings given, the run's for the rest
        raise ConfigError(_contradiction(source, refused, saved, now, out_dir, overrides))
    if changed:
        log.info("resuming %s with its own settings; changed on resume: %s", source, "; ".join(changed))
    return from_flat(merged)


def saved_settings(resume: str, run_dir: RunDirectory) -> tuple[Path | None, dict[str, Any] | None]:
    """Where the settings of the run ``resume=`` continues are kept, and those settings (flat keys)."""
    path, _ = resume_path(resume, run_dir)
    if path is not None:
        return path, flatten(checkpoint.load(path).meta["config"])
    record = run_dir.path / RUN_RECORD
    try:
        config = json.loads(record.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, None  # nothing says what the run was: it starts from this config
    return record, flatten(config) if isinstance(config, dict) else None


def set_keys(overrides: Sequence[str] | None, now: dict[str, Any]) -> set[str]:
    """The config keys (flat) that the user set: see :func:`restore`."""
    if overrides is None:
        default = flatten(to_plain(TrainConfig()))
        return {k for k, v in now.items() if default.get(k) != v}
    found: set[str] = set()
    for item in overrides:
        key = _key(item)
        if key in GROUP_KEYS:
            found.add(GROUP_KEYS[key])
        else:  # a key, or a node set as a whole (early_stopping={...})
            found.update(k for k in now if k == key or k.startswith(key + "."))
    return found


def front_end(overrides: Sequence[str] | None) -> FrontEnd:
    """The CLI (``overrides`` given) with the overrides of how it runs, which a command to continue
    repeats; or Python."""
    if overrides is None:
        return FrontEnd()
    launch = {_key(o): o for o in overrides if _key(o) in LAUNCH_KEYS and _key(o) != "resume"}  # the last one wins
    return FrontEnd(cli=True, launch=tuple(launch.values()))


def _key(override: str) -> str:
    """The key of a Hydra override: ``model.hidden`` of ``model.hidden=[64,64]``, ``foo`` of ``+foo=1``."""
    return override.lstrip("+~").split("=", 1)[0].strip()


def literal(value: Any) -> Any:
    """``value`` (a stored config's, nested dicts and lists too) escaped so that OmegaConf reads every string
    as the text it is: ``${oc.env:HOME}`` -> ``\\${oc.env:HOME}``, which OmegaConf gives back as ``${oc.env:HOME}``
    (backslashes before a ``${`` doubled, as its grammar reads them)."""
    if isinstance(value, str):
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    if isinstance(value, dict):
        return {k: literal(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [literal(v) for v in value]
    return value


def from_flat(flat: dict[str, Any]) -> TrainConfig:
    """A :class:`TrainConfig` from flat plain values (enums by their values), checked against the schema.

    The values are resolved ones (a stored config's, or this run's): a ``${`` in them is text (:func:`literal`).
    """
    from omegaconf import OmegaConf

    nested: dict[str, Any] = {}
    for key, value in literal(flat).items():
        *path, last = key.split(".")
        node = nested
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), nested))
    assert isinstance(cfg, TrainConfig)
    return cfg


def _contradiction(
    source: Path,
    keys: list[str],
    saved: dict[str, Any],
    now: dict[str, Any],
    out_dir: Path,
    overrides: Sequence[str] | None,
) -> str:
    """The one-sentence refusal of settings that contradict the run's, with what to do instead."""

    def values(d: dict[str, Any]) -> str:
        return ", ".join(f"{k}={shell.hydra_value(d[k])}" for k in keys)

    head = f"resume={now['resume']}: {source} holds a run with {values(saved)}, but this resume sets {values(now)}"
    front = front_end(overrides)
    if overrides is None:
        return (
            f"{head}; a resume continues with the run's own settings: leave these at TrainConfig's defaults (the "
            f"run's are restored), or start a new run in a new {front.dir_arg}"
        )
    refused = set(keys)
    kept = {_key(o): o for o in overrides if not set_keys([o], now) & refused and _key(o) != "resume"}  # last wins
    command = shell.command(
        ["python -m mlptrain", shell.override("hydra.run.dir", str(out_dir)), shell.override("resume", now["resume"])],
        kept.values(),
    )
    return (
        f"{head}; a resume continues with the run's own settings (or start a new run in a new hydra.run.dir); "
        f"continue with: {command}"
    )
