"""A log interval of the training loop: its steps' records, checks and time, collected one interval late on a GPU.

The step records its metrics on the device (:class:`~mlptrain.step.steplog.StepLog`); the loop writes them
once per ``log_every`` steps. :meth:`Interval.steps` takes an epoch's steps (the one step loop of the CLI's
:class:`~mlptrain.run.loop.Loop` and of the scikit-learn estimators) and counts them on the host;
:meth:`Interval.close` queues what the records need behind the interval's steps and returns a
:class:`Closed`; :meth:`Interval.write` waits for it and writes one ``step`` record per step.
:func:`epoch_line` is the log line of an epoch's record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from mlptrain.base.timeline import FIRST_STEPS, timed
from mlptrain.run.checkpoint import Position
from mlptrain.run.faults import IntervalChecks
from mlptrain.run.metrics import MetricsWriter
from mlptrain.step.steplog import MetricsRead
from mlptrain.step.trainer import Trainer


class Interval:
    """The steps of one log interval: host-side sizes and rates; their metrics are in ``tr.log`` on the device.

    :meth:`close` ends the interval: the step log's copies to the host (:meth:`StepLog.request`), the
    inf/NaN checks (:class:`~mlptrain.run.faults.IntervalChecks`) and a time mark are queued behind its
    steps, and a :class:`Closed` comes back at once; :meth:`write` waits for it and writes its step
    records. On a GPU the loop writes each interval while the device runs the next one, so that the log
    never leaves the device idle (a wait for the device at every interval stopped it until the host had
    written the records and queued the next steps: the loop's step took 1.4x the replayed graph's).

    Time: on a GPU, CUDA events recorded on the stream at the interval's start and end (the device's
    own clock: what the steps took, gaps where the host was late included); on the CPU, the host clock.
    """

    def __init__(self, tr: Trainer, log_every: int) -> None:
        self.tr = tr
        self.classification = tr.dataset.task == "classification"
        self.size = np.zeros(log_every, dtype=np.int64)
        self.lr = np.zeros(log_every)
        self.pending = 0
        self.samples_per_s = 0.0
        self.gpu = tr.backend.is_gpu
        self.watch: Any = None
        if self.gpu:
            from mlptrain.step.cuda.nonfinite import NonfiniteWatch

            self.watch = NonfiniteWatch()
        self.restart_clock()

    def restart_clock(self) -> None:
        """Start timing here (after evaluation and checkpoints, which are not training throughput)."""
        self.started = self._mark()

    def _mark(self) -> Any:
        if not self.gpu:
            return time.perf_counter()
        from mlptrain.base.cuda.timing import stream_mark

        return stream_mark()

    def steps(self, epoch: int, start: Position | None = None, run_start: int = 0) -> Iterator[Step]:
        """The steps of ``epoch`` from ``start`` (inside it: its batch and running sums; default its beginning).

        Each takes the next batch (:meth:`~mlptrain.step.trainer.Trainer.train_batches`) at the schedule's
        learning rate, is counted in this interval (its metrics stay on the device until :meth:`close`) and
        is yielded; the caller closes the interval (:attr:`full`, or earlier) and stops where it wants.
        The run's first steps from step ``run_start`` are timed apart (warm-up and capture,
        :mod:`mlptrain.base.timeline`).
        """
        tr, start = self.tr, start or Position(epoch)
        tr.log.start_epoch(start.loss_sum, start.correct)  # the epoch's running sums, on the device
        for x, y in tr.train_batches(epoch, start.batch):
            lr = tr.lr_at(tr.step_count)
            with timed("first steps") if tr.step_count - run_start < FIRST_STEPS else contextlib.nullcontext():
                loss, _ = tr.step(x, y)
            rows = tr.rows(y)  # of the global batch (data parallel: every rank's shard together)
            self.size[self.pending], self.lr[self.pending] = rows, lr  # host only: the metrics are on the device
            self.pending += 1
            yield Step(loss, lr, rows)

    @property
    def full(self) -> bool:
        """Whether the interval has its ``log_every`` steps (the step log's ring is full: close it now)."""
        return self.pending == len(self.size)

    def close(self) -> Closed:
        """End the interval: its metrics, checks and end mark queued behind its steps (no wait)."""
        n, tr = self.pending, self.tr
        first = tr.step_count - n
        read = tr.log.request(first, n)
        checks = IntervalChecks(tr, self.watch)
        end = self._mark()
        closed = Closed(first, n, self.size[:n].copy(), self.lr[:n].copy(), read, checks, self.started, end)
        self.pending = 0
        self.started = end
        return closed

    def write(self, closed: Closed, metrics: MetricsWriter, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Write one ``step`` record per step of ``closed`` (waits for its copies); return their losses and lrs."""
        got = closed.read.result()
        n, tr = closed.n, self.tr
        if self.gpu:
            from mlptrain.base.cuda.timing import seconds_between

            seconds = seconds_between(closed.start, closed.end)
        else:
            seconds = closed.end - closed.start
        self.samples_per_s = int(closed.size.sum()) / max(seconds, 1e-9)
        step_ms = seconds * 1e3 / n
        for j in range(n):
            rec: dict[str, Any] = {
                "kind": "step",
                "step": closed.first + j,
                "epoch": epoch,
                "train/loss": float(got["loss"][j]),
            }
            if self.classification:
                rec["train/acc"] = int(got["correct"][j]) / int(closed.size[j])
            rec["lr"] = float(closed.lr[j])
            if tr.scaler.enabled:
                rec["loss_scale"] = float(got["scale"][j])
                rec["skipped"] = bool(got["skip"][j])
            if j == n - 1:
                rec.update(samples_per_s=self.samples_per_s, step_time_ms=step_ms)
            metrics.write(**rec)
        return got["loss"], closed.lr


class Step(NamedTuple):
    """A training step taken (:meth:`Interval.steps`)."""

    loss: Any  # the step's loss on the device (float() syncs it)
    lr: float  # its learning rate (host value)
    rows: int  # the rows of its global batch


@dataclasses.dataclass
class Closed:
    """A log interval ended (:meth:`Interval.close`): steps ``first .. first + n - 1``, on their way to the host."""

    first: int
    n: int
    size: np.ndarray  # (n,) rows of each step's global batch
    lr: np.ndarray  # (n,) each step's learning rate (host values)
    read: MetricsRead  # the step log's copies
    checks: IntervalChecks  # inf/NaN tensors and fp16's skip count as the interval ended
    start: Any  # time marks: CUDA events (GPU) or perf_counter() seconds (CPU)
    end: Any

    @property
    def last(self) -> int:
        return self.first + self.n - 1


def epoch_line(rec: dict[str, Any], epochs: int, tr: Trainer, samples_per_s: float) -> str:
    """One line per epoch, as Keras' ``verbose=2`` prints (also when no progress bar is shown)."""
    parts = [f"epoch {rec['epoch'] + 1}/{epochs}"]
    for split in ("train", "val", "test"):
        scores = [f"{k} {rec[f'{split}/{k}']:.4f}" for k in ("loss", "acc") if f"{split}/{k}" in rec]
        if scores:
            parts.append(f"{split} " + " ".join(scores))
    parts.append(f"lr {tr.lr_at(max(tr.step_count - 1, 0)):.3g}")
    parts.append(f"{samples_per_s:,.0f} samples/s")
    if tr.scaler.enabled:
        parts.append(f"loss scale {float(tr.scaler.scale):.3g}")
    parts.append(f"{rec['time_s']:.1f} s")
    return " | ".join(parts)
