"""The device runtime: what the step needs of the device, apart from the step (issue #29).

The trainer is the step and its state (:mod:`mlptrain.step.trainer`). Where the step runs is this
module's: the stream the training loop runs on, the step's CUDA graphs (capture and replay,
:mod:`mlptrain.step.cuda.graph`), the memory pools and their high-water mark (:mod:`mlptrain.step.cuda.memory`),
the weight gradients' second stream, and the lifecycle of the kernels compiling ahead
(:mod:`mlptrain.step.cuda.precompile`). :func:`device_runtime` picks one for the backend:

* :class:`Runtime`, the CPU's, does nothing: no stream (a context that does nothing), no graph, no
  pool, no precompiler; :meth:`Runtime.step` releases the last step's arrays and launches the step.
* :class:`GpuRuntime`, the GPU's: a non-blocking stream (graph capture needs one), a
  :class:`~mlptrain.step.cuda.graph.GraphedStep` (unless ``graph=false``), a
  :class:`~mlptrain.step.cuda.memory.PeakTracker`, and the precompiler the run started (or its own).

The precompile lifecycle is the same on both; the CPU simply has no precompiler. The trainer waits
for a stage's kernels before its first launch (:meth:`Runtime.wait`) and the threads are joined
before any CUDA graph is captured (:meth:`Runtime.finish_precompile`): after the first step, which
is never captured, before evaluation, and before the first step where autotuning times GEMMs in
graphs. Only the GPU's half touches CuPy, through the backend's ``xp``: this module imports none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from mlptrain.base.backend import Backend

StepFn = Callable[[Any, Any], Any]


class Runtime:
    """Where the step runs on the CPU: nowhere special (and the base of :class:`GpuRuntime`).

    Args:
        precompile: the kernels compiling ahead (a :class:`~mlptrain.step.cuda.precompile.Precompiler`), or None.
        autotune: ``execution.autotune``: the threads are joined before the first step (autotuning
            captures GEMM candidates in CUDA graphs while it plans them).

    Attributes: ``stream`` (what the training loop runs inside: ``with runtime.stream:``), ``graphed``
    (the step's CUDA graphs, or None), ``memory_peak`` (the pools' high-water mark, or None) and
    ``precompile`` (None once joined).
    """

    # Whether work is queued on a device that runs ahead of the host (the loop then reads its records late).
    queues_work = False

    def __init__(self, precompile: Any = None, *, autotune: bool = False) -> None:
        self.stream: Any = contextlib.nullcontext()
        self.graphed: Any = None
        self.memory_peak: Any = None
        self.precompile = precompile
        self.autotune = autotune
        self._launch: StepFn | None = None
        self._release: Callable[[], None] = lambda: None

    # --- the step ---------------------------------------------------------------------------

    def prepare(
        self, launch: StepFn, *, keep: Callable[[], Any], restore: Callable[[Any], None], release: Callable[[], None]
    ) -> None:
        """Run the built step ``launch(x, y)``: ``release()`` drops what the last step left before the next
        allocates; on the GPU ``keep`` and ``restore`` carry what a captured step left (:class:`GraphedStep`)."""
        self._launch, self._release = launch, release

    def step(self, x: Any, y: Any, tag: str | None = None) -> Any:
        """One step on the batch ``x``, ``y``: what ``launch`` returns (``tag``: a graph of its own, GPU)."""
        if self.autotune:
            self.finish_precompile()  # autotune times GEMM candidates in CUDA graphs while it plans them
        out = self._run(x, y, tag)
        self.finish_precompile()  # that was the first step, never captured: every capture comes later
        return out

    def _run(self, x: Any, y: Any, tag: str | None) -> Any:
        if self._launch is None:
            raise RuntimeError("Runtime.step before Runtime.prepare")
        self._release()  # the last step's arrays go before this step allocates its own
        return self._launch(x, y)

    def input_buffers(
        self, x_shape: tuple, x_dtype: Any, y_shape: tuple, y_dtype: Any, tag: str | None = None
    ) -> tuple[Any, Any] | None:
        """Where a batch of these shapes should be gathered: the CUDA graph's inputs, or None (fresh arrays)."""
        if self.graphed is None:
            return None
        return self.graphed.input_buffers(x_shape, x_dtype, y_shape, y_dtype, tag=tag)

    # --- streams and pools ------------------------------------------------------------------

    def wgrad_stream(self, model: Any, wanted: bool) -> None:
        """The weight-gradient GEMMs on a second stream, concurrent with the dX chain (GPU): one stream here."""

    def free_setup_blocks(self) -> None:
        """Return the blocks set-up freed (the probe's, the weights' init temporaries) to the device (GPU)."""

    # --- kernels compiled ahead (mlptrain.step.cuda.precompile) -----------------------------------

    def submit_precompile(self, jobs: Callable[[], list[Any]]) -> None:
        """Queue the last jobs, ``jobs()`` (called only if kernels are compiling ahead)."""
        if self.precompile is not None:
            self.precompile.submit(jobs(), last=True)

    def wait(self, stage: str | None = None) -> None:
        """Wait for the kernels of ``stage`` (None: all) compiling ahead: before their first launch."""
        if self.precompile is not None:
            self.precompile.wait(stage)

    def finish_precompile(self) -> None:
        """Wait for every kernel compiling ahead and end the threads, before any capture (a second call: nothing)."""
        pre, self.precompile = self.precompile, None
        if pre is not None:
            pre.close()


