"""A second CUDA stream for the work nothing downstream waits for: the weight gradients.

Layer ``l``'s two backward GEMMs both need only ``dZ_l``: the input gradient ``dZ_{l-1}`` (the
critical path: the layer below waits for it) and the weight gradient ``dW_l`` (nothing in the
backward waits for it; only the optimizer does). At the sizes where a step is latency-bound one
GEMM fills a fraction of the GPU, so :class:`mlptrain.nn.network.MLP` runs the weight gradients here
while the main stream goes on down the chain::

    main:  loss ─┬─ dX (layer 2, DRELU_BGRAD) ─┬─ dX (layer 1, DRELU) ── dW (layer 0) ─┬─ check, update
    side:        └─ dW (layer 2) ──────────────┴─ dW (layer 1) ─────────────────────────┘

An event recorded on the main stream when ``dZ_l`` is ready orders the side stream's work after
it (:meth:`SideStream.run`); one event at the end joins the side stream back before the optimizer
(:meth:`SideStream.join`). A CUDA graph capture records the same fork and join as edges between
parallel branches.

Memory: CuPy's pool gives each stream its own free lists. ``dZ_l`` and the saved input ``X_l``
are allocated on the main stream and read by the side stream, so they stay referenced until the
main stream has waited for the side GEMM that reads them (:meth:`SideStream.retire`, an event
recorded after that GEMM; with two streams the network retires layer ``l`` once the input
gradient of the layer below is enqueued) or until the join; otherwise the main stream could reuse
their memory while the side GEMM still reads it.

The side stream's GEMM results (the weight gradients) are allocated from the main stream's free
lists too (:meth:`SideStream.allocating_on_main`): a pool reserves memory per stream, so gradients
drawn from the side stream's lists would sit beside the main stream's peak instead of in the
blocks the main stream has freed by then (docs/benchmarks.md, "Memory"). It is safe because every
side-stream GEMM waits for the main stream's work enqueued before its fork, which includes every
earlier user of a block the main stream freed; and the side stream's results are read only after
the join (by the optimizer, on the main stream), and freed at the next step's start, when their
blocks go back to the main stream's lists behind that optimizer launch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import cupy as cp

_local = threading.local()  # the allocator of GEMM results inside SideStream.allocating_on_main


def results_allocator() -> Callable[[int], Any] | None:
    """Where GEMM results go: the main stream's free lists inside :meth:`SideStream.allocating_on_main`, else
    None (CuPy's current allocator on the current stream)."""
    return getattr(_local, "results", None)


def result_array(size: int, dtype: Any) -> Any:
    """``cupy.empty(size, dtype)`` where a result goes (:func:`results_allocator`): for what a kernel returns after
    a GEMM, never for its scratch, which is freed while its stream may still read it and so must stay in that
    stream's own free lists."""
    results = results_allocator()
    if results is None:
        return cp.empty(size, dtype=dtype)
    with cp.cuda.using_allocator(results):
        return cp.empty(size, dtype=dtype)


class SideStream:
    """Work forked off the current stream and joined back; ``forks`` events, one per fork point."""

    def __init__(self, forks: int) -> None:
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._forks = [cp.cuda.Event(disable_timing=True) for _ in range(forks)]
        self._done = [cp.cuda.Event(disable_timing=True) for _ in range(forks)]
        self._join = cp.cuda.Event(disable_timing=True)
        self._reads: dict[int, Any] = {}  # what the side stream reads, by fork: alive until retired or joined
        self._main: Any = None

    def run(self, fork: int, fn: Callable[[], None], reads: Any, then: Callable[[], None] | None = None) -> None:
        """Run ``fn`` on the side stream after the current stream's work so far (``reads``: its input).

        ``then`` runs on the side stream after ``fn``, outside what :meth:`retire` waits for (data
        parallel: the all-reduce of the gradient ``fn`` made, which must not hold up the main stream's
        frees)."""
        main = cp.cuda.get_current_stream()
        if self._main is None:
            self._main = main
        event = self._forks[fork]
        event.record(main)
        self.stream.wait_event(event)
        with self.stream:  # nvmath and CuPy enqueue (and allocate) on the current stream
            fn()
            self._done[fork].record(self.stream)
            if then is not None:
                then()
        self._reads[fork] = reads

    @contextlib.contextmanager
    def allocating_on_main(self) -> Iterator[None]:
        """Within :meth:`run`: the GEMMs' results come from the main stream's free lists (module docstring).

        Only the results nvmath allocates (:func:`results_allocator`, consulted by
        :class:`mlptrain.nn.cuda.gemm.NvmathGemm` around ``execute``): they outlive the side stream's
        work. A temporary freed while the side stream may still use it (a CuPy reduction's
        scratch) would return to the main stream's lists unordered, so everything else keeps
        the side stream's own."""
        malloc, main = cp.cuda.get_allocator(), self._main

        def from_main(size: int) -> Any:
            with main:  # the pool keys its free lists by the current stream
                return malloc(size)

        _local.results = from_main
        try:
            yield
        finally:
            _local.results = None

    def retire(self, fork: int) -> None:
        """Make the main stream wait for the work forked at ``fork`` (if it was): its reads may go."""
        if self._reads.pop(fork, None) is not None:
            self._main.wait_event(self._done[fork])

    def join(self) -> None:
        """Make the current stream wait for everything run on the side stream."""
        if self._main is None:
            return
        self._join.record(self.stream)
        self._main.wait_event(self._join)  # the optimizer sees every gradient; the reads may go now
        self._reads.clear()
        self._main = None
