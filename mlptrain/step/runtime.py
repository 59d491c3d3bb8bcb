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

:class:`StepBatches` feeds the step its training batches on either: into the graph's input buffers, or
gathered by the replayed step itself, with the graphs of the epoch's other batch shapes captured ahead.

The precompile lifecycle is the same on both; the CPU simply has no precompiler. The trainer waits
for a stage's kernels before its first launch (:meth:`Runtime.wait`) and the threads are joined
before any CUDA graph is captured (:meth:`Runtime.finish_precompile`): after the first step, which
is never captured, before evaluation, and before the first step where autotuning times GEMMs in
graphs. Only the GPU's half touches CuPy, through the backend's ``xp``: this module imports none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mlptrain.base.backend import Backend

if TYPE_CHECKING:
    from mlptrain.data.loader import DataLoader
    from mlptrain.step.schedule import StepClock

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
            (:func:`mlptrain.step.cuda.precompile.start`) unless ``ahead`` is false.
        ahead: ``execution.precompile``: the kernels compile on threads ahead of their first launch.
        resume: the run resumes (CuPy's fill compiles ahead: a checkpoint's counters).
        graph: the step replayed as CUDA graphs (``graph=false``: launched op by op).
        autotune: see :class:`Runtime`.
    """

    queues_work = True

    def __init__(
        self, xp: Any, precision: Any, *, precompile: Any, ahead: bool, resume: bool, graph: bool, autotune: bool
    ) -> None:
        if precompile is None and ahead:  # the run's CuPy kernels compile on threads from here on
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
    backend: Backend,
    precision: Any,
    *,
    precompile: Any = None,
    ahead: bool = True,
    resume: bool,
    graph: bool,
    autotune: bool,
) -> Runtime:
    """The runtime of ``backend``: :class:`GpuRuntime` on the GPU, else :class:`Runtime` (a precompiler
    handed to a CPU run is not used: nothing compiles ahead on the CPU)."""
    if not backend.is_gpu:
        return Runtime(autotune=autotune)
    xp = backend.xp
    return GpuRuntime(xp, precision, precompile=precompile, ahead=ahead, resume=resume, graph=graph, autotune=autotune)


class StepBatches:
    """The training batches as the step takes them: into the CUDA graph's input buffers, gathered by the step
    itself, and the graphs of the epoch's other batch shapes captured ahead of their first batch.

    Where the step is a replayed CUDA graph of one process on a device-resident split (:attr:`gathers_in_step`),
    the loader gathers nothing: it puts the epoch's order on the device once, and each step's first kernels gather
    its batch into the graph's input buffers, reading the step count on the device
    (:meth:`~mlptrain.data.loader.DataLoader.gather_in_step`); data parallel ranks gather theirs as they did, and
    a host-resident split (``data.residency=host``) is gathered on the host and copied into the graph's buffers.
    Tests turn it on on the CPU.

    Args:
        runtime: the step's runtime, prepared (:meth:`Runtime.prepare`): its graphs, if any.
        loader: the training loader (:class:`~mlptrain.data.loader.DataLoader`).
        clock: the run's step counter (:class:`~mlptrain.step.schedule.StepClock`).
        data_parallel: this process is one rank of several.
    """

    def __init__(self, runtime: Runtime, loader: DataLoader, clock: StepClock, *, data_parallel: bool) -> None:
        self.runtime, self.loader, self.clock = runtime, loader, clock
        self.gathers_in_step = runtime.graphed is not None and not data_parallel and loader.resident
        self._own_batches: dict[int, tuple[Any, Any]] = {}  # rows -> the buffers such a step gathers into
        # Batch shapes whose graphs are captured ahead, once the first step's graph exists (epoch, capture_ahead).
        self._ahead: list[int] = []
        self._ahead_planned = False

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[Any, Any]]:
        """The training batches of ``epoch`` from ``start_batch``, as the loop steps through them.

        Where the step gathers its own batch (:attr:`gathers_in_step`), each is the graph's input buffers of its
        shape, the order placed on the device first (:meth:`~mlptrain.data.loader.DataLoader.place_order`):
        replaying a step is then one graph launch, the batch included. Otherwise the loader gathers each batch
        into the graph's buffers (or fresh arrays) before the step.
        """
        ld, graphed = self.loader, self.runtime.graphed
        if not self.gathers_in_step:
            if graphed is not None and not ld.resident and not self._ahead_planned:  # host-resident batches
                self._ahead_planned = True  # the other shapes are captured once the first one's graph exists
                first = next(ld.batch_rows(start_batch), None)
                self._ahead = [rows for rows in ld.row_counts() if rows != first]
            yield from ld.epoch(epoch, start_batch, out=self.buffers)
            return
        ld.place_order(epoch, start_batch, self.clock.n)
        if not self._own_batches and graphed is not None:  # the first epoch: every shape, the last captured ahead
            for rows in ld.row_counts():
                self._own_batches[rows] = self.buffers(rows, tag="gather") or ld.empty_batch(rows)
            self._ahead = [rows for rows in ld.row_counts() if rows != next(ld.batch_rows(start_batch), None)]
        for rows in ld.batch_rows(start_batch):
            if rows not in self._own_batches:
                self._own_batches[rows] = self.buffers(rows, tag="gather") or ld.empty_batch(rows)
            yield self._own_batches[rows]

    def gathers(self, x: Any) -> bool:
        """Whether the step on ``x`` gathers its own batch: ``x`` is a buffer :meth:`epoch` yields."""
        return any(own[0] is x for own in self._own_batches.values())  # (an ensemble's x is (K, B, F))

    def buffers(self, rows: int, tag: str | None = None) -> tuple[Any, Any] | None:
        """Where the loader should gather a training batch of ``rows``: the CUDA graph's input
        buffers for that shape (saves the step a copy), or None (fresh arrays) without a graph.
        ``tag``: the graphs of steps that gather their own batch (:meth:`epoch`) are others."""
        self.runtime.wait("batch")  # the loader gathers next
        return self.runtime.input_buffers(*self.loader.batch_spec(rows), tag)

    def ahead_due(self, x: Any, y: Any, tag: str | None) -> bool:
        """Whether, the step on ``x``, ``y`` just captured, other shapes wait to be captured ahead."""
        return bool(self._ahead) and self.runtime.graphed.captured(x, y, tag)

    def capture_ahead(self, batch_rows: Callable[[int], Any], forward_backward: StepFn) -> None:
        """Capture the graphs of the epoch's other batch shapes (the short last batch) now, before the loop
        meets them: one the first time inside the timed epochs cost the epoch it fell in a capture's time.

        No step is taken: each shape's warm-up is ``forward_backward`` alone on a batch gathered for it (it plans
        its GEMMs; :meth:`GraphedStep.precapture`), and the capture runs nothing. The update and the bookkeeping
        have run uncaptured in the first shape's warm-up steps; ``batch_rows(rows)`` makes the tail's batch size
        outside the capture.
        """
        ld, rows_now, graphed = self.loader, self._ahead, self.runtime.graphed
        self._ahead = []
        tag = "gather" if self.gathers_in_step else None  # a host-resident split fills the graph's own buffers
        for rows in rows_now:
            x, y = self._own_batches[rows] if tag else self.buffers(rows) or ld.empty_batch(rows)
            if graphed.captured(x, y, tag):
                continue
            batch_rows(rows)
            ld.sample_batch(x, y, self.clock.device)  # a valid batch to plan on
            graphed.precapture(x, y, lambda x=x, y=y: forward_backward(x, y), tag=tag)
