"""A run's CuPy kernels, compiled on several threads before their first launch (issue #14).

From an empty kernel cache (a fresh machine, a new CuPy) a run compiles its kernels with NVRTC,
each at its first launch and so one after another: the data loader's gathers, the loss, the head
kernel, the optimizer and the inf/NaN checks in the first steps. Here they start long before their
first launch, under work that start-up does anyway (importing nvmath, loading the data, planning
the first step's GEMMs), on several threads. Threads overlap less than one would hope (NVRTC
compiles little in parallel), so what the run waits for is mostly how many kernels there are to
compile; ``docs/benchmarks.md`` has the figures.

A *job* (:class:`~mlptrain.base.cuda_source.Job`) compiles a kernel by making the very call the run will
make, on zero-filled scratch arrays of the same dtypes, shapes and layouts. CuPy compiles one kernel
per source and argument signature (dtypes, dimensions after merging contiguous ones, contiguity,
32-bit indexing), so the same call compiles the same kernel, and the run's own call then finds it in
CuPy's cache. Each object that writes CUDA source declares its jobs beside that source (its
``precompile_jobs()``: the optimizer, the loss scaler, the step log's tail, the output head, the
header-free module of :mod:`mlptrain.base.cuda.plain_kernels`), and the trainer collects those of the step
(:meth:`mlptrain.step.trainer.Trainer.precompile_jobs`); this module only runs them. A job writes only to
its scratch arrays and to copies of its object, launches only on its thread's own non-blocking
stream, never the legacy default stream or the training stream, and is done once that stream is idle.

Jobs belong to the *stage* of the run that first launches their kernels; the trainer waits for a
stage just before it (:meth:`Precompiler.wait`, through :meth:`mlptrain.step.runtime.Runtime.wait`):

========== ============================================ ============================ =====================
stage      kernels                                      declared by                  the trainer waits
========== ============================================ ============================ =====================
``setup``  the cast of the parameters to the compute    :func:`dtype_jobs` (the      before building the
           dtype; resuming: CuPy's fill (a checkpoint's precision)                   model
           counters)
``batch``  mlptrain's header-free module: the loader's  ``base/cuda/plain_kernels.py``     before the first batch
           gather and the inf/NaN check of the log
           interval (:mod:`mlptrain.base.cuda.plain_kernels`)
``loss``   the loss kernels, the head kernel            the output head              before the first loss
``update`` the optimizer's kernel, the fp16 check       the optimizer (with the step before the first update
                                                        log's tail), the loss scaler
``later``  evaluation's scores (argmax, the confusion   :func:`mlptrain.nn.scores.   after the first step
           matrix, the casts and sums of                sums_job`, collected by the
           :class:`~mlptrain.nn.scores.SplitSums`)       trainer
========== ============================================ ============================ =====================

:func:`early` starts the dtype jobs (:func:`dtype_jobs`) before the backend imports nvmath (the run
calls it first; a :class:`~mlptrain.step.trainer.Trainer` built alone starts them itself), and the
trainer adds the step's jobs once it is built. A job whose scratch exceeds :data:`SCRATCH_LIMIT` is
not run: its kernel compiles at its first launch (:attr:`Precompiler.left`). No job runs while a
CUDA graph is captured: the trainer waits for every job before the bgrad probe, and joins the
threads (:meth:`Precompiler.close`) after the first training step, which is never captured (a graph
is captured after uncaptured warm-up steps). A job that fails logs a warning and its kernel compiles
at its first launch, as before. ``execution.precompile=false`` turns all of this off (to measure it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any

import numpy as np

from mlptrain.base.cuda import plain_kernels
from mlptrain.base.cuda_source import Job

__all__ = ["STAGES", "Job", "Precompiler", "dtype_jobs", "early", "start"]

log = logging.getLogger(__name__)

STAGES = ("setup", "batch", "loss", "update", "later")
# NVRTC gains little past 8 threads (docs/benchmarks.md, "Figures moved out of the code").
# One core stays for the main thread.
WORKERS = max(1, min(8, (os.cpu_count() or 2) - 1))
THREAD_NAME = "mlptrain-precompile"
# Bytes of zeros a job may allocate to mirror a call (the optimizer's: every parameter, gradient and
# state once more). A larger model's kernel compiles at its first launch: its run is long anyway.
SCRATCH_LIMIT = 64 * 2**20


class Precompiler:
    """Jobs on a pool of threads; the run waits for them stage by stage, then :meth:`close` joins them.

    Args:
        device: the run's CUDA device (a new thread starts on device 0).
        workers: threads, each compiling one kernel at a time.
        context: what each job runs inside; default :func:`_on_device` (tests pass a no-op).
    """

    def __init__(
        self, device: int | None = None, workers: int = WORKERS, *, context: Callable[[], Any] | None = None
    ) -> None:
        self._context = context or functools.partial(_on_device, device)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=THREAD_NAME)
        self._jobs: list[tuple[Job, Future]] = []
        self.workers = workers
        self.done: list[str] = []  # names of the jobs that ran (list.append is atomic: no lock)
        self.failed: list[str] = []  # names of the jobs that raised: compiled at first use instead
        self.left: list[str] = []  # names of the jobs not run, their scratch over SCRATCH_LIMIT: compiled at first use
        self.waited_s = 0.0  # how long the run waited for jobs
        self.closed = False
        self._started = time.perf_counter()

    def submit(self, jobs: Iterable[Job], *, last: bool = False) -> None:
        """Queue ``jobs``, those of earlier stages first; each starts as soon as a thread is free.

        ``last``: no more jobs will come, so each thread ends when the queue is empty (a trainer
        that is never stepped, and so never closes this, leaves no idle threads behind). A job whose
        scratch exceeds :data:`SCRATCH_LIMIT` is not run (:attr:`left`).
        """
        if self.closed:
            raise RuntimeError("this Precompiler is closed")
        jobs = list(jobs)
        for job in jobs:
            if job.stage not in STAGES:
                raise ValueError(f"job {job.name!r} has stage {job.stage!r}; expected one of {', '.join(STAGES)}")
        for job in [j for j in jobs if j.scratch > SCRATCH_LIMIT]:
            log.debug("%s compiles at its first launch: %d MiB of scratch", job.name, job.scratch >> 20)
            self.left.append(job.name)
        for job in sorted((j for j in jobs if j.scratch <= SCRATCH_LIMIT), key=lambda j: STAGES.index(j.stage)):
            self._jobs.append((job, self._pool.submit(self._run, job)))
        if last:
            self._pool.shutdown(wait=False)

    def _run(self, job: Job) -> None:
        t0 = time.perf_counter()
        try:
            with self._context():
                job.run()
        except Exception as exc:  # never the run's problem: the kernel compiles at its first launch instead
            self.failed.append(job.name)
            name, why = job.name, f"{type(exc).__name__}: {exc}"
            log.warning("compiling %s ahead failed (%s); it compiles at its first use instead", name, why)
            return
        self.done.append(job.name)
        log.debug("compiled %s ahead in %.0f ms", job.name, (time.perf_counter() - t0) * 1e3)

    def wait(self, stage: str | None = None) -> None:
        """Block until every job of ``stage`` (None: every job) submitted so far has finished."""
        t0 = time.perf_counter()
        wait_for([f for job, f in self._jobs if stage is None or job.stage == stage])
        self.waited_s += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for every job and end the threads (a second call does nothing)."""
        if self.closed:
            return
        self.wait()
        self._pool.shutdown(wait=True)
        self.closed = True
        failed = f"; {len(self.failed)} failed, compiled at first use: {', '.join(self.failed)}" if self.failed else ""
        took = time.perf_counter() - self._started
        msg = "%d kernel jobs compiled ahead on %d threads in %.2f s (the run waited %.2f s for them)%s"
        log.info(msg, len(self.done), self.workers, took, self.waited_s, failed)


