"""The epoch loop of a run: steps, the log interval, evaluation, checkpoints, stop requests.

:meth:`Loop.run` reads like a training script::

    for epoch in range(start.epoch, cfg.epochs):
        for step in interval.steps(epoch):         # train_epoch: trainer.step(x, y) on each batch (as sklearn's)
            ...                                    # metrics (one sync per log interval), checks, checkpoints
        ...                                        # end_epoch: evaluate, epoch record, best, last

Everything else has a name: :class:`~mlptrain.run.interval.Interval` keeps the host side of the steps whose metrics are
still on the device, :meth:`Loop.save` writes a checkpoint of the trainer's state at a position,
:meth:`Loop.interrupt` saves and stops on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from tqdm.auto import tqdm

from mlptrain.base.errors import TrainingInterrupted
from mlptrain.base.stopping import Stop
from mlptrain.base.timeline import timed
from mlptrain.config.schema import to_plain
from mlptrain.run import checkpoint, faults
from mlptrain.run.checkpoint import Position
from mlptrain.run.ensemble import EnsembleTrainer
from mlptrain.run.interval import Closed, Interval, epoch_line
from mlptrain.run.metrics import MetricsWriter, read_metrics
from mlptrain.run.resume import Start
from mlptrain.run.rundir import RunDirectory
from mlptrain.run.saving import Writer
from mlptrain.step.trainer import Trainer

log = logging.getLogger(__name__)


class Loop:
    """Epochs from ``start`` to the end of the run, writing into ``run_dir``; ``stop`` says when to stop early.

    On the CPU the loss and every tensor are checked after each step (no device to sync), naming
    the exact step; on the GPU at the interval's one sync, so a step never waits for the host.
    """

    def __init__(
        self,
        tr: Trainer,
        run_dir: RunDirectory,
        metrics: MetricsWriter,
        stop: Stop,
        start: Start,
    ) -> None:
        self.tr, self.cfg, self.run_dir, self.metrics, self.stop = tr, tr.cfg, run_dir, metrics, stop
        self.start, self.best = start.position, start.best
        resumed_from = start.resumed_from
        self.interval = Interval(tr, tr.cfg.log_every)
        self.each_step = not tr.backend.is_gpu
        # Write each log interval's records while the device runs the next (GPU, one process): see Interval.
        self.lagged = tr.writes_metrics_late
        self.in_flight: Closed | None = None  # the interval closed last, not yet written (lagged)
        self.writer = Writer()  # checkpoints written on a thread while the steps go on
        self.last_saved: tuple[Path, int] | None = (resumed_from, self.start.step) if resumed_from is not None else None
        self.progress_disable = None if self.cfg.progress is None else not self.cfg.progress
        self.record: dict[str, Any] = {}
        self.stopped_early: int | None = start.stopped_early  # set: the run stopped early, its summary unwritten
        self.last_loss = 0.0  # the training loss of the last step written (inf/NaN: skipped_error at a save)

    def run(self) -> dict[str, Any]:
        """Train to the end (or a stop request); returns the summary record."""
        try:
            return self._run()
        except BaseException:
            try:  # what was queued is written (the error's "last checkpoint" note says so) before the error goes on
                self.writer.close()
            except Exception as exc:  # the run's own error is the one to report
                log.error("a checkpoint write failed while the run stopped: %s", exc)
            raise
        finally:
            self.writer.close()

    def _run(self) -> dict[str, Any]:
        tr, cfg = self.tr, self.cfg
        t_start = time.perf_counter()
        if self.stop.requested:  # asked to stop while the run was being set up
            self.interrupt(self.start)
        if self.start.step >= tr.total_steps or self.stopped_early is not None:
            return self.summary(self.finish(), t_start)  # a run stopped after its last checkpoint, before its summary
        # inf/NaN are reported by the checks, which name the step and the tensor: no NumPy warnings
        with tr.stream, np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            epochs = tqdm(
                range(self.start.epoch, cfg.epochs),
                initial=self.start.epoch,
                total=cfg.epochs,
                desc="epoch",
                unit="epoch",
                position=0,
                disable=self.progress_disable,
            )
            epoch, here = self.start.epoch, self.start
            for epoch in epochs:
                faults.stop_if_data_changed(self, here)  # a streamed file rewritten or truncated: saved, stopped
                t_epoch = time.perf_counter()
                pos, done = self.train_epoch(epoch)
                here, stop_early = self.end_epoch(epoch, pos, done, t_epoch)
                epochs.set_postfix(
                    {k: f"{v:.4f}" for k, v in self.record.items() if k in ("train/loss", "val/acc", "test/acc")},
                    refresh=False,
                )
                self.interval.restart_clock()  # evaluation and saving are not training throughput
                if done or stop_early:
                    break
                if self.stop.requested:
                    self.interrupt(here)
        return self.summary(epoch + 1, t_start)

    def summary(self, epochs: int, t_start: float) -> dict[str, Any]:
        """Write and return the summary record: the run's size and speed, the last epoch's metrics, and the
        best checkpoint's epoch, metric and test scores (``best/test/acc`` ...)."""
        tr = self.tr
        with timed("save"):
            self.writer.wait()  # best.npz is read back below
        self.stop.beat()  # (a large checkpoint on slow storage: not a hang)
        wall = time.perf_counter() - t_start
        summary = {
            "kind": "summary",
            "steps": tr.step_count,
            "epochs": epochs,
            "wall_s": wall,
            "samples_per_s": (tr.step_count - self.start.step) * self.cfg.data.batch_size / wall,
            **{k: v for k, v in self.record.items() if "/" in k},
            "best": self.best.__dict__,
            **{f"best/{k}": v for k, v in self.best_scores().items()},
        }
        if self.stopped_early is not None:
            summary["stopped_early"] = self.stopped_early
        if isinstance(tr, EnsembleTrainer):  # members.md, folds.json, oof_predictions.csv, before the summary record:
            tr.finish(self.run_dir.path, summary)  # a run stopped while writing them is finished by its resume
        self.metrics.write(**summary)
        return summary

    def best_scores(self) -> dict[str, float]:
        """The test scores of the parameters in ``best.npz`` (evaluated in place, then the last state put back).

        Where ``best.npz`` holds the parameters the last epoch record evaluated (best is the last epoch, as it
        often is), its test scores are that record's: the same parameters, evaluated as the epoch ended, so
        nothing is read back or evaluated again. (Every rank decides alike: the record and ``best`` are all-reduced.)
        """
        path = self.run_dir.checkpoint("best")
        if "test" not in self.tr.eval_loaders:
            return {}
        rec = self.record
        if rec.get("step") == self.best.step == self.tr.step_count and "test/loss" in rec:
            return {k: v for k, v in rec.items() if k.startswith("test/")}
        if not self._everyone(path.is_file()):
            return {}
        model = self.tr.model
        now = model.state_dict()
        best = checkpoint.load(path).arrays
        model.load_state_dict({k[len("param/") :]: v for k, v in best.items() if k.startswith("param/")})
        try:
            with timed("evaluate"):
                return self.tr.evaluate("test")
        finally:
            model.load_state_dict(now)

    def _everyone(self, mine: bool) -> bool:
        """``mine`` on every rank (data parallel: an all-reduce, so that a collective that follows is
        entered by all ranks or by none); on one rank, ``mine``."""
        sync = self.tr.grad_sync
        if sync is None:
            return mine
        votes = np.array([1.0 if mine else 0.0])
        sync.comm.all_reduce([votes])
        return int(votes[0]) == sync.comm.world

    def finish(self) -> int:
        """End a run whose last checkpoint is its end: the last epoch's record (evaluated again where the
        run stopped inside an epoch, read back where it ended one); returns the epochs run."""
        pos = self.start
        if pos.batch > 0:  # a partial epoch (max_steps): its record comes after the checkpoint
            self.end_epoch(pos.epoch, pos, True, time.perf_counter())
            return pos.epoch + 1
        self.record = next(r for r in reversed(read_metrics(self.metrics.path)) if r["kind"] == "epoch")
        return pos.epoch

    def train_epoch(self, epoch: int) -> tuple[Position, bool]:
        """The steps of ``epoch`` (from the start position in the first); returns where it ended and
        whether the run is done."""
        tr, cfg, interval = self.tr, self.cfg, self.interval
        pos = self.start if epoch == self.start.epoch else Position(epoch, 0, tr.step_count)
        samples, batch, done = pos.samples, pos.batch, False
        bar = tqdm(
            interval.steps(epoch, pos, self.start.step),
            initial=batch,
            total=tr.steps_per_epoch,
            desc=f"train {epoch + 1}/{cfg.epochs}",
            unit="batch",
            leave=False,
            position=1,
            disable=self.progress_disable,
        )
        for step in bar:
            samples += step.rows
            batch += 1
            done = tr.step_count >= tr.total_steps
            if self.each_step:
                # (an ensemble's (K,) losses: their largest, which a NaN in any member makes NaN)
                self.check(np.array([float(np.max(step.loss))]), np.array([step.lr]), epoch, flush_first=True)
            ckpt_due = cfg.checkpoint_steps > 0 and tr.step_count % cfg.checkpoint_steps == 0 and not done
            if interval.full or done or ckpt_due or self.stop.requested:
                losses = self.flush(epoch, wait=done or ckpt_due or self.stop.requested)
                if losses is not None:
                    bar.set_postfix(loss=f"{losses[-1]:.4f}", sps=f"{interval.samples_per_s:,.0f}", refresh=False)
            if (ckpt_due or self.stop.requested) and not done:
                here = self.position(epoch, batch, samples)
                if self.stop.requested:
                    self.interrupt(here)
                self.save("last", here)
                interval.restart_clock()  # saving is not training throughput
            if done:
                break
        if interval.pending or self.in_flight is not None:  # the epoch's step records come before its epoch record
            self.flush(epoch)
        return self.position(epoch, batch, samples), done

    def end_epoch(self, epoch: int, pos: Position, done: bool, t_epoch: float) -> tuple[Position, bool]:
        """Evaluate, write the epoch record (and its log line), save ``best`` (first) and ``last``.

        Returns where the run stands, and whether early stopping ends it here.
        """
        tr, cfg = self.tr, self.cfg
        n = max(pos.samples, 1)
        rec: dict[str, Any] = {"kind": "epoch", "epoch": epoch, "step": tr.step_count, "train/loss": pos.loss_sum / n}
        if self.interval.classification:
            rec["train/acc"] = pos.correct / n
        for split in tr.eval_loaders:
            with timed("evaluate"):
                rec.update(tr.evaluate(split))
            self.stop.beat()
        rec.update(tr.epoch_extras())  # an ensemble: each member's training loss and accuracy
        rec["time_s"] = time.perf_counter() - t_epoch
        self.record = rec
        # A checkpoint after a whole epoch resumes at the next one, its epoch record written; one
        # after a partial epoch (max_steps) resumes inside it, before its epoch record.
        whole = pos.batch == tr.steps_per_epoch
        here = Position(epoch + 1, 0, tr.step_count) if whole else pos
        if whole:
            self.metrics.write(**rec)
        es, value = cfg.early_stopping, rec[self.best.metric]
        if self.best.matches(value):  # a tie too: the later epoch, trained longer, holds best
            improved = epoch if self.best.improves(value, es.min_delta) else self.best.improved
            self.best = dataclasses.replace(self.best, value=value, epoch=epoch, step=tr.step_count, improved=improved)
            self.save("best", here)  # before anything that refers to it: last's meta names this best
        stop_early = es.patience > 0 and not done and epoch - (self.best.improved or 0) >= es.patience
        end = done or stop_early or self.stop.requested
        if end or (cfg.checkpoint_every > 0 and (epoch + 1) % cfg.checkpoint_every == 0):
            self.save("last", here)
        if not whole:
            self.metrics.write(**rec)
        log.info(epoch_line(rec, cfg.epochs, tr, self.interval.samples_per_s))
        if stop_early:
            self.stopped_early = epoch
            b = self.best
            log.info(
                "early stopping after epoch %d: %s has not improved for %d epochs (best %.4g at epoch %d, in %s)",
                *(epoch + 1, b.metric, epoch - (b.improved or 0), b.value, (b.epoch or 0) + 1),
                self.run_dir.checkpoint("best"),
            )
        return here, stop_early

    def position(self, epoch: int, batch: int, samples: int) -> Position:
        """Where the run stands now, inside ``epoch`` (reads the epoch's running sums: syncs the device)."""
        log_ = self.tr.log
        return Position(epoch, batch, self.tr.step_count, float(log_.epoch_loss), int(log_.epoch_correct), samples)

    def flush(self, epoch: int, *, wait: bool = True) -> np.ndarray | None:
        """End the log interval and write step records: those of the interval closed before (lagged), and this
        one's too where ``wait`` or not lagged (then every step so far is written: a checkpoint, the epoch's
        end, a stop). Checks each interval written; returns the last written interval's losses (None: none yet).

        Data parallel: every rank also agrees here whether one of them was asked to stop."""
        closed = [self.in_flight] if self.in_flight is not None else []
        self.in_flight = None
        if self.interval.pending:
            now = self.interval.close()
            if wait or not self.lagged:
                closed.append(now)
            else:
                self.in_flight = now  # written at the next flush, while the device runs the next interval
        losses = None
        for c in closed:
            losses, lrs = self.interval.write(c, self.metrics, epoch)
            if not self.each_step:
                self.check(losses, lrs, epoch, closed=c)
            faults.check_scaler(self.tr, c.checks, c.last)
            self.last_loss = float(losses[-1])
        self.stop.agree()
        if self.tr.grad_sync is not None and self.cfg.distributed.verify:  # every rank still holds the same bytes
            from mlptrain.distributed.control import check_replicas

            check_replicas(self.tr.grad_sync.comm, self.tr.model.state_dict(), self.tr.step_count)
        return losses

    def check(
        self,
        losses: np.ndarray,
        lrs: np.ndarray,
        epoch: int,
        *,
        flush_first: bool = False,
        closed: Closed | None = None,
    ) -> None:
        """Stop with a NonFiniteError if a loss of the last steps (of ``closed``: that interval's) or a tensor
        (as ``closed`` ended; else now) is inf/NaN."""
        error = faults.nonfinite_error(
            self.tr,
            losses,
            lrs,
            epoch,
            each_step=self.each_step,
            saved=self.saved_note(),
            checks=closed.checks if closed is not None else None,
            last_step=closed.last if closed is not None else None,
        )
        if error is not None:
            self.writer.wait()  # the checkpoint the message names is on disk (or its write's error comes first)
            if flush_first:  # the records up to the bad step, then the error
                for c in ([self.in_flight] if self.in_flight is not None else []) + [self.interval.close()]:
                    self.interval.write(c, self.metrics, epoch)
                self.in_flight = None
            raise error

    def saved_note(self) -> str:
        if self.last_saved is None:
            return ""
        return f"; the last checkpoint, {self.last_saved[0]} (step {self.last_saved[1]}), is intact"

    def save(self, name: str, pos: Position) -> None:
        """Write checkpoint ``name`` (``last`` or ``best``) of the trainer at ``pos`` (syncs the device).

        Data parallel: every rank saves (the others into their private directories, :func:`mlptrain.run.run.train`),
        so that every rank reads the same ``best`` back for the summary's test scores."""
        with timed("save"):
            self._save(name, pos)

    def _save(self, name: str, pos: Position) -> None:
        if (error := faults.skipped_error(self.tr, self.last_loss, self.saved_note())) is not None:
            self.writer.wait()  # the checkpoint the message names is on disk
            raise error
        arrays, meta = self.tr.state_dict()
        meta.update(
            position=pos.__dict__,
            metrics_records=self.metrics.records,
            best=self.best.__dict__,
            config=to_plain(self.cfg),
        )
        path = self.run_dir.checkpoint(name)
        if name == "last":  # what a resume from it keeps: TensorBoard's events up to here on disk first
            self.metrics.flush_sinks()
        self.writer.submit(path, arrays, meta)  # hashed, zipped and synced on the writer's thread
        self.stop.beat()
        if name == "last":
            self.last_saved = (path, pos.step)

    def interrupt(self, pos: Position) -> NoReturn:
        """Ctrl-C or SIGTERM: save ``last`` at ``pos`` (unless it is there already), record it, stop."""
        last = self.run_dir.checkpoint("last")
        if self.last_saved != (last, pos.step):
            self.save("last", pos)
        self.writer.wait()  # "checkpoint saved": on disk before the message says so
        signum = self.stop.signum
        name = signal.Signals(signum).name
        self.metrics.write(kind="interrupted", step=pos.step, epoch=pos.epoch, checkpoint=str(last), signal=name)
        message = (  # the run's settings are in its checkpoint: the directory alone continues it
            f"interrupted at step {pos.step} ({pos.describe()}, {name}); checkpoint saved to {last}; "
            f"continue with: {self.run_dir.front.resume_command(self.run_dir.path)}"
        )
        log.warning(message)
        raise TrainingInterrupted(message, last, pos.step, signum)
