"""The data loader's batch gather, ``out[r] = src[idx[r]]`` for whole rows: one header-free program.

``cupy.take(src, idx, axis=0)`` compiles a kernel per dtype and number of dimensions, and a fresh
machine compiles CuPy's element-wise kernels at about 0.1 s each (NVRTC with CuPy's headers): the
default run gathered its features (float32) and its labels (int64) with two of them, compiled while
the first step waited (issue #14). A row is only bytes, so this kernel copies rows of any dtype and
width in units of the widest word that divides the row (16, 8, 4, 2 or 1 bytes), and needs no
headers: the whole module compiles in one NVRTC call of a few tens of milliseconds, before the data
is even loaded, and CuPy caches it on disk like any other.

Layout: ``src`` is ``(N, ...)`` and ``out`` ``(B, ...)``, both C-contiguous; ``idx`` is ``(B,)`` int64
on the device. One thread per unit: ``i = r * units + c`` reads unit ``c`` of row ``idx[r]``.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp

_SOURCE = r"""
struct __align__(16) mlptrain_u16 { unsigned long long lo, hi; };
#define MLPTRAIN_GATHER(NAME, U)                                                                 \
extern "C" __global__ void NAME(const U* src, const long long* idx, U* out, long long units,     \
                                long long n) {                                                  \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;                 \
         i += (long long)gridDim.x * blockDim.x) {                                              \
        const long long r = i / units, c = i - r * units;                                       \
        out[i] = src[idx[r] * units + c];                                                       \
    }                                                                                           \
}
MLPTRAIN_GATHER(mlptrain_gather_16, mlptrain_u16)
MLPTRAIN_GATHER(mlptrain_gather_8, unsigned long long)
MLPTRAIN_GATHER(mlptrain_gather_4, unsigned int)
MLPTRAIN_GATHER(mlptrain_gather_2, unsigned short)
MLPTRAIN_GATHER(mlptrain_gather_1, unsigned char)
"""

_THREADS = 256
_MAX_BLOCKS = 4096


@functools.cache
def _module() -> Any:
    return cp.RawModule(code=_SOURCE)


def compile_module() -> None:
    """Compile (or load from CuPy's disk cache) the program now: what :mod:`mlptrain.gpu.precompile` runs."""
    _module().get_function("mlptrain_gather_1")


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
        raise ValueError(f"take_rows needs C-contiguous (N, ...) rows and out {(rows, *src.shape[1:])}; "
                         f"got src {src.shape} and out {out.shape}")  # fmt: skip
    if out.dtype != src.dtype or idx.dtype != cp.int64 or not idx.flags.c_contiguous:
        raise ValueError(f"take_rows: out {out.dtype} must be src's {src.dtype}, idx contiguous int64 "
                         f"(got {idx.dtype}, strides {idx.strides})")  # fmt: skip
    row_bytes = src.itemsize * (src.size // src.shape[0] if src.shape[0] else 0)
    if rows == 0 or row_bytes == 0:
        return out
    # the widest unit that divides a row and both starts (so every row start is aligned to it too)
    unit = next(u for u in (16, 8, 4, 2, 1) if row_bytes % u == 0 and src.data.ptr % u == 0 == out.data.ptr % u)
    units = row_bytes // unit
    n = rows * units
    blocks = max(1, min(-(-n // _THREADS), _MAX_BLOCKS))
    kernel = _module().get_function(f"mlptrain_gather_{unit}")
    kernel((blocks,), (_THREADS,), (src, idx, out, cp.int64(units), cp.int64(n)))
    return out
