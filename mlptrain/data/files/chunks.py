"""A table in row chunks, several at once: the passes of the data path at memory speed.

A pass over a large table (the statistics, the finiteness check, the gather and cast of a split,
the cache's checksum) goes through it in chunks of a few MB, each small enough to stay in the CPU's
cache while it is cast and reduced, so no temporary the size of the table is made. NumPy releases
the GIL inside its loops, so chunks run on a pool of threads (one per core this process may use).

:func:`gather_normalised` writes a split straight into its float32 array: ``(x[rows] - shift) *
(1 / scale)`` chunk by chunk, in float64 and rounded once (:func:`normalise_into`, the arithmetic of
:meth:`mlptrain.data.Normalization.apply`, so the same bits) without the raw split or the normalised
table ever held whole.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import numpy as np

log = logging.getLogger(__name__)
T = TypeVar("T")
Mapping = Callable[[np.ndarray], np.ndarray]  # maps columns of a float64 (n, F) block in place before the shift
CHUNK_BYTES = 4 << 20  # a chunk's float64 copy: fits the cache beside its inputs


def threads() -> int:
    """The cores this process may run on (the pool's size)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def chunk_rows(columns: int, chunk: int | None = None) -> int:
    """Rows per chunk: ``chunk`` if given, else as many as make :data:`CHUNK_BYTES` of float64."""
    return max(1, chunk if chunk is not None else CHUNK_BYTES // (8 * max(1, columns)))


def ranges(n: int, rows: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(n)`` in steps of ``rows``."""
    return [(a, min(a + rows, n)) for a in range(0, n, rows)]


def run(fn: Callable[[tuple[int, int]], T], parts: Sequence[tuple[int, int]], workers: int | None = None) -> list[T]:
    """``[fn(part) for part in parts]``, in order, on a pool of threads (inline for one part or one thread)."""
    workers = min(threads() if workers is None else workers, len(parts))
    if workers <= 1:
        return [fn(p) for p in parts]
    with ThreadPoolExecutor(workers, thread_name_prefix="mlptrain-data") as pool:
        return list(pool.map(fn, parts))


def first_nonfinite(x: np.ndarray, chunk: int | None = None) -> tuple[int, int] | None:
    """``(row, column)`` of the first inf or NaN in ``x (N, F)`` (row-major order), or None, chunk by chunk."""
    if x.size == 0:
        return None
    step = chunk_rows(x.shape[1], chunk)

    def bad(part: tuple[int, int]) -> tuple[int, int] | None:
        a, b = part
        block = aligned(x[a:b])
        if np.isfinite(block).all():
            return None
        row, col = np.argwhere(~np.isfinite(block))[0]
        return a + int(row), int(col)

    return next((hit for hit in run(bad, ranges(len(x), step)) if hit is not None), None)


def max_abs(x: np.ndarray, chunk: int | None = None) -> float:
    """``max(|x|)`` over ``x (N, F)``, chunk by chunk (no temporary of the table's size)."""
    parts = ranges(len(x), chunk_rows(x.shape[1], chunk))
    return max(run(lambda part: float(np.max(np.abs(aligned(x[part[0] : part[1]])))), parts), default=0.0)


def take_into(src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[:] = src[idx]`` (whole rows, ``idx`` in range by construction: a permutation or split of the rows).

    ``mode="clip"``, because NumPy's default ``mode="raise"`` buffers ``out`` (it must leave it untouched
    when an index is out of range): the rows are gathered into a temporary and copied again, about 3x the
    time of one gather (8192 rows of 4096 bfloat16: 31 ms against 10 ms on the 2-core machine, 2026-12-04).
    """
    return np.take(src, idx, axis=0, out=out, mode="clip")


def aligned(block: np.ndarray) -> np.ndarray:
    """``block``, or a copy of it when its items are not aligned to their size (a table memory-mapped
    in an NPZ starts wherever its zip member does): ``isfinite`` runs several times slower on those,
    and a chunk's copy is a memcpy that stays in the CPU's cache."""
    return block if block.flags.aligned else np.array(block)


def normalise_into(
    raw: np.ndarray, shift: np.ndarray, inv: np.ndarray, out: np.ndarray, mapped: Mapping | None = None
) -> np.ndarray:
    """``out[:] = (mapped(raw) - shift) * inv``: ``raw (n, F)`` any real dtype, ``shift``, ``inv = 1 / scale``
    ``(F,)`` float64, ``out (n, F)`` float32 (or a compute dtype); ``mapped`` (``data.normalize=quantile``'s
    :meth:`mlptrain.data.files.column_stats.QuantileMap.apply_`) maps some columns of the float64 copy in place first.

    The one normalisation arithmetic (made splits, streamed rows, :meth:`Normalization.apply`): the raw values
    in float64, the shift subtracted and the scale applied in float64, then rounded once to ``out``'s dtype, so
    a column of ``1e8 + noise`` keeps its noise (in float32 the values round to steps of 8 before the shift).
    """
    x64 = np.array(raw, np.float64)  # (n, F) a copy, ours to overwrite
    if mapped is not None:
        mapped(x64)
    np.subtract(x64, shift, out=x64)
    np.multiply(x64, inv, out=x64)
    np.copyto(out, x64, casting="unsafe")
    return out


def gather_normalised(
    x: np.ndarray,
    rows: np.ndarray | None,
    shift: np.ndarray,
    scale: np.ndarray,
    chunk: int | None = None,
    mapped: Mapping | None = None,
) -> np.ndarray:
    """``(mapped(x[rows]) - shift) / scale`` as a new float32 C-contiguous ``(len(rows), F)`` array, chunk by chunk
    (``mapped``: see :func:`normalise_into`).

    ``rows`` None takes every row. The arithmetic is :func:`normalise_into`'s (float64, rounded once to float32),
    so the splits equal :meth:`Normalization.apply` of the same rows bit for bit.
    """
    n, f = (len(x) if rows is None else len(rows)), x.shape[1]
    shift64, inv64 = np.asarray(shift, np.float64), 1.0 / np.asarray(scale, np.float64)  # (F,)
    out = np.empty((n, f), np.float32)  # (n, F)

    def fill(part: tuple[int, int]) -> None:
        a, b = part
        if rows is None:
            raw = x[a:b]
        elif x.dtype == np.float32 and x.flags.aligned:  # (np.take from unaligned items: 1000x slower)
            raw = take_into(x, rows[a:b], np.empty((b - a, f), np.float32))  # the gather
        else:
            raw = x[rows[a:b]]
        normalise_into(raw, shift64, inv64, out[a:b], mapped)

    run(fill, ranges(n, chunk_rows(f, chunk)))
    return out


@contextmanager
def timed(phase: str, nbytes: int, what: str = "data") -> Iterator[None]:
    """Log ``phase``'s wall time and its rate over ``nbytes`` (one info line, when it ends)."""
    start = time.perf_counter()
    yield
    log_phase(phase, start, nbytes, what)


def log_phase(phase: str, start: float, nbytes: int, what: str = "data") -> None:
    """Log that ``phase``, begun at ``start`` (``time.perf_counter()``), took until now over ``nbytes``."""
    s = time.perf_counter() - start
    log.info("%s %s: %.3f s for %.1f MB (%.2f GB/s)", what, phase, s, nbytes / 1e6, nbytes / 1e9 / max(s, 1e-9))
