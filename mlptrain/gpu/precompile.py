"""A run's CuPy kernels, compiled on several threads before their first launch (issue #14).

From an empty kernel cache (a fresh machine, a new CuPy) the default GPU run compiled 9 kernels
with NVRTC, about 1.2 s on the H200, each at its first launch and so one after another: CuPy's
fill and two scalar copies while the trainer is built, then the data loader's two gathers, the
loss, the head kernel, the optimizer and the inf/NaN check of the log interval in the first steps.
The fill and the copies are gone (the step's bookkeeping is copied from the host,
:func:`mlptrain.backend.scalar`). The rest start long before their first launch, under work that
start-up does anyway (importing nvmath, loading the data, planning the first step's GEMMs), on
several threads. Threads overlap less than one would hope: on the H200 (NVRTC 13.0) 8 header-free
programs took 0.27 s one after another and 0.17 s from 8 threads, and 8 CuPy element-wise kernels
0.76 s and 0.65 s, so what the run waits for is mostly how many kernels there are to compile.

A *job* compiles a kernel by making the very call the run will make, on zero-filled scratch
arrays of the same dtypes, shapes and layouts. CuPy compiles one kernel per source and argument
signature (dtypes, dimensions after merging contiguous ones, contiguity, 32-bit indexing), so the
same call compiles the same kernel, and the run's own call then finds it in CuPy's cache. Calling
the run's own code (the loss function, the optimizer's step) rather than listing kernels by hand
keeps the list from going stale. A job writes only to its scratch arrays (the optimizer and the
step log are shallow copies holding zeros), launches only on its thread's own non-blocking stream,
never the legacy default stream or the training stream, and is done once that stream is idle.

Jobs belong to the *stage* of the run that first launches their kernels; the trainer waits for a
stage just before it (:meth:`Precompiler.wait`):

========== ============================================ ============================ =====================
stage      kernels                                      planned from                 the trainer waits
========== ============================================ ============================ =====================
``setup``  the cast of the parameters to the compute    the precision (dtypes)       before building the
           dtype; resuming: CuPy's fill (a checkpoint's                              model
           counters)
``batch``  mlptrain's header-free module: the loader's  nothing                      before the first batch
           gather and the inf/NaN check of the log
           interval (:mod:`mlptrain.gpu.plain_kernels`)
``loss``   the loss kernels, the head kernel            the loaders and the head     before the first loss
``update`` the optimizer's kernel, the fp16 check       the optimizer, the step log  before the first update
``later``  none now (a kernel first launched after the                               after the first step
           first step would go here)
========== ============================================ ============================ =====================

:func:`early` starts the dtype jobs (:func:`dtype_jobs`) before the backend imports nvmath (the run
calls it first; a :class:`~mlptrain.trainer.Trainer` built alone starts them itself), and the
trainer adds :func:`step_jobs` once it is built. No job runs while a CUDA graph is captured: the
trainer waits for every job before the bgrad probe, and joins the threads
(:meth:`Precompiler.close`) after the first training step, which is never captured (a graph is
captured after uncaptured warm-up steps). A job that fails logs a warning and its kernel compiles
at its first launch, as before. ``MLPTRAIN_PRECOMPILE=0`` turns all of this off (to measure it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

STAGES = ("setup", "batch", "loss", "update", "later")
# The H200 test: 16 compiles from 1.7 s to 0.9 s on 8 threads. One core stays for the main thread.
WORKERS = max(1, min(8, (os.cpu_count() or 2) - 1))
THREAD_NAME = "mlptrain-precompile"
# Bytes of zeros a job may allocate to mirror a call (the optimizer's: every parameter, gradient and
# state once more). A larger model's kernel compiles at its first launch: its run is long anyway.
SCRATCH_LIMIT = 64 * 2**20


def enabled() -> bool:
    """Whether kernels compile ahead: ``MLPTRAIN_PRECOMPILE=0`` turns it off."""
    return os.environ.get("MLPTRAIN_PRECOMPILE", "1") != "0"


@dataclass(frozen=True)
class Job:
    """``run()`` compiles the kernels ``name`` describes; ``stage``: the part of the run that first launches them."""

    name: str
    stage: str
    run: Callable[[], Any]


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
        self.waited_s = 0.0  # how long the run waited for jobs
        self.closed = False
        self._started = time.perf_counter()

    def submit(self, jobs: Iterable[Job], *, last: bool = False) -> None:
        """Queue ``jobs``, those of earlier stages first; each starts as soon as a thread is free.

        ``last``: no more jobs will come, so each thread ends when the queue is empty (a trainer
        that is never stepped, and so never closes this, leaves no idle threads behind).
        """
        if self.closed:
            raise RuntimeError("this Precompiler is closed")
        jobs = list(jobs)
        for job in jobs:
            if job.stage not in STAGES:
                raise ValueError(f"job {job.name!r} has stage {job.stage!r}; expected one of {', '.join(STAGES)}")
        for job in sorted(jobs, key=lambda j: STAGES.index(j.stage)):
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
            log.warning("compiling %s ahead failed (%s: %s); it compiles at its first use instead", job.name,
                        type(exc).__name__, exc)  # fmt: skip
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
        log.info(
            "%d kernel jobs compiled ahead on %d threads in %.2f s (the run waited %.2f s for them)%s",
            len(self.done), self.workers, time.perf_counter() - self._started, self.waited_s,
            f"; {len(self.failed)} failed, compiled at first use: {', '.join(self.failed)}" if self.failed else "",
        )  # fmt: skip


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
    """Start compiling the dtype jobs of the run ``cfg`` describes, or None if it will not run on a GPU.

    :func:`mlptrain.run.train` calls this before ``get_backend``, which spends the next half second
    importing nvmath; the threads compile meanwhile (and create the CUDA context).
    """
    if getattr(cfg.device, "value", cfg.device) == "cpu" or not enabled() or importlib.util.find_spec("nvmath") is None:
        return None
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            return None
        from mlptrain.backend import Backend
        from mlptrain.precision import get_precision

        precision = get_precision(getattr(cfg.precision.name, "value", cfg.precision.name), Backend("gpu", cp))
    except Exception:  # no usable CuPy or driver: get_backend says what is missing
        return None
    return start(precision, resume=cfg.resume is not None)


def start(precision: Any, *, resume: bool = False) -> Precompiler | None:
    """A :class:`Precompiler` on the current device running :func:`dtype_jobs` (None when turned off)."""
    if not enabled():
        return None
    import cupy as cp

    pre = Precompiler(cp.cuda.runtime.getDevice())
    pre.submit(dtype_jobs(precision, resume=resume))
    return pre


# --- what to compile ---------------------------------------------------------------------------


def dtype_jobs(precision: Any, *, resume: bool = False) -> list[Job]:
    """The kernels that only the run's dtypes decide: :class:`~mlptrain.precision.Precision` ``precision``.

    The step's bookkeeping (step count, learning rate, loss scale) needs no kernel: it is copied
    from the host. The parameters' cast depends on the precision. ``resume``: a checkpoint's
    counters are set with ``a[...] = value``, which CuPy does with its fill kernel.
    """
    cdt, pdt = np.dtype(precision.compute_dtype), np.dtype(precision.param_dtype)
    jobs = [Job("mlptrain's header-free kernels: the batch gather, the inf/NaN flags (one module)", "batch", _plain)]
    if cdt != pdt:
        jobs.append(Job(f"cupy_copy {pdt.name} -> {cdt.name} (Param: the compute copy)", "setup",
                        functools.partial(_cast, pdt, cdt)))  # fmt: skip
    if resume:
        jobs.append(Job("cupy_fill int64 (StepClock.set)", "setup", functools.partial(_fill, np.int64)))
        if precision.loss_scaling:
            jobs.append(Job("cupy_fill int32, divide float64 (LossScaler.load_state_dict)", "setup", _scaler_state))
    return jobs


def batch_rows(loader: Any) -> list[int]:
    """The row counts of ``loader``'s batches, largest first: the batch size, and a short last batch."""
    n, b = loader.num_samples, loader.batch_size
    rows = {min(b, n)} if n else set()
    if n > b and n % b and not loader.drop_last:
        rows.add(n % b)
    return sorted(rows, reverse=True)


