"""Timing helpers of the benchmarks: medians of CUDA-event times after warm-up, graph replays, and
how the tables print a time."""

from __future__ import annotations

import functools
import statistics
from typing import Any

from mlptrain.base.backend import get_backend

CHAIN = 20  # steps timed back to back for the steady-state figures


def median(times: Any) -> float:
    return statistics.median(times)


def rel_err(a: Any, b: Any) -> float:
    """max |a - b| / max |b| (in fp32), for checking a fused result against the naive one."""
    cp = get_backend("gpu").xp
    a, b = cp.asarray(a, dtype=cp.float32), cp.asarray(b, dtype=cp.float32)
    return float(cp.abs(a - b).max() / max(float(cp.abs(b).max()), 1e-30))


def graph_ms(fn: Any, reps: int) -> float:
    """GPU time of ``fn()`` in ms: run once (plans, workspaces, kernels), captured into a CUDA graph on a
    side stream, then replayed 10 at a time (median of ``reps``); host launch work does not count."""
    from mlptrain.base.cuda.timing import capture_graph, cuda_time_ms

    cp = get_backend("gpu").xp
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        graph, outputs = capture_graph(fn, stream)
        t = median(cuda_time_ms(functools.partial(graph.launch, stream), warmup=2, reps=reps, chain=10))
        stream.synchronize()
    del graph, outputs
    return t


def fmt(v: float | None, nd: int = 3) -> str:
    """A time (or any number) for the tables: ``nd`` decimals, ``-`` for None."""
    return "-" if v is None else f"{v:.{nd}f}"
