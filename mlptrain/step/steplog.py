"""The end of a training step: bookkeeping and metrics, recorded on the device in one kernel.

After the optimizer update a step still has small jobs: the loss scaler grows or backs off, the
learning-rate schedule moves to the next step, and the step's loss, correct count, skip flag and
loss scale must be kept for the log. Each is a handful of scalar operations; as separate CuPy
operations they are seven or eight launches per step, which in a replayed CUDA graph cost more
GPU time than the small model's GEMMs, and outside the graph a few microseconds of host time
each. :class:`StepLog` does all of it in one single-thread kernel that the graph captures with the
rest of the step, so the host does nothing per step but replay the graph.

Metrics go into a ring of ``capacity`` slots in device memory, indexed by the device step count
(slot ``step % capacity``, :class:`~mlptrain.step.schedule.StepClock`); the training loop reads the ring
back once per log interval, and ``capacity`` is the interval length. :meth:`StepLog.request` queues
the interval's copies on the stream and returns at once; :meth:`MetricsRead.result` waits for them
later (the loop collects one interval while the device runs the next), so a log interval need not
stop the device. A slot is never overwritten before it is read: the copy is queued after the
interval's steps and before the next interval's, and the stream runs them in that order.
The epoch's running sums live on the device too.

On the CPU the same bookkeeping runs as NumPy operations, in the same order.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from mlptrain.base.backend import scalar
from mlptrain.base.cuda_source import KernelTail
from mlptrain.step.precision import SCALER_UPDATE_CUDA, LossScaler
from mlptrain.step.schedule import LR_AT_CUDA, LRSchedule


class StepLog:
    """Per-step metrics in a device ring, the epoch's running sums, and the end-of-step kernel.

    Args:
        xp: NumPy or CuPy.
        capacity: ring slots (the log interval).
        scaler: its :meth:`~mlptrain.step.precision.LossScaler.update` runs at the end of each step.
        schedule: at the end of each step its clock's device count advances and its rate follows
            (:class:`~mlptrain.step.schedule.LRSchedule`).

    Attributes (device arrays): ``loss`` (capacity,) float64, ``correct`` (capacity,) int64,
    ``skip`` (capacity,) int32 (fp16: the step overflowed and was skipped), ``scale`` (capacity,)
    float64 (the loss scale after the step), ``epoch_loss`` 0-d float64 (sum of loss x batch size)
    and ``epoch_correct`` 0-d int64.
    """

    def __init__(self, xp: Any, capacity: int, scaler: LossScaler, schedule: LRSchedule) -> None:
        if capacity < 1:
            raise ValueError(f"StepLog capacity={capacity} must be at least 1")
        self.xp = xp
        self.capacity = int(capacity)
        self.scaler = scaler
        self.schedule = schedule
        self.loss = xp.zeros(capacity, dtype=xp.float64)
        self.correct = xp.zeros(capacity, dtype=xp.int64)
        self.skip = xp.zeros(capacity, dtype=xp.int32)
        self.scale = xp.zeros(capacity, dtype=xp.float64)
        self._host: list[dict[str, np.ndarray]] | None = None  # GPU: two sets of pinned host copies of the rings
        self._turn = 0  # the set the next request copies into
        self.epoch_loss = xp.zeros((), dtype=xp.float64)
        self.epoch_correct = xp.zeros((), dtype=xp.int64)
        self._tail_code: dict[str, tuple[str, str, str]] = {}
        # The batch size of each step shape as a 0-d device value, an argument of the end-of-step
        # code rather than a constant in it: one compiled kernel serves the full batches and the
        # epoch's short last batch (a constant made CuPy compile the optimizer kernel twice).
        self._batch_size: dict[int, Any] = {}

    def start_epoch(self, loss_sum: float = 0.0, correct: int = 0) -> None:
        """Reset the epoch's running sums (to a checkpoint's partial sums when resuming mid-epoch)."""
        self.epoch_loss[...] = loss_sum
        self.epoch_correct[...] = correct

    def end_step(self, loss: Any, correct: Any, batch_size: Any) -> None:
        """Record this step's metrics, update the loss scale, advance the step count and the rate.

        ``loss`` and ``correct`` are the step's 0-d device results; nothing is read back. On the
        GPU the training step does not call this: it hands the same work to the optimizer
        kernel's last block (:meth:`tail`).
        """
        xp, sc = self.xp, self.scaler
        if xp is not np:
            t = self.tail(loss, correct, batch_size, prefix="")
            from mlptrain.base.cuda.kernels import elementwise

            elementwise("", t.params, t.code, "mlptrain_end_step", preamble=t.preamble, no_return=True)(*t.args, size=1)
            return
        clock = self.schedule.clock
        k = int(clock.device) % self.capacity
        self.loss[k] = loss
        self.correct[k] = correct
        self.skip[k] = sc.found_inf
        sc.update()
        self.scale[k] = sc.scale
        self.epoch_loss += loss * batch_size
        self.epoch_correct += correct
        clock.advance_device()
        self.schedule.update()

    def after_update(
        self, update: Callable[[KernelTail | None], None], loss: Any, correct: Any, batch_size: Any
    ) -> None:
        """``update(tail)`` (the optimizer's step), then :meth:`end_step`: on the GPU in the update kernel's last
        block (``tail``, :meth:`tail`), so the step is one kernel; on the CPU after it (``tail`` None)."""
        if self.xp is not np:
            update(self.tail(loss, correct, batch_size))
            return
        update(None)
        self.end_step(loss, correct, batch_size)

    def tail(self, loss: Any, correct: Any, batch_size: Any, prefix: str = "log_") -> KernelTail:
        """:meth:`end_step` as CUDA statements for one thread, with parameter names starting with ``prefix``."""
        if prefix not in self._tail_code:
            self._tail_code[prefix] = self._tail_source(prefix)
        code, params, preamble = self._tail_code[prefix]
        if isinstance(batch_size, int | np.integer):
            rows = self.rows_value(int(batch_size))
        else:  # a 0-d float64 device array: the global batch's rows of a data-parallel step
            rows = batch_size
        sc, sched = self.scaler, self.schedule
        arrays = (
            loss,
            correct,
            sc.found_inf,
            sc.scale,
            sc.inv_scale,
            sc.growth_tracker,
            sc.consecutive_skips,
            sched.clock.device,
            sched.lr,
            self.loss,
            self.correct,
            self.skip,
            self.scale,
            self.epoch_loss,
            self.epoch_correct,
            rows,
        )
        return KernelTail(code, params, arrays, preamble)

    def rows_value(self, b: int) -> Any:
        """The 0-d float64 device value of a batch of ``b`` rows that the tail reads, made on first use: in an
        uncaptured step (a graph's warm-up), or ahead of a capture (:meth:`mlptrain.step.trainer.Trainer.step`)."""
        if b not in self._batch_size:
            self._batch_size[b] = scalar(self.xp, b, np.float64)  # a host copy: no kernel to compile
        return self._batch_size[b]

    def scratch_tail(self, loss_dtype: Any, batch_size: int) -> KernelTail:
        """:meth:`tail` as the training step calls it, on arrays of zeros: what compiling the step's kernel ahead
        hands it (:meth:`mlptrain.step.optim.Optimizer.precompile_jobs`). This log's caches and state stay untouched."""
        xp, lg = self.xp, copy.copy(self)
        lg._tail_code, lg._batch_size = {}, {}  # its own caches
        tail = lg.tail(xp.zeros((), loss_dtype), xp.zeros((), xp.int64), batch_size)
        # the tail's arrays are the run's state (metrics ring, loss scale, step count, lr): zeros instead
        return dataclasses.replace(tail, args=tuple(xp.zeros_like(a) for a in tail.args))

    def _tail_source(self, prefix: str) -> tuple[str, str, str]:
        n = {name: prefix + name for name in _TAIL_ARRAYS}
        code = _END_STEP.format(
            **n,
            capacity=self.capacity,
            scaler_update=self.scaler.cuda_update(
                f"{n['found']}[0]", f"{n['scale']}[0]", f"{n['inv_scale']}[0]", f"{n['tracker']}[0]", f"{n['skips']}[0]"
            ),
            schedule_advance=self.schedule.clock.cuda_advance(f"{n['step']}[0]")
            + " "
            + self.schedule.cuda_update(f"{n['step']}[0]", f"{n['lr']}[0]"),
        )
        params = ", ".join(f"raw {t} {n[a]}" for a, t in _TAIL_ARRAYS.items())
        return code, params, SCALER_UPDATE_CUDA + LR_AT_CUDA

    def read(self, first_step: int, n: int) -> dict[str, np.ndarray]:
        """Host copies of the metrics of steps ``first_step .. first_step + n - 1`` (waits for the device)."""
        return self.request(first_step, n).result()

    def request(self, first_step: int, n: int) -> MetricsRead:
        """Queue host copies of the metrics of steps ``first_step .. first_step + n - 1``; return at once.

        GPU: the four rings are copied into pinned host buffers on the current stream, after the steps
        queued before, and an event marks the end; :meth:`MetricsRead.result` waits for that event
        only. Two sets of buffers take turns, so one read may be collected while the next is queued
        (a third request reuses the first read's buffers: collect it before). CPU: read now.
        """
        if not 0 <= n <= self.capacity:
            raise ValueError(f"cannot read {n} steps from a StepLog of capacity {self.capacity}")
        slots = (np.arange(first_step, first_step + n) % self.capacity).astype(np.int64)
        if self.xp is np:
            return MetricsRead({name: np.asarray(getattr(self, name))[slots] for name in _RINGS})
        if self._host is None:  # made once: page-locked, so that the copies are asynchronous
            self._host = [{name: _pinned(self.xp, getattr(self, name)) for name in _RINGS} for _ in range(2)]
        host = self._host[self._turn]
        self._turn ^= 1
        stream = self.xp.cuda.get_current_stream()
        for name in _RINGS:
            getattr(self, name).get(stream=stream, out=host[name], blocking=False)
        done = self.xp.cuda.Event(disable_timing=True)
        done.record(stream)
        return MetricsRead(host, slots, done)


class MetricsRead:
    """The metrics of a log interval on their way to the host (:meth:`StepLog.request`)."""

    def __init__(self, host: dict[str, np.ndarray], slots: np.ndarray | None = None, done: Any = None) -> None:
        self._host, self._slots, self._done = host, slots, done

    def result(self) -> dict[str, np.ndarray]:
        """``{"loss", "correct", "skip", "scale"}``, one value per step: waits for the copies (GPU), once."""
        if self._done is not None:
            self._done.synchronize()  # this interval's copies only: later steps may still be running
            self._host = {name: self._host[name][self._slots] for name in _RINGS}  # copies: the buffers take turns
            self._done = None
        return self._host


_RINGS = ("loss", "correct", "skip", "scale")


# The tail's arrays, in argument order, with their CUDA types (L, K: the loss's and count's dtypes).
_TAIL_ARRAYS = {
    "loss": "L",
    "correct": "K",
    "found": "int32",
    "scale": "float64",
    "inv_scale": "float64",
    "tracker": "int32",
    "skips": "int32",
    "step": "int64",
    "lr": "float64",
    "ring_loss": "float64",
    "ring_correct": "int64",
    "ring_skip": "int32",
    "ring_scale": "float64",
    "epoch_loss": "float64",
    "epoch_correct": "int64",
    "batch_size": "float64",
}

_END_STEP = """
{{  // end of the training step: metrics into the ring, loss scale, next step's lr
    const long long s = {step}[0];   // the step that just ran
    const long long k = s % {capacity}LL;
    {ring_loss}[k] = (double){loss}[0];
    {ring_correct}[k] = (long long){correct}[0];
    {ring_skip}[k] = {found}[0];
    {scaler_update}
    {ring_scale}[k] = {scale}[0];
    {epoch_loss}[0] += (double){loss}[0] * {batch_size}[0];
    {epoch_correct}[0] += (long long){correct}[0];
    {schedule_advance}
}}
"""


def _pinned(xp: Any, like: Any) -> np.ndarray:
    """A host array of ``like``'s shape and dtype in page-locked memory (copies to it can be asynchronous)."""
    mem = xp.cuda.alloc_pinned_memory(like.nbytes)
    return np.frombuffer(mem, like.dtype, like.size).reshape(like.shape)
