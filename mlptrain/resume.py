"""Where a run starts: a fresh start, or a resume planned from its checkpoint, reading and changing nothing.

:func:`prepare` is step 1 of :func:`mlptrain.run.train` for the starting point: a fresh run refuses
a directory that holds a run; a resume finds its checkpoint (:func:`resume_path`), checks that it
fits the trainer, and plans what the directory needs before the run continues (:class:`Start`):
the prefix of ``metrics.jsonl`` to keep and the ``best.npz`` to write (a copy or a repair).
:func:`mlptrain.run.train` applies the plan once the run is accepted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlptrain import checkpoint
from mlptrain.checkpoint import CHECKPOINT_DIR, Best, Checkpoint, Position
from mlptrain.config import flatten, to_plain
from mlptrain.errors import CheckpointError, ConfigError
from mlptrain.loop import selection
from mlptrain.metrics import MetricsPrefix, kinds_after, plan_prefix
from mlptrain.rundir import METRICS, RUN_RECORD, RunDirectory
from mlptrain.trainer import Trainer

log = logging.getLogger(__name__)

# Config keys that may differ on resume without changing the numbers of the run.
# The number of GPUs is one of them: the global batch, and so every step, is the same on any number.
COSMETIC_KEYS = (
    "resume",
    "progress",
    "log_every",
    "checkpoint_every",
    "checkpoint_steps",
    "distributed.gpus",
    "distributed.timeout_s",
    "distributed.verify",
    "distributed.bucket_mib",
)


@dataclass
class Start:
    """Where a run starts, and what its directory needs before it does (applied once the run is accepted)."""

    position: Position
    best: Best
    metrics: MetricsPrefix
    resumed_from: Path | None = None
    best_file: Checkpoint | None = None  # to write as checkpoints/best.npz (a copy or a repair)
    notes: list[str] = field(default_factory=list)


def prepare(tr: Trainer, run_dir: RunDirectory) -> Start:
    """Check that the run may start here, and from where; change nothing.

    Raises:
        OutputError: a fresh run into a directory that holds a run.
        CheckpointError: the checkpoint is missing, corrupt, does not fit, or is behind a newer ``last``.
        ConfigError: the checkpoint is at or past the end of this run.
    """
    cfg = tr.cfg
    # the metric that selects best.npz (and stops early); the test split never selects a model
    best = selection(cfg, tr.dataset.task == "classification", "val" in tr.eval_loaders)
    if cfg.resume is None:
        run_dir.refuse_overwrite(hint="continue it with resume=last")
        return Start(Position(), best, plan_prefix(None, 0))
    path, notes = resume_path(cfg.resume, run_dir)
    if path is None:  # a run killed before it saved any checkpoint: its start is its config's
        return Start(Position(), best, plan_prefix(run_dir.metrics, 0), notes=notes)
    ckpt = checkpoint.load(path)
    pos, where = ckpt.position, f"checkpoint {path}"
    tr.load_state_dict(ckpt.arrays, ckpt.meta, step=pos.step, where=where)
    spe = tr.steps_per_epoch
    if ckpt.meta["steps_per_epoch"] != spe or pos.batch > spe:
        raise CheckpointError(
            f"{where} stands at epoch {pos.epoch}, batch {pos.batch}, step {pos.step} of "
            f"{ckpt.meta['steps_per_epoch']} batches per epoch, but this run has {spe} (data.batch_size="
            f"{cfg.data.batch_size}, the checkpoint's {flatten(ckpt.meta['config']).get('data.batch_size')}); resume "
            "with the checkpoint's data settings"
        )
    if pos.step >= tr.total_steps and not unfinished(path, pos.step == tr.total_steps, ckpt.meta["metrics_records"]):
        raise ConfigError(
            f"checkpoint {path} is at step {pos.step}, at or past the end of this run ({tr.total_steps} steps: "
            f"epochs={cfg.epochs}, max_steps={cfg.max_steps}); raise epochs or max_steps to train further"
        )
    warn_differences(ckpt.meta["config"], to_plain(cfg), where)
    records = ckpt.meta["metrics_records"]
    if path.resolve().parent == run_dir.checkpoints.resolve():
        run_dir.newer_last(path, pos)
        start = Start(pos, ckpt.best or best, plan_prefix(run_dir.metrics, records), path, notes=notes)
        plan_best(start, ckpt, run_dir.checkpoint("best"), copy=False)
    else:
        run_dir.refuse_overwrite(hint=f"resume into a new hydra.run.dir with resume={path}")
        source = path.parent.parent if path.parent.name == CHECKPOINT_DIR else None
        start = Start(pos, ckpt.best or best, plan_prefix(source / METRICS if source else None, records), path)
        if source is not None:
            plan_best(start, ckpt, source / CHECKPOINT_DIR / "best.npz", copy=True)
    return start


def resume_path(resume: str, run_dir: RunDirectory) -> tuple[Path | None, list[str]]:
    """The checkpoint ``resume=`` names, or None for a run of this directory that saved none.

    ``resume=last`` in a directory whose run was killed before its first ``last.npz`` (``run.json``
    says a run started there) continues from ``best.npz`` if there is one (the latest state on
    disk), else from the start, which the config determines; a note says so.
    """
    last = run_dir.checkpoint("last")
    if resume != "last" or last.exists() or not (run_dir.path / RUN_RECORD).is_file():
        return checkpoint.resolve(resume, run_dir.path), []
    best = run_dir.checkpoint("best")
    if best.exists():
        return best, [f"{run_dir.path} has no {last.name} (its run stopped before saving one): resuming from {best}"]
    note = (
        f"{run_dir.path} holds a run that stopped before its first checkpoint: resuming it from its start (step 0), "
        "which its config determines"
    )
    return None, [note]


def unfinished(path: Path, at_end: bool, records: int) -> bool:
    """A checkpoint at the very end of its run, killed before it wrote its summary: resuming finishes it."""
    if not at_end or path.parent.name != CHECKPOINT_DIR:
        return False
    return "summary" not in kinds_after(path.parent.parent / METRICS, records)


def plan_best(start: Start, ckpt: Checkpoint, best_path: Path, *, copy: bool) -> None:
    """Make ``best.npz`` agree with the checkpoint's record of the best epoch.

    ``best_path``: the ``best.npz`` of the run the checkpoint belongs to; ``copy``: it is another
    run's (a resume into a new directory brings it along).
    """
    recorded = ckpt.best
    if recorded is None or recorded.step is None:
        return
    try:
        found: Checkpoint | None = checkpoint.load(best_path)
    except CheckpointError as exc:
        found, problem = None, str(exc)
    pos = ckpt.position
    if found is not None and found.position.step == recorded.step:
        if copy:
            start.best_file = found
        return
    if found is not None and found.position.step > pos.step:
        start.notes.append(
            f"{best_path} (step {found.position.step}) is ahead of {ckpt.path} (step {pos.step}): the run stopped "
            "between writing the two; it is written again when the run gets there"
        )
        return
    if pos.step == recorded.step:  # the best epoch is the checkpoint's own: the same state
        start.best_file = ckpt
        start.notes.append(f"{best_path} repaired from {ckpt.path}, which holds the same state (step {pos.step})")
        return
    start.best = Best(recorded.metric, mode=recorded.mode)
    what = problem if found is None else f"it holds step {found.position.step}"
    start.notes.append(
        f"the best checkpoint of this run (step {recorded.step}, {recorded.metric} {recorded.value}) is lost ({what}); "
        "the best is chosen again from the next epoch on"
    )


def warn_differences(saved: dict[str, Any], now: dict[str, Any], where: str) -> None:
    """Log every setting that differs from the checkpoint's: the run will not match an uninterrupted one."""
    a, b = flatten(saved), flatten(now)
    keys = sorted((set(a) | set(b)) - set(COSMETIC_KEYS))
    diff = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]
    if diff:
        log.warning(
            "resuming from %s with settings that differ from its run (%s); the result may differ from an "
            "uninterrupted run's",
            where,
            "; ".join(diff),
        )
