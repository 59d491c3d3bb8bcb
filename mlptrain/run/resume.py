"""Where a run starts: a fresh start, or a resume planned from its checkpoint, reading and changing nothing.

:func:`mlptrain.run.restore.restore` comes before: the settings of the run a resume continues.

:func:`prepare` is step 1 of :func:`mlptrain.run.run.train` for the starting point: a fresh run refuses
a directory that holds a run; a resume finds its checkpoint (:func:`resume_path`), checks that it
fits the trainer, and plans what the directory needs before the run continues (:class:`Start`):
the prefix of ``metrics.jsonl`` to keep and the ``best.npz`` to write (a copy or a repair).
:func:`mlptrain.run.run.train` applies the plan once the run is accepted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlptrain.base.errors import CheckpointError, ConfigError
from mlptrain.config.schema import TrainConfig, flatten, to_plain
from mlptrain.nn.scores import CLASSIFICATION_SCORES, LARGER_IS_BETTER, REGRESSION_SCORES
from mlptrain.run import checkpoint
from mlptrain.run.checkpoint import CHECKPOINT_DIR, Best, Checkpoint, Position
from mlptrain.run.metrics import MetricsPrefix, kinds_after, plan_prefix
from mlptrain.run.rundir import METRICS, RUN_RECORD, RunDirectory
from mlptrain.step.trainer import Trainer

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
    stopped_early: int | None = None  # the run stopped early after this epoch: the resume writes its summary


def prepare(tr: Trainer, run_dir: RunDirectory) -> Start:
    """Check that the run may start here, and from where; change nothing.

    Raises:
        OutputError: a fresh run into a directory that holds a run.
        CheckpointError: the checkpoint is missing, corrupt, does not fit (the model, the data's classes,
            task or columns, the best metric), or is behind a newer ``last``.
        ConfigError: the checkpoint is at or past the end of this run.
    """
    cfg = tr.cfg
    # the metric that selects best.npz (and stops early); the test split never selects a model
    classification = tr.dataset.task == "classification"
    best = selection(cfg, classification, "val" in tr.eval_loaders, tr.widths[-1] if classification else 0)
    if cfg.resume is None:
        run_dir.refuse_overwrite()
        return Start(Position(), best, plan_prefix(None, 0))
    path, notes = resume_path(cfg.resume, run_dir)
    if path is None:  # a run killed before it saved any checkpoint: its start is its config's
        return Start(Position(), best, plan_prefix(run_dir.metrics, 0), notes=notes)
    ckpt = checkpoint.load(path)
    pos, where = ckpt.position, f"checkpoint {path}"
    check_data(ckpt.meta.get("data"), tr.dataset.preprocessing()[0], where)
    tr.load_state_dict(ckpt.arrays, ckpt.meta, step=pos.step, where=where)
    stopped_early = check_continues(tr, ckpt, best)
    warn_differences(ckpt.meta["config"], to_plain(cfg), where)
    records = ckpt.meta["metrics_records"]
    if path.resolve().parent == run_dir.checkpoints.resolve():
        run_dir.newer_last(path, pos)
        start = Start(pos, ckpt.best or best, plan_prefix(run_dir.metrics, records), path, notes=notes)
        plan_best(start, ckpt, run_dir.checkpoint("best"), copy=False)
    else:
        run_dir.refuse_overwrite(resume=str(path))
        source = path.parent.parent if path.parent.name == CHECKPOINT_DIR else None
        start = Start(pos, ckpt.best or best, plan_prefix(source / METRICS if source else None, records), path)
        if source is not None:
            plan_best(start, ckpt, source / CHECKPOINT_DIR / "best.npz", copy=True)
    start.stopped_early = stopped_early
    return start


def check_continues(tr: Trainer, ckpt: Checkpoint, best: Best) -> int | None:
    """Check that this run continues the checkpoint's: its batches per epoch, its best metric, an end
    still ahead. Returns the epoch after which the checkpoint's run stopped early, if it did and has
    yet to write its summary (the resume only finishes it).

    Raises:
        CheckpointError: another number of batches per epoch, or another metric selecting ``best``.
        ConfigError: the run is at or past its end (its steps, or early stopping), its summary written.
    """
    cfg, path, pos, where = tr.cfg, ckpt.path, ckpt.position, f"checkpoint {ckpt.path}"
    spe = tr.steps_per_epoch
    if ckpt.meta["steps_per_epoch"] != spe or pos.batch > spe:
        raise CheckpointError(
            f"{where} stands at epoch {pos.epoch}, batch {pos.batch}, step {pos.step} of "
            f"{ckpt.meta['steps_per_epoch']} batches per epoch, but this run has {spe} (data.batch_size="
            f"{cfg.data.batch_size}, the checkpoint's {flatten(ckpt.meta['config']).get('data.batch_size')}); resume "
            "with the checkpoint's data settings"
        )
    saved = ckpt.best
    if saved is not None and (saved.metric, saved.mode) != (best.metric, best.mode):
        raise CheckpointError(
            f"{where} chose its best epoch by {saved.metric} ({saved.mode}), but this run would choose by "
            f"{best.metric} ({best.mode}); resume with the run's data and early_stopping settings, or start a new run"
        )
    records = ckpt.meta["metrics_records"]
    if pos.step >= tr.total_steps and not unfinished(path, pos.step == tr.total_steps, records):
        raise ConfigError(
            f"checkpoint {path} is at step {pos.step}, at or past the end of this run ({tr.total_steps} steps: "
            f"epochs={cfg.epochs}, max_steps={cfg.max_steps}); raise epochs or max_steps to train further"
        )
    stopped = stopped_early_at(ckpt, cfg.early_stopping.patience)
    if stopped is None or pos.step >= tr.total_steps:
        return None
    if not unfinished(path, True, records):
        raise ConfigError(
            f"checkpoint {path} ends its run: it stopped early after epoch {stopped + 1} "
            f"({saved.metric if saved else ''} had not improved for {cfg.early_stopping.patience} epochs); raise "
            "early_stopping.patience to train further"
        )
    return stopped


def stopped_early_at(ckpt: Checkpoint, patience: int) -> int | None:
    """The epoch after which the checkpoint's run stopped early (with ``patience``), or None.

    The loop stops after epoch ``e`` when ``e - best.improved >= patience`` and saves ``last`` at the
    start of epoch ``e + 1``; nothing else saves there with that condition true
    (:meth:`mlptrain.run.loop.Loop.end_epoch`).
    """
    pos, best = ckpt.position, ckpt.best
    if patience <= 0 or pos.batch != 0 or pos.epoch < 1 or best is None:
        return None
    epoch = pos.epoch - 1
    return epoch if epoch - (best.improved or 0) >= patience else None


def check_data(saved: dict[str, Any] | None, now: dict[str, Any], where: str) -> None:
    """Refuse data whose meaning changed since the checkpoint: another task, other classes or columns.

    Class ids are positions in the sorted class names: a renamed class (``cat`` -> ``kitty``) would
    silently move every label to another output.
    """
    if not saved:  # a checkpoint of format version 1: no record of its data
        return
    names = {"task": "task", "class_names": "classes", "feature_names": "feature columns"}
    for key, what in {**names, "target_names": "target columns"}.items():
        a, b = saved.get(key), now.get(key)
        if a is None or b is None or a == b:
            continue

        def show(v: Any) -> str:
            return v if isinstance(v, str) else ", ".join(map(str, v))

        raise CheckpointError(
            f"{where} was trained on data with {what} {show(a)}, but this run's data has {what} {show(b)}; resume "
            "with the data of the run, or start a new run"
        )


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
    # Ahead, or at the checkpoint's own step: written at the end of an epoch whose last step the checkpoint
    # holds (checkpoint_steps saved it inside the epoch), killed before that epoch's last.npz. The resume
    # evaluates the epoch again and writes it again, with the record of the best the checkpoint keeps.
    if found is not None and found.position.step >= pos.step:
        start.notes.append(
            f"{best_path} (step {found.position.step}) is ahead of {ckpt.path} (step {pos.step}, not past its epoch's "
            "end): the run stopped between writing the two; it is written again when the run gets there"
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


def selection(cfg: TrainConfig, classification: bool, has_val: bool, classes: int = 0) -> Best:
    """The epoch metric that selects ``best.npz`` (and stops early): ``early_stopping.metric`` and ``mode``.

    ``auto``: the validation accuracy (the validation loss for a regression; the training split's
    when there is no validation split); the mode ``max`` for an accuracy or another score where larger is
    better (``val/balanced_acc``, ``val/f1_macro``, ``val/roc_auc``, ``val/r2``: :data:`LARGER_IS_BETTER`),
    ``min`` for a loss or an error (``val/log_loss``, ``val/rmse``, ``val/mae``). ``classes``: a
    classification's number of classes (``val/roc_auc`` is measured for two).
    """
    es = cfg.early_stopping
    metric = es.metric
    if metric == "auto":
        metric = f"{'val' if has_val else 'train'}/{'acc' if classification else 'loss'}"
    name = metric.split("/", 1)[-1]
    why = ""
    if metric.startswith("val/") and not has_val:
        why = " (no validation split: data.val_fraction=0)"
    elif classification and name in REGRESSION_SCORES:
        why = " (a classification has no RMSE, MAE or R²)"
    elif not classification and (name == "acc" or name == "roc_auc" or name in CLASSIFICATION_SCORES):
        why = " (a regression has no accuracy, F1, ROC AUC or log loss)"
    elif name == "roc_auc" and classes != 2:
        why = f" (ROC AUC is measured for two classes; this run has {classes})"
    if why:
        raise ConfigError(f"early_stopping.metric={metric} is not measured in this run{why}")
    mode = es.mode if es.mode != "auto" else ("max" if name in LARGER_IS_BETTER else "min")
    return Best(metric, mode=mode)