class GpuRuntime(Runtime):
    """Where the step runs on the GPU: a stream of its own, CUDA graphs, pools, the kernels compiling ahead.

    Args:
        xp: CuPy (the backend's ``xp``).
        precision: the run's :class:`~mlptrain.step.precision.Precision` (the kernels its dtypes decide).
        precompile: the precompiler :func:`mlptrain.run.run.train` started; by default this starts one
            (:func:`mlptrain.step.cuda.precompile.start`; None where ``MLPTRAIN_PRECOMPILE=0``).
        resume: the run resumes (CuPy's fill compiles ahead: a checkpoint's counters).
        graph: the step replayed as CUDA graphs (``graph=false``: launched op by op).
        autotune: see :class:`Runtime`.
    """

    queues_work = True

    def __init__(self, xp: Any, precision: Any, *, precompile: Any, resume: bool, graph: bool, autotune: bool) -> None:
        if precompile is None:  # the run's CuPy kernels compile on threads from here on
            from mlptrain.step.cuda.precompile import start

            precompile = start(precision, resume=resume)
        super().__init__(precompile, autotune=autotune)
        self.xp = xp
        self.graph = graph

    def prepare(
        self, launch: StepFn, *, keep: Callable[[], Any], restore: Callable[[Any], None], release: Callable[[], None]
    ) -> None:
        """A non-blocking CUDA stream for the training loop (graph capture needs one), the pools'
        high-water mark, and the step's CUDA graphs."""
        from mlptrain.step.cuda.memory import PeakTracker

        super().prepare(launch, keep=keep, restore=restore, release=release)
        xp = self.xp
        xp.cuda.Device().synchronize()  # set-up work on the default stream is done
        self.stream = xp.cuda.Stream(non_blocking=True)
        self.memory_peak = PeakTracker(lambda: self.graphed.pool_bytes() if self.graphed is not None else 0)
        if self.graph:
            from mlptrain.step.cuda.graph import GraphedStep

            self.graphed = GraphedStep(launch, keep=keep, restore=restore, release=release)

    def _run(self, x: Any, y: Any, tag: str | None) -> Any:
        if self.graphed is not None:
            return self.graphed(x, y, tag=tag)
        return super()._run(x, y, tag)

    def wgrad_stream(self, model: Any, wanted: bool) -> None:
        if wanted:
            model.use_wgrad_stream()  # dW GEMMs concurrent with the dX chain

    def free_setup_blocks(self) -> None:
        self.xp.get_default_memory_pool().free_all_blocks()  # the step allocates from its own pool


def device_runtime(
    backend: Backend, precision: Any, *, precompile: Any = None, resume: bool, graph: bool, autotune: bool
) -> Runtime:
    """The runtime of ``backend``: :class:`GpuRuntime` on the GPU, else :class:`Runtime` (a precompiler
    handed to a CPU run is not used: nothing compiles ahead on the CPU)."""
    if not backend.is_gpu:
        return Runtime(autotune=autotune)
    return GpuRuntime(backend.xp, precision, precompile=precompile, resume=resume, graph=graph, autotune=autotune)