@contextlib.contextmanager
def _on_device(device: int | None) -> Iterator[None]:
    """Run a job on ``device`` and a non-blocking stream of its own; on exit its work has finished.

    Not the legacy default stream: it synchronises with every blocking stream, and a launch there
    while another thread captures a graph would break the capture. Not the training stream either.
    """
    import cupy as cp

    with cp.cuda.Device(device):
        stream = cp.cuda.Stream(non_blocking=True)
        try:
            with stream:
                yield
        finally:
            stream.synchronize()
            cp.get_default_memory_pool().free_all_blocks(stream=stream)  # the job's scratch, cached for this stream


def early(cfg: Any) -> Precompiler | None:
    """Start compiling the dtype jobs of the run ``cfg`` describes, or None if it will not run on a GPU
    (or ``execution.precompile=false``).

    :func:`mlptrain.run.run.train` calls this before ``get_backend``, which spends the next half second
    importing nvmath; the threads compile meanwhile (and create the CUDA context).
    """
    if getattr(cfg.device, "value", cfg.device) == "cpu" or not cfg.execution.precompile:
        return None
    if importlib.util.find_spec("nvmath") is None:
        return None
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            return None
        from mlptrain.base.backend import Backend
        from mlptrain.step.precision import get_precision

        precision = get_precision(getattr(cfg.precision.name, "value", cfg.precision.name), Backend("gpu", cp))
    except Exception:  # no usable CuPy or driver: get_backend says what is missing
        return None
    return start(precision, resume=cfg.resume is not None)


