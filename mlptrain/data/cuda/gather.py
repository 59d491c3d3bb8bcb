"""The data loader's batch gather, ``out[r] = src[idx[r]]`` for whole rows: one header-free kernel, any dtype.

``cupy.take(src, idx, axis=0)`` compiles a kernel per dtype and number of dimensions, and a fresh
machine compiles CuPy's element-wise kernels one at a time, each with CuPy's headers (NVRTC): the
default run gathered its features (float32) and its labels (int64) with two of them, compiled while
the first step waited (issue #14). A row is only bytes, so this kernel copies rows of any dtype and
width in units of the widest word that divides the row (16, 8, 4, 2 or 1 bytes), and needs no
headers: it compiles with mlptrain's other header-free kernels in one NVRTC call
(:mod:`mlptrain.base.cuda.plain_kernels`), before the data is even loaded, and CuPy caches it on disk.

Layout: ``src`` is ``(N, ...)`` and ``out`` ``(B, ...)``, both C-contiguous; ``idx`` is ``(B,)`` int64
on the device. One thread per unit: ``i = r * units + c`` reads unit ``c`` of row ``idx[r]``.
"""

from __future__ import annotations

from typing import Any

import cupy as cp

from mlptrain.base.cuda.plain_kernels import function

_THREADS = 256
_MAX_BLOCKS = 4096


def take_rows(src: Any, idx: Any, out: Any = None) -> Any:
    """``cupy.take(src, idx, axis=0, out=out)`` for C-contiguous ``src`` and ``out``, on the current stream.

    Args:
        src: ``(N, ...)`` any dtype, C-contiguous.
        idx: ``(B,)`` int64 row numbers in ``[0, N)`` (not checked: the loader's permutation).
        out: ``(B, ...)`` of ``src``'s dtype and row shape, C-contiguous; None: a new array.

    Returns ``out``. No allocation when ``out`` is given, no synchronisation: capturable.
    """
    rows = int(idx.shape[0])
    if out is None:
        out = cp.empty((rows, *src.shape[1:]), src.dtype)
    if not (src.flags.c_contiguous and out.flags.c_contiguous) or out.shape != (rows, *src.shape[1:]):
        raise ValueError(
            f"take_rows needs C-contiguous (N, ...) rows and out {(rows, *src.shape[1:])}; "
            f"got src {src.shape} and out {out.shape}"
        )
    if out.dtype != src.dtype or idx.dtype != cp.int64 or not idx.flags.c_contiguous:
        raise ValueError(
            f"take_rows: out {out.dtype} must be src's {src.dtype}, idx contiguous int64 "
            f"(got {idx.dtype}, strides {idx.strides})"
        )
    launch = _plan(src, out, rows)
    if launch is not None:
        unit, units, n, blocks = launch
        function(f"mlptrain_gather_{unit}")((blocks,), (_THREADS,), (src, idx, out, cp.int64(units), cp.int64(n)))
    return out


def take_rows_at(src: Any, order: Any, out: Any, step: Any, base: Any, batch: int, offset: int = 0) -> Any:
    """``out[r] = src[order[(step - base) * batch + offset + r]]``, the step and base read on the device.

    The batch of the current step, gathered by a kernel whose arguments never change: captured into the
    training step's CUDA graph, each replay gathers the next batch, as the step count (``step``, a 0-d int64
    device array the step's last kernel advances) moves on. ``base`` (1-element int64) is the step count at
    batch 0 of the epoch, ``order`` ``(N,)`` int64 the epoch's permutation, ``offset`` this rank's first row
    of the batch (data parallel); positions past the end of ``order`` wrap around (a replay past the epoch's
    last batch reads rows, never past the buffer). Same layout rules as :func:`take_rows`; no allocation, no
    synchronisation.
    """
    rows = int(out.shape[0])
    if not (src.flags.c_contiguous and out.flags.c_contiguous) or out.shape[1:] != src.shape[1:]:
        raise ValueError(
            f"take_rows_at needs C-contiguous rows of {src.shape[1:]}; got src {src.shape}, out {out.shape}"
        )
    if out.dtype != src.dtype or order.dtype != cp.int64 or step.dtype != cp.int64 or base.dtype != cp.int64:
        raise ValueError(f"take_rows_at: out {out.dtype} must be src's {src.dtype}; order, step, base int64")
    launch = _plan(src, out, rows)
    if launch is not None:
        unit, units, n, blocks = launch
        length = cp.int64(order.shape[0])
        args = (src, order, length, out, cp.int64(units), cp.int64(n), step, base, cp.int64(batch), cp.int64(offset))
        function(f"mlptrain_gather_at_{unit}")((blocks,), (_THREADS,), args)
    return out


def _plan(src: Any, out: Any, rows: int) -> tuple[int, int, int, int] | None:
    """``(unit, units per row, threads' work, blocks)`` of a gather of ``rows`` rows, or None for no work."""
    row_bytes = src.itemsize * (src.size // src.shape[0] if src.shape[0] else 0)
    if rows == 0 or row_bytes == 0:
        return None
    # the widest unit that divides a row and both starts (so every row start is aligned to it too)
    unit = next(u for u in (16, 8, 4, 2, 1) if row_bytes % u == 0 and src.data.ptr % u == 0 == out.data.ptr % u)
    units = row_bytes // unit
    n = rows * units
    return unit, units, n, max(1, min(-(-n // _THREADS), _MAX_BLOCKS))
