"""A second CUDA stream for the work nothing downstream waits for: the weight gradients.

Layer ``l``'s two backward GEMMs both need only ``dZ_l``: the input gradient ``dZ_{l-1}`` (the
critical path: the layer below waits for it) and the weight gradient ``dW_l`` (nothing in the
backward waits for it; only the optimizer does). At the sizes where a step is latency-bound one
GEMM fills a fraction of the GPU, so :class:`mlptrain.network.MLP` runs the weight gradients here
while the main stream goes on down the chain::

    main:  loss ─┬─ dX (layer 2, DRELU_BGRAD) ─┬─ dX (layer 1, DRELU) ── dW (layer 0) ─┬─ check, update
    side:        └─ dW (layer 2) ──────────────┴─ dW (layer 1) ─────────────────────────┘

An event recorded on the main stream when ``dZ_l`` is ready orders the side stream's work after
it (:meth:`SideStream.run`); one event at the end joins the side stream back before the optimizer
(:meth:`SideStream.join`). A CUDA graph capture records the same fork and join as edges between
parallel branches.

Memory: CuPy's pool gives each stream its own free lists. ``dZ_l`` is allocated on the main
stream and read by the side stream, so it stays referenced until the join is enqueued; otherwise
the main stream could reuse its memory while the side GEMM still reads it. The gradients the side
stream allocates are read by the optimizer after the join, and the side stream reuses their memory
only after the next step's first fork, which comes after that optimizer launch on the main stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cupy as cp


class SideStream:
    """Work forked off the current stream and joined back; ``forks`` events, one per fork point."""

    def __init__(self, forks: int) -> None:
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._forks = [cp.cuda.Event(disable_timing=True) for _ in range(forks)]
        self._join = cp.cuda.Event(disable_timing=True)
        self._reads: list[Any] = []  # what the side stream reads: alive until the join is enqueued
        self._main: Any = None

    def run(self, fork: int, fn: Callable[[], None], reads: Any) -> None:
        """Run ``fn`` on the side stream after the current stream's work so far (``reads``: its input)."""
        main = cp.cuda.get_current_stream()
        if self._main is None:
            self._main = main
        event = self._forks[fork]
        event.record(main)
        self.stream.wait_event(event)
        with self.stream:  # nvmath and CuPy enqueue (and allocate) on the current stream
            fn()
        self._reads.append(reads)

    def join(self) -> None:
        """Make the current stream wait for everything run on the side stream."""
        if self._main is None:
            return
        self._join.record(self.stream)
        self._main.wait_event(self._join)  # the optimizer sees every gradient; the reads may go now
        self._reads.clear()
        self._main = None