def start(precision: Any, *, resume: bool = False) -> Precompiler:
    """A :class:`Precompiler` on the current device running :func:`dtype_jobs`."""
    import cupy as cp

    pre = Precompiler(cp.cuda.runtime.getDevice())
    pre.submit(dtype_jobs(precision, resume=resume))
    return pre


# --- what to compile ---------------------------------------------------------------------------


def dtype_jobs(precision: Any, *, resume: bool = False) -> list[Job]:
    """The kernels that only the run's dtypes decide: :class:`~mlptrain.step.precision.Precision` ``precision``.

    The step's bookkeeping (step count, learning rate, loss scale) needs no kernel: it is copied
    from the host. The parameters' cast depends on the precision. ``resume``: a checkpoint's
    counters are set with ``a[...] = value``, which CuPy does with its fill kernel.
    """
    cdt, pdt = np.dtype(precision.compute_dtype), np.dtype(precision.param_dtype)
    jobs = plain_kernels.precompile_jobs()  # the loader's gather, the inf/NaN flags: no dtype in their source
    if cdt != pdt:
        cast = functools.partial(_cast, pdt, cdt)
        jobs.append(Job(f"cupy_copy {pdt.name} -> {cdt.name} (Param: the compute copy)", "setup", cast))
    if resume:
        jobs.append(Job("cupy_fill int64 (StepClock.set)", "setup", functools.partial(_fill, np.int64)))
        if precision.loss_scaling:
            jobs.append(Job("cupy_fill int32, divide float64 (LossScaler.load_state_dict)", "setup", _scaler_state))
    return jobs


# --- the dtype jobs: CuPy's own kernels, each the run's call on scratch arrays --------------------


def _fill(dtype: Any) -> None:
    import cupy as cp

    cp.zeros((), dtype).fill(1)  # a[...] = value and xp.ones() call fill; 0 is a memset, any other value the kernel


def _cast(src: Any, dst: Any) -> None:
    import cupy as cp

    cp.zeros((2, 3), src).astype(dst)  # a weight (out, in); merged into one dimension, as a bias is
    cp.zeros(3, src).astype(dst)


def _scaler_state() -> None:
    import cupy as cp

    cp.zeros((), cp.int32).fill(1)
    cp.divide(1.0, cp.ones((), cp.float64), out=cp.zeros((), cp.float64))