def step_jobs(tr: Any) -> list[Job]:
    """The kernels of the training step and of evaluation, planned from the built trainer ``tr``."""
    loaders = [tr.train_loader, *tr.eval_loaders.values()]
    cdt, outputs = np.dtype(tr.precision.compute_dtype), tr.widths[-1]
    rows = sorted({r for ld in loaders for r in batch_rows(ld)}, reverse=True)
    jobs = []
    if rows and rows[0] * outputs * 16 <= SCRATCH_LIMIT:  # logits, their gradient (and float32 copies)
        jobs.append(Job(f"{tr.head.loss_name} of {cdt.name} logits, {outputs} outputs, batches of "
                        f"{', '.join(map(str, rows))} rows", "loss", functools.partial(_losses, tr)))  # fmt: skip
    if tr.head.mode == "kernel":
        jobs.append(Job(f"mlptrain_head_dgrad ({outputs} classes, {cdt.name})", "loss", functools.partial(_head, tr)))
    opt = tr.optimizer
    state = sum(int(a.nbytes) for st in opt.state.values() for a in st.values())
    # the scratch copies _scratch_params makes: master, compute copy (if kept), gradient
    scratch = sum(int(p.value.nbytes) + (p.value.size * cdt.itemsize if p.has_compute_copy else 0)
                  + p.value.size * cdt.itemsize for p in opt.params)  # fmt: skip
    if scratch + state > SCRATCH_LIMIT:
        log.debug("the optimizer's kernel compiles at the first step: %d MiB of scratch", (scratch + state) >> 20)
        return jobs
    jobs.append(Job(f"mlptrain_{type(opt).__name__.lower()}_step (and the step log's tail)", "update",
                    functools.partial(_update, tr)))  # fmt: skip
    if tr.scaler.enabled:
        jobs.append(Job(f"mlptrain_check_nonfinite ({cdt.name} gradients)", "update", functools.partial(_check, tr)))
    return jobs


