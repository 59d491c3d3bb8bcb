"""Host arrays copied to the device through pinned memory: chunks of rows, two staging buffers in flight.

``cupy.array(host)`` of a pageable NumPy array copies at about 1 GB/s: the driver stages it through a
pinned buffer of its own, one piece at a time, and the host waits for each. :func:`to_device` does
the staging itself: the host casts a chunk of rows (:data:`CHUNK_BYTES`) into one of two pinned
buffers while the device copies the other out of the previous chunk's buffer (``cudaMemcpyAsync``
on a stream of its own), so the cast, the host's copy and the DMA overlap, and the host array is
never copied whole (no ``np.array(x, dtype)`` of the table first).

The host half (:func:`plan`, :func:`copy_in_chunks`) is plain NumPy, so the CPU tests run it with
NumPy buffers (``tests/test_loader.py``); CuPy is imported by :func:`to_device` alone, which
``tests/gpu/test_upload.py`` holds to ``cupy.asarray`` byte for byte.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

CHUNK_BYTES = 64 << 20  # a staging buffer: large enough that a copy's launch costs nothing beside it
FILL_THREADS = 4  # host threads casting a chunk into its buffer (NumPy releases the GIL in copyto)


def plan(rows: int, row_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(rows)``: chunks of at most ``chunk_bytes`` (at least one row).

    Args:
        rows: ``N``, the array's length.
        row_bytes: Bytes of one row in the device dtype (``prod(shape[1:]) * itemsize``).
        chunk_bytes: The staging buffer's size; a row larger than it gets a chunk of its own.
    """
    if rows < 0 or row_bytes < 0 or chunk_bytes < 1:
        raise ValueError(f"plan(rows={rows}, row_bytes={row_bytes}, chunk_bytes={chunk_bytes}): expected sizes >= 0")
    step = max(1, chunk_bytes // max(1, row_bytes))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def copy_in_chunks(
    x: np.ndarray,
    parts: Sequence[tuple[int, int]],
    buffers: Sequence[np.ndarray],
    wait: Callable[[int], None],
    send: Callable[[int, np.ndarray, int, int], None],
    fill: Callable[[np.ndarray, np.ndarray], None] | None = None,
) -> None:
    """The host half of the pipeline: each chunk's rows of ``x`` cast into a staging buffer, then sent.

    Chunk ``i`` uses buffer ``k = i % len(buffers)``: ``wait(k)`` returns once the copy that last read
    buffer ``k`` is done, the rows ``x[a:b]`` (any layout: a view, Fortran order, a memory map) are
    cast into ``buffers[k][: b - a]``, and ``send(k, staged, a, b)`` queues their copy to ``out[a:b]``
    and returns at once, so the next chunk is cast while this one travels.

    Args:
        x: ``(N, ...)`` host array.
        parts: :func:`plan`'s row ranges.
        buffers: ``(rows, ...)`` C-contiguous arrays of the device dtype, ``rows`` the largest part.
        wait, send: as above (NumPy stand-ins in the CPU tests).
        fill: ``fill(dest, src)`` casts ``src`` into ``dest`` (default ``np.copyto`` with unsafe casting,
            what ``x.astype(dtype)`` does).
    """
    fill = fill or (lambda dest, src: np.copyto(dest, src, casting="unsafe"))
    for i, (a, b) in enumerate(parts):
        k = i % len(buffers)
        wait(k)
        staged = buffers[k][: b - a]  # (b - a, ...) a view of the pinned buffer
        fill(staged, x[a:b])
        send(k, staged, a, b)


def _threaded_fill(pool: ThreadPoolExecutor | None, threads: int) -> Callable[[np.ndarray, np.ndarray], None]:
    """``np.copyto(dest, src)`` split by rows over ``threads`` threads of ``pool`` (inline without one)."""

    def fill(dest: np.ndarray, src: np.ndarray) -> None:
        if pool is None or len(dest) < 2 * threads:
            np.copyto(dest, src, casting="unsafe")
            return
        step = -(-len(dest) // threads)
        cuts = [(a, min(a + step, len(dest))) for a in range(0, len(dest), step)]
        list(pool.map(lambda c: np.copyto(dest[c[0] : c[1]], src[c[0] : c[1]], casting="unsafe"), cuts))

    return fill


def to_device(x: Any, dtype: Any, chunk_bytes: int = CHUNK_BYTES) -> Any:
    """A C-contiguous CuPy copy of the host array ``x (N, ...)`` in ``dtype``, equal to
    ``cupy.asarray(np.array(x, dtype=dtype, order="C"))`` byte for byte.

    The copies run on a stream of this call's own, which first waits for the work queued on the
    current stream (the memory pool may hand out a block that work last used); the call returns
    once every byte is on the device (``stream.synchronize()``: a host sync), so any stream may
    read the result.
    """
    import cupy as cp

    x, dtype = np.asarray(x), np.dtype(dtype)
    out = cp.empty(x.shape, dtype)  # (N, ...) C order
    if out.size == 0:
        return out
    row_items = math.prod(x.shape[1:])
    parts = plan(len(x), row_items * dtype.itemsize, chunk_bytes)
    rows = max(b - a for a, b in parts)
    count = min(2, len(parts))
    pinned = [cp.cuda.alloc_pinned_memory(rows * row_items * dtype.itemsize) for _ in range(count)]
    buffers = [np.frombuffer(m, dtype, rows * row_items).reshape(rows, *x.shape[1:]) for m in pinned]
    stream = cp.cuda.Stream(non_blocking=True)
    stream.wait_event(cp.cuda.get_current_stream().record())
    done: list[Any] = [None] * count  # the event after the copy that last read each buffer

    def wait(k: int) -> None:
        if done[k] is not None:
            done[k].synchronize()

    def send(k: int, staged: np.ndarray, a: int, b: int) -> None:
        out[a:b].set(staged, stream=stream)  # from pinned memory: cudaMemcpyAsync, the host goes on
        done[k] = stream.record()

    threads = min(FILL_THREADS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="mlptrain-upload") if threads > 1 else None
    try:
        copy_in_chunks(x, parts, buffers, wait, send, _threaded_fill(pool, threads))
    finally:
        stream.synchronize()  # the staging buffers are read until here (also when a cast failed)
        if pool is not None:
            pool.shutdown()
    return out
