"""Timing GPU work with CUDA events, and recording it into a CUDA graph."""

from __future__ import annotations

import gc
from typing import Any

import cupy as cp


def cuda_time_ms(fn: Any, *, warmup: int = 3, reps: int = 10, stream: Any = None, chain: int = 1) -> list[float]:
    """Times of ``fn()`` in milliseconds per call, ``reps`` of them, each between two CUDA events.

    Runs ``warmup`` calls first (planning, workspace allocation, kernel compilation) and
    synchronises once before timing starts. Take the median of the result.

    ``chain=1`` times one call on an idle GPU: its latency, host launch work included. ``chain=N``
    times N calls back to back and divides by N: the steady state of a training loop, where the
    host queues the next step while the GPU runs this one.
    """
    stream = stream or cp.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    stream.synchronize()
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(chain):
            fn()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / chain)
    return times


def capture_graph(fn: Any, stream: Any) -> tuple[Any, Any]:
    """``(graph, fn's result)``: the kernels of ``fn()`` recorded, not run, on a non-default ``stream``.

    ``fn`` must have run once before (nvmath plans and allocates workspaces on its first
    execute, which must not happen during capture). Keep the result referenced while the graph
    is replayed: replays write into the arrays it holds. Cyclic garbage collection is paused
    during capture, so that no finaliser (an old nvmath plan's ``free()``) synchronises the device,
    which would invalidate the capture.
    """
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        stream.begin_capture()
        try:
            result = fn()
        finally:
            graph = stream.end_capture()
    finally:
        if gc_was_enabled:
            gc.enable()
    return graph, result


def stream_mark() -> Any:
    """A timing event recorded now on the current stream: the device's clock as it reaches this point."""
    mark = cp.cuda.Event()
    mark.record(cp.cuda.get_current_stream())
    return mark


def seconds_between(start: Any, end: Any) -> float:
    """Seconds from event ``start`` to event ``end`` on the device's clock (waits for ``end``)."""
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3
