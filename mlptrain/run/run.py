"""A training run: :func:`train` takes a config and a run directory and trains, checkpoints, logs.

The run is orchestration; the step is :class:`~mlptrain.step.trainer.Trainer`. In order:

1. **Check**, writing nothing: the config (:func:`~mlptrain.config.schema.validate`), the directory's
   lock (:class:`~mlptrain.run.rundir.RunDirectory`: one writer at a time), the data and the model
   (building the trainer), and where to start (:func:`mlptrain.run.resume.prepare`): a fresh run
   refuses a directory that holds a run; a resume reads its checkpoint, checks that it fits, and
   plans the repairs of ``metrics.jsonl`` and ``best.npz``.
2. **Accept** (:func:`_accept`): only now does anything in the directory change.
3. **Train** (:class:`_Loop`): epochs of steps, one host sync per log interval, evaluation and
   checkpoints at the end of each epoch, Ctrl-C and SIGTERM saving ``last`` before they stop.

What a run promises is listed, with the test of each promise, in docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import platform
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from mlptrain import __version__
from mlptrain.base.backend import get_backend
from mlptrain.base.errors import MlptrainError
from mlptrain.base.stopping import Stop, StopRequest
from mlptrain.base.timeline import Timeline, active, current, mark
from mlptrain.config.schema import DatasetName, TrainConfig, ensemble_members, to_plain
from mlptrain.data import Dataset
from mlptrain.distributed.comm import Communicator
from mlptrain.run import checkpoint, faults
from mlptrain.run.ensemble import EnsembleTrainer
from mlptrain.run.loop import Loop
from mlptrain.run.metrics import MetricsWriter, epochs_from_one
from mlptrain.run.restore import front_end, restore
from mlptrain.run.resume import Start, prepare, resume_path
from mlptrain.run.rundir import RUN_RECORD, RunDirectory, follower_dir
from mlptrain.run.sinks import CSV_NAME, TENSORBOARD_DIR, CsvSink, TensorBoardSink, csv_columns
from mlptrain.step import build
from mlptrain.step.checks import validate
from mlptrain.step.memory import describe_members, member_account
from mlptrain.step.trainer import Trainer

log = logging.getLogger(__name__)


def train(
    cfg: TrainConfig,
    out_dir: Path,
    dataset: Dataset | None = None,
    *,
    on_accept: Callable[[Path], None] | None = None,
    comm: Communicator | None = None,
    overrides: Sequence[str] | None = None,
    timeline: Timeline | None = None,
) -> dict[str, Any]:
    """Train as ``cfg`` says, writing ``run.json``, ``metrics.jsonl`` and ``checkpoints/`` into ``out_dir``.

    Args:
        cfg: the configuration; with ``cfg.resume`` set, continue the run of that checkpoint, with
            that run's settings (:func:`mlptrain.run.restore.restore`: a setting that was set and
            contradicts them is refused, except those that may change on resume, such as ``epochs``).
        out_dir: the run directory (created if missing; removed again if the run is refused).
        dataset: train on this dataset instead of the one ``cfg.data`` names.
        on_accept: called with ``out_dir`` once every check passed, before anything is written
            there (the CLI writes Hydra's config files and opens the log file then).
        comm: data parallel (:mod:`mlptrain.distributed`): this process is rank ``comm.rank`` of
            ``comm.world``. Rank 0 writes the run into ``out_dir``; the other ranks take the same
            steps and write nothing there (their checkpoints and metrics go to a private temporary
            directory, removed at the end); a resume reads rank 0's checkpoint on every rank.
        overrides: the command line's overrides, as Hydra received them (the CLI passes them): what the
            user set, and messages then name Hydra's settings (``hydra.run.dir``) and print commands to
            paste. None (a call from Python): a setting counts as set when it differs from
            ``TrainConfig()``'s, and messages name this function's arguments (``out_dir``).
        timeline: where the run's phases are timed (:mod:`mlptrain.base.timeline`; the CLI passes the
            process's, which holds its start-up); default: a timeline from this call on.

    Returns:
        The summary record (also the last line of ``metrics.jsonl``).

    Raises:
        TrainingInterrupted: Ctrl-C or SIGTERM; ``last`` was saved first (a second one raises
            :class:`~mlptrain.base.errors.Interrupted` at once).
        ConfigError: a config value is out of range, or contradicts the settings of the run it resumes.
        CheckpointError: the checkpoint to resume from is missing, corrupt or does not fit.
        OutputError: ``out_dir`` cannot be written, is in use, or holds a run this one would overwrite.
        NonFiniteError: a loss, gradient or parameter became inf/NaN (the message names it).
        ResourceError: out of memory (the message says which sizes to lower).
    """

    with active(timeline if timeline is not None else Timeline()):
        return _train(cfg, Path(out_dir), dataset, on_accept, comm, overrides)


def _train(
    cfg: TrainConfig,
    out_dir: Path,
    dataset: Dataset | None,
    on_accept: Callable[[Path], None] | None,
    comm: Communicator | None,
    overrides: Sequence[str] | None,
) -> dict[str, Any]:
    def check(c: TrainConfig) -> TrainConfig:
        return validate(c, data_parallel=comm is not None)

    restored = restore(cfg, Path(out_dir), overrides, check)  # a resume: the run's own settings (a bad value first)
    cfg = check(restored)
    if comm is not None and comm.rank != 0:
        return _train_follower(cfg, Path(out_dir), dataset, comm)
    run_dir = RunDirectory(Path(out_dir), front_end(overrides))
    created = run_dir.create()
    try:
        with run_dir.lock():
            run_dir.refuse_unsafe(_inputs(cfg) if dataset is None else [])  # before the data is read
            return _train_locked(cfg, run_dir, dataset, on_accept, comm)
    except MlptrainError:
        if created:
            run_dir.remove_if_empty()  # refused before it wrote anything: leave no trace
        raise


def _inputs(cfg: TrainConfig) -> list[Path]:
    """The run's data files (``data=file``): a run directory never holds them."""
    if cfg.data.name != DatasetName.file:
        return []
    return [Path(p) for p in (cfg.data.path, cfg.data.test_path) if p]


def _train_follower(cfg: TrainConfig, out_dir: Path, dataset: Dataset | None, comm: Communicator) -> dict[str, Any]:
    """A rank other than 0: the same run, into a private directory that goes at the end."""
    import shutil

    if cfg.resume is not None:  # rank 0's checkpoint, found as rank 0 finds it (not one in the private directory)
        path, _ = resume_path(cfg.resume, RunDirectory(out_dir))
        cfg = dataclasses.replace(cfg, resume=None if path is None else str(path))
    cfg = dataclasses.replace(cfg, progress=False)
    private = follower_dir(comm.rank)
    try:
        run_dir = RunDirectory(private / "run")
        run_dir.create()
        with run_dir.lock():
            return _train_locked(cfg, run_dir, dataset, None, comm)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _train_locked(
    cfg: TrainConfig,
    run_dir: RunDirectory,
    dataset: Dataset | None,
    on_accept: Callable[[Path], None] | None,
    comm: Communicator | None = None,
) -> dict[str, Any]:
    precompile = None
    if cfg.device.value != "cpu":  # GPU: the run's kernels compile on threads while get_backend imports nvmath
        from mlptrain.step.cuda.precompile import early

        precompile = early(cfg)
    backend = get_backend(cfg.device.value)
    mark("backend")
    tr: Trainer | None = None
    try:
        with _stop_request(cfg, comm) as stop:  # until stop.defer(), Ctrl-C and SIGTERM stop at once
            try:
                kind = Trainer if ensemble_members(cfg) == 1 else EnsembleTrainer
                tr = kind(cfg, dataset, backend, comm=comm, precompile=precompile)
            except BaseException:
                if precompile is not None:  # the trainer never took it over: its threads end here
                    precompile.close()
                raise
            stop.beat()  # data parallel: building (data, kernels, the bgrad probe) was progress
            start = prepare(tr, run_dir)
            stop.defer()  # accepted: from here a stop request saves last first
            _accept(tr, run_dir, start, on_accept)
            mark("accept")
            writer = MetricsWriter(run_dir.metrics, start.metrics.records, _sinks(tr, run_dir, start))
            with writer as metrics, backend.blas_threads(build.step_flops(tr.widths, cfg.data.batch_size)):
                summary = Loop(tr, run_dir, metrics, stop, start).run()  # (an ensemble's reports: Loop.summary)
            mark("loop")
            _record_end(tr, run_dir, start)
    except MemoryError as exc:
        if isinstance(exc, MlptrainError):
            raise
        raise faults.out_of_memory(exc, cfg, backend, tr, run_dir.checkpoint("last")) from exc
    line = (
        f"mlptrain: {tr.dataset.name} {'-'.join(map(str, tr.widths))} {cfg.execution.mode.value} "
        f"{tr.precision.name} on {backend.device}: {summary['epochs']} epochs, {tr.step_count} steps in "
        f"{summary['wall_s']:.1f} s"
    )
    if "test/loss" in summary:
        line += " | " + _scores(summary, "test/")
    best = summary["best"]
    if best["epoch"] is not None and "best/test/loss" in summary:
        line += f" | best (epoch {best['epoch'] + 1}, {best['metric']} {best['value']:.4f}): "
        line += _scores(summary, "best/test/")
    if "stopped_early" in summary:
        line += f" | stopped early after epoch {summary['stopped_early'] + 1}"
    if comm is None or comm.rank == 0:
        log.info(line, extra={"printed": True})  # the console shows it once (mlptrain.cli.main.NotPrinted)
        print(line, flush=True)
    return epochs_from_one(summary)  # as metrics.jsonl holds it: epochs counted from 1


@contextlib.contextmanager
def _stop_request(cfg: TrainConfig, comm: Communicator | None) -> Iterator[Stop]:
    """Ctrl-C and SIGTERM (:class:`StopRequest`); data parallel: agreed by every rank, with a watchdog
    that ends this rank when the others stop making progress (:mod:`mlptrain.distributed.control`)."""
    with StopRequest() as stop:
        if comm is None:
            yield stop
            return
        from mlptrain.distributed.control import AgreedStop, Watchdog

        abort = getattr(comm, "abort", None)
        dog = Watchdog(cfg.distributed.timeout_s, comm.rank, on_timeout=abort).start()
        try:
            yield AgreedStop(stop, comm, dog)
        finally:
            dog.stop()


def _sinks(tr: Trainer, run_dir: RunDirectory, start: Start) -> list[Any]:
    """metrics.csv, and TensorBoard with ``logger=tensorboard``: views of metrics.jsonl (:mod:`mlptrain.run.sinks`)."""
    classification = tr.dataset.task == "classification"
    binary = classification and tr.widths[-1] == 2
    columns = csv_columns(classification, list(tr.eval_loaders), tr.scaler.enabled, binary)
    out: list[Any] = [CsvSink(run_dir.path / CSV_NAME, columns, run_dir.metrics)]
    if tr.cfg.logger.value == "tensorboard":  # a resume purges what the killed run logged past its checkpoint
        # (also a run that starts again at step 0 over the events of one killed before its first checkpoint)
        again = start.resumed_from is not None or any((run_dir.path / TENSORBOARD_DIR).glob("events.*"))
        purge = start.position.step if again else None
        out.append(TensorBoardSink(run_dir.path / TENSORBOARD_DIR, purge_step=purge))
    return out


def _scores(summary: dict[str, Any], prefix: str) -> str:
    """``test acc 0.9805 balanced 0.9801 loss 0.0912``; a regression: ``test loss 113.3 rmse 10.64 r2 0.512``
    (the loss, the RMSE and R² in the targets' units), from the ``{prefix}...`` keys."""
    if f"{prefix}acc" in summary:
        balanced = f" balanced {summary[f'{prefix}balanced_acc']:.4f}" if f"{prefix}balanced_acc" in summary else ""
        return f"test acc {summary[f'{prefix}acc']:.4f}{balanced} loss {summary[f'{prefix}loss']:.4f}"
    if f"{prefix}loss" not in summary:
        return ""
    fit = f" rmse {summary[f'{prefix}rmse']:.4g} r2 {summary[f'{prefix}r2']:.4f}" if f"{prefix}r2" in summary else ""
    return f"test loss {summary[f'{prefix}loss']:.4g}{fit}"


# --- 2. accepted: the directory changes from here on ------------------------------------------


def _accept(tr: Trainer, run_dir: RunDirectory, start: Start, on_accept: Callable[[Path], None] | None) -> None:
    if on_accept is not None:
        on_accept(run_dir.path)
    run_dir.remove_temp_files()
    run_dir.make_checkpoint_dir()
    start.metrics.apply(run_dir.metrics)
    if start.best_file is not None:
        meta = {k: v for k, v in start.best_file.meta.items() if k not in ("format", "format_version", "sha256")}
        checkpoint.save(run_dir.checkpoint("best"), start.best_file.arrays, meta)
    run_dir.write_json(RUN_RECORD, _run_record(tr, start))
    ds = tr.dataset
    weights = ""
    if tr.head.class_weight is not None:  # model.class_weight: the weights the loss uses, class by class
        names = ds.class_names or [str(c) for c in range(len(tr.head.class_weight))]
        weights = ", class weights " + ", ".join(
            f"{n}: {w:.4g}" for n, w in zip(names, tr.head.class_weight, strict=True)
        )
    log.info(
        "mlptrain %s: %s, dataset %s (%d train / %d val / %d test), model %s (%s), %s, %s, bgrad %s%s",
        __version__,
        tr.backend.describe(),
        ds.name,
        len(ds.y_train),
        len(ds.y_val),
        len(ds.y_test),
        "-".join(map(str, tr.widths)),
        _params(tr.model.num_params, tr.members),
        tr.cfg.execution.mode.value,
        tr.precision.name,
        ",".join(tr.model.bgrad) or "-",
        weights,
    )
    if start.resumed_from is not None:
        p = start.position
        log.info("resuming from %s at step %d (%s)", start.resumed_from, p.step, p.describe())
    for note in start.notes:
        log.warning(note)


def _record_end(tr: Trainer, run_dir: RunDirectory, start: Start) -> None:
    """Add to ``run.json`` where the run's time went (:mod:`mlptrain.base.timeline`) and, on the GPU, the memory
    account at its end (peak and live bytes by category); an ensemble's per member too (``memory.members``)."""
    record = _run_record(tr, start)
    if tr.backend.is_gpu:
        from mlptrain.step.cuda.memory import account, describe

        record["memory"] = account(tr)
        log.info("GPU memory: %s", describe(record["memory"]).replace("\n", "; "))
    if tr.members > 1:  # an ensemble: what one member costs, and its K members (on either device)
        record.setdefault("memory", {})["members"] = member_account(tr)
        log.info("memory: %s", describe_members(record["memory"]["members"]))
    timeline = current()
    if timeline is not None:
        record["timeline"] = timeline.record()
        log.info("time: %s", timeline.describe())
    run_dir.write_json(RUN_RECORD, record)


def _run_record(tr: Trainer, start: Start) -> dict[str, Any]:
    record: dict[str, Any] = {
        "mlptrain": __version__,
        "python": platform.python_version(),
        **tr.backend.versions(),
        "device": tr.backend.describe(),
        "widths": tr.widths,
        "bgrad": tr.model.bgrad,
        "head": tr.head.mode,
        "params": tr.model.num_params,
        "dataset": tr.dataset.preprocessing()[0],  # its name, task, feature and class names (docs/data.md)
        "config": to_plain(tr.cfg),
    }
    if tr.head.class_weight is not None:  # model.class_weight resolved (balanced: from the training split)
        record["class_weight"] = tr.head.class_weight
    if start.resumed_from is not None:
        record["resumed_from"] = {"checkpoint": str(start.resumed_from), "step": start.position.step}
    return record


def _params(total: int, members: int) -> str:
    """The parameter count of the run's line: one model's, or an ensemble's per member and in all."""
    return f"{total:,} params" if members == 1 else f"{total // members:,} params each, {members} members: {total:,}"