# --- the jobs: each the run's own call, on scratch arrays --------------------------------------


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


def _plain() -> None:
    """The header-free module (:mod:`mlptrain.gpu.plain_kernels`): no shapes or dtypes in its source."""
    from mlptrain.gpu.plain_kernels import function

    function("mlptrain_gather_1")  # the first function compiles the whole module


def _losses(tr: Any) -> None:
    """The step's loss (scaled; with the output bias gradient where the head takes it) and evaluation's."""
    import cupy as cp

    head, cdt, outputs = tr.head, tr.precision.compute_dtype, tr.widths[-1]
    scale = cp.zeros_like(tr.scaler.scale)
    for ld in [tr.train_loader, *tr.eval_loaders.values()]:
        for r in batch_rows(ld):
            logits, y = cp.zeros((r, outputs), cdt), cp.zeros((r, *ld.y.shape[1:]), ld.y.dtype)
            if ld is tr.train_loader:  # OutputHead.grads
                head.loss_fn(logits, y, scale, bias_grad=head.mode != "gemm")
            else:
                head.evaluate(logits, y)


def _head(tr: Any) -> None:
    """The head kernel (OutputHead.grads in mode ``kernel``) for each training batch size."""
    import cupy as cp

    from mlptrain.epilogs import relu_aux_shape
    from mlptrain.gpu.head_kernel import head_input_grad

    top, below = tr.model.layers[-1], tr.model.layers[-2]
    w = cp.zeros(top.weight.value.shape, tr.precision.compute_dtype)  # (C, H)
    for r in batch_rows(tr.train_loader):
        aux = cp.zeros(relu_aux_shape(w.shape[1], r)[::-1], cp.uint8).T  # (Mb, B) column-major, as RELU_AUX_BIAS
        head_input_grad(cp.zeros((r, w.shape[0]), w.dtype), w, aux, bias_grad_below=not below.bias_grad_in_wgrad)


def _scratch_params(tr: Any) -> list[Any]:
    """Copies of the parameters holding zeros, with zero gradients in the compute dtype (as the backward's)."""
    import cupy as cp

    out = []
    for p in tr.model.params:
        q = copy.copy(p)
        q.value = cp.zeros_like(p.value)
        q.compute = cp.zeros_like(p.compute) if p.has_compute_copy else q.value
        q.grad = cp.zeros(p.value.shape, tr.precision.compute_dtype)
        out.append(q)
    return out


def _update(tr: Any) -> None:
    """``Optimizer.step`` with the step log's tail, as the training step calls it, on copies holding zeros."""
    import cupy as cp

    lg = copy.copy(tr.log)
    lg._tail_code, lg._batch_size = {}, {}  # its own caches: the trainer's log is not touched
    loss_dtype = np.float64 if np.dtype(tr.precision.compute_dtype) == np.float64 else np.float32  # the loss's 0-d
    tail = lg.tail(cp.zeros((), loss_dtype), cp.zeros((), cp.int64), batch_rows(tr.train_loader)[0])
    # the tail's arrays are the run's state (metrics ring, loss scale, step count, lr): zeros instead
    tail = dataclasses.replace(tail, args=tuple(cp.zeros_like(a) for a in tail.args))
    opt = copy.copy(tr.optimizer)
    opt._kernels = {}  # its own kernel object (its own block counter); the run's finds the compiled code
    opt.params = _scratch_params(tr)
    opt.state = {name: {s: cp.zeros_like(a) for s, a in st.items()} for name, st in tr.optimizer.state.items()}
    opt.t = cp.zeros_like(opt.t)
    sc = tr.scaler
    opt.step(cp.zeros_like(tr.schedule.lr), cp.zeros_like(sc.inv_scale), cp.zeros_like(sc.found_inf), tail=tail)


def _check(tr: Any) -> None:
    """``LossScaler.check`` of the gradients (fp16), on a copy of the scaler with flags of its own."""
    import cupy as cp

    sc = copy.copy(tr.scaler)
    sc._check_kernel, sc._check_key = None, None
    sc.found_inf, sc._any_bad = cp.zeros_like(sc.found_inf), cp.zeros_like(sc._any_bad)
    sc.check([p.grad for p in _scratch_params(tr)])
