"""The whole training step as one CUDA graph.

A small MLP's step is dominated by host work: every nvmath ``execute()`` costs tens of
microseconds of Python and every CuPy kernel launch several, while the GPU finishes the kernels
sooner. A CUDA graph records the step's kernels once (forward GEMMs with their epilogs, the
loss, the backward GEMMs, the overflow check, the optimizer and the loss-scale update) and
replays them with one launch.

What makes the step capturable (nvmath-notes §6):

* Every per-step scalar lives in device memory: the learning rate comes from a device step
  counter (:class:`mlptrain.step.optim.LRSchedule`), the loss scale and the skip flag from
  :class:`mlptrain.step.precision.LossScaler`, Adam's step count from the optimizer. Nothing the
  host computes per step is baked into the graph.
* The first ``warmup`` steps of each batch shape run uncaptured (they are ordinary training
  steps): nvmath plans and allocates its workspaces, CuPy compiles its kernels.
* The graph reads its batch from static buffers (``x_static``, ``y_static``). The training loop's
  loader gathers each batch straight into them (:meth:`GraphedStep.input_buffers`); a batch
  that lives elsewhere is copied in before the replay.
* The per-step metrics are written by the step itself into a device ring
  (:class:`mlptrain.step.steplog.StepLog`), so replaying needs no host work beyond the launch.
* Everything the step allocates, from the warm-up on, comes from a private CuPy memory pool,
  one per graph. Arrays freed during capture return to that pool, whose blocks nothing outside
  the graph is handed afterwards, so replays never write into memory someone else owns.
* Python's cyclic garbage collector is paused during capture, so no finaliser can make a call
  (a device synchronisation) that is illegal while a stream is being captured.
* The arrays the captured step produced and left alive (the gradients, the loss) stay referenced
  here: the step's owner hands over a ``keep`` function that gathers them after the capture and a
  ``restore`` function that re-attaches them after each replay, so host code (checks,
  checkpoints) sees what the graph wrote. What the step freed on the way (activations, masks,
  their gradients: the backward lets each go once read) is memory of the pool that the graph's
  later kernels reuse, in the order the capture recorded.

One graph per batch shape: the last, smaller batch of an epoch gets its own. Replay runs the
same kernels on the same operands as the uncaptured step, so losses and parameters agree bit
for bit (tests/gpu/test_graph_gpu.py). :class:`GraphedStep` knows nothing of training: it
replays any function ``step(x, y) -> result`` of two device arrays.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import cupy as cp
import numpy as np

from mlptrain.base.cuda.timing import capture_graph

log = logging.getLogger(__name__)

StepFn = Callable[[Any, Any], Any]


class _ShapeGraph:
    """Warm-up count, private pool, and (once captured) the graph of one batch shape."""

    def __init__(self) -> None:
        self.pool = cp.cuda.MemoryPool()
        self.warm = 0
        self.graph: Any = None
        self.x_static: Any = None  # (B, in), C-order, compute dtype: the batch the graph reads
        self.y_static: Any = None  # (B,)
        self.result: Any = None  # what the captured step returned (device arrays the replays rewrite)
        self.kept: Any = None  # what the step's owner asked to keep (keep())

    def buffers(self, x_shape: tuple, x_dtype: Any, y_shape: tuple, y_dtype: Any) -> tuple[Any, Any]:
        if self.x_static is None:
            self.x_static = cp.empty(x_shape, dtype=x_dtype)
            self.y_static = cp.empty(y_shape, dtype=y_dtype)
        return self.x_static, self.y_static

    def capture(self, step: StepFn, keep: Callable[[], Any], x: Any, y: Any) -> None:
        self.buffers(x.shape, x.dtype, y.shape, y.dtype)
        stream = cp.cuda.get_current_stream()
        with cp.cuda.using_allocator(self.pool.malloc):
            self.graph, self.result = capture_graph(lambda: step(self.x_static, self.y_static), stream)
        self.graph.upload(stream)
        self.kept = keep()

    def replay(self, x: Any, y: Any, stream: Any) -> None:
        # The batch, into the buffers the graph reads: two cudaMemcpyAsync (no kernel to launch),
        # unless the loader gathered it there already (GraphedStep.input_buffers).
        for dst, src in ((self.x_static, x), (self.y_static, y)):
            if src.data.ptr == dst.data.ptr:
                continue
            if not src.flags.c_contiguous:
                src = cp.ascontiguousarray(src)
            dst.data.copy_from_device_async(src.data, src.nbytes, stream)
        self.graph.launch(stream)


class GraphedStep:
    """Runs ``step(x, y)`` as a replayed CUDA graph, one graph per batch shape.

    Call it on a non-default CuPy stream, the same one every time (``with trainer.stream:``):
    CUDA cannot capture the legacy default stream, so there the steps simply run uncaptured.

    Args:
        step: the work of one step on device arrays ``x (B, in)``, ``y (B,)``; it returns device
            arrays (the replays rewrite them in place, so the same objects come back every replay).
            It must allocate nothing that outlives it except what it returns or hands to ``keep``.
        keep: called after a capture; its result is what the captured step left behind for others
            to read (the gradients), kept alive with the graph.
        restore: called with ``keep()``'s result after every replay of that graph.
        release: called before every uncaptured warm-up step and before the capture: drops what
            the previous step left behind (gradients, saved inputs), so that the step does not
            allocate its arrays while the last step's are still alive (two copies in the pool).
        warmup: uncaptured steps of each shape before it is captured (at least 1: nvmath's first
            execute allocates its workspace, which must not happen during capture).
    """

    def __init__(
        self,
        step: StepFn,
        *,
        keep: Callable[[], Any] = lambda: None,
        restore: Callable[[Any], None] = lambda kept: None,
        release: Callable[[], None] = lambda: None,
        warmup: int = 2,
    ) -> None:
        if warmup < 1:
            raise ValueError(f"warmup={warmup}: at least one uncaptured step must precede a capture")
        self.step = step
        self.keep = keep
        self.restore = restore
        self.release = release
        self.warmup = warmup
        self._shapes: dict[tuple, _ShapeGraph] = {}
        self._warned = False

    def __call__(self, x: Any, y: Any, tag: str | None = None) -> Any:
        """One step on batch ``x (B, in)``, ``y (B,)``; returns what ``step`` returns.

        ``tag``: steps that differ in more than their batch shape (a step that gathers its own batch into
        ``x`` and ``y``: ``"gather"``) get graphs of their own."""
        stream = cp.cuda.get_current_stream()
        if stream.ptr == 0:
            if not self._warned:
                log.warning("the legacy default stream cannot be captured: running the step without a CUDA graph")
                self._warned = True
            return self.step(x, y)
        key = (x.shape, x.dtype, y.shape, y.dtype, tag)  # (a replay's host work is a few dict look-ups)
        g = self._shapes.get(key)
        if g is None:
            g = self._shapes[key] = _ShapeGraph()
        if g.graph is None:
            self.release()
            if g.warm < self.warmup:
                g.warm += 1
                with cp.cuda.using_allocator(g.pool.malloc):
                    return self.step(x, y)
            log.info("capturing the training step for batch shape %s into a CUDA graph", x.shape)
            g.capture(self.step, self.keep, x, y)
        g.replay(x, y, stream)
        self.restore(g.kept)
        return g.result

    def captured(self, x: Any, y: Any, tag: str | None = None) -> bool:
        """Whether the step on batches shaped as ``x``, ``y`` (and ``tag``) has its graph."""
        g = self._shapes.get((x.shape, x.dtype, y.shape, y.dtype, tag))
        return g is not None and g.graph is not None

    def precapture(self, x: Any, y: Any, warm: Callable[[], Any], tag: str | None = None) -> None:
        """Capture the step of this batch shape now, without running it: no step is taken.

        ``warm()`` stands in for the uncaptured warm-up steps: the work of the step that plans for the batch
        shape (its GEMMs: nvmath plans and allocates on a first execute, which must not happen in a capture)
        and changes no state of the run (the forward and backward; the update is left out). It runs
        ``warmup`` times in the shape's pool, as warm-up steps would. Everything else the step runs must
        have run before, uncaptured: call this once another shape's graph exists.
        """
        key = (x.shape, x.dtype, y.shape, y.dtype, tag)
        g = self._shapes.get(key)
        if g is None:
            g = self._shapes[key] = _ShapeGraph()
        if g.graph is not None:
            return
        for _ in range(self.warmup):
            self.release()
            with cp.cuda.using_allocator(g.pool.malloc):
                warm()
        self.release()
        log.info("capturing the training step for batch shape %s into a CUDA graph (ahead of its first step)", x.shape)
        g.capture(self.step, self.keep, x, y)
        g.warm = self.warmup

    def input_buffers(
        self, x_shape: tuple, x_dtype: Any, y_shape: tuple, y_dtype: Any, tag: str | None = None
    ) -> tuple[Any, Any]:
        """The arrays the graph of this batch shape reads its batch from (created on first request).

        A loader that gathers each batch into them (``DataLoader.epoch(out=...)``) spares the step
        its copy: steps given these very arrays skip it. Their contents change with every batch.
        """
        key = (tuple(x_shape), np.dtype(x_dtype), tuple(y_shape), np.dtype(y_dtype), tag)
        if key not in self._shapes:
            self._shapes[key] = _ShapeGraph()
        return self._shapes[key].buffers(x_shape, x_dtype, y_shape, y_dtype)

    @property
    def num_graphs(self) -> int:
        return sum(g.graph is not None for g in self._shapes.values())

    def graphs(self) -> dict[tuple, Any]:
        """The captured graphs by batch shape ``x.shape``, in capture order."""
        return {k[0]: g.graph for k, g in self._shapes.items() if g.graph is not None}

    def pool_bytes(self) -> int:
        """Bytes held by the graphs' private memory pools."""
        return sum(g.pool.total_bytes() for g in self._shapes.values())

    def pool_used_bytes(self) -> int:
        """Bytes of the graphs' private memory pools that arrays use now."""
        return sum(int(g.pool.used_bytes()) for g in self._shapes.values())

    def input_arrays(self) -> list[Any]:
        """The batch buffers the graphs read (``x_static``, ``y_static`` of each; None where not made yet)."""
        return [a for g in self._shapes.values() for a in (g.x_static, g.y_static)]

    def kernel_names(self, shape: tuple | None = None) -> list[str]:
        """The kernels one replay runs, in capture order (``shape``: the batch shape; default the first captured)."""
        graphs = self.graphs()
        if not graphs:
            raise RuntimeError("no graph has been captured yet: run at least warmup + 1 steps")
        graph = graphs[shape] if shape is not None else next(iter(graphs.values()))
        return kernel_names(graph)


# A node of cudaGraphDebugDotPrint's output: kernels are octagons labelled "<id>\n<function name>",
# memsets and memcpys are other shapes labelled "<id>\nMEMSET" or "<id>\nMEMCPY".
_DOT_NODE = re.compile(r'shape="(\w+)"\s*label="\d+\n([^\n"]+)')


def kernel_names(graph: Any) -> list[str]:
    """The nodes of a captured CuPy graph, in capture order, from its DOT dump.

    Kernel nodes by function name (cuBLASLt's are C++, often mangled; CuPy's and mlptrain's are
    ``extern "C"``, so ``mlptrain_sgd_step`` reads as written), memset and memcpy nodes as
    ``MEMSET`` and ``MEMCPY``.
    """
    return [name.strip() for _, name in _DOT_NODE.findall(graph.debug_dot_str())]
