"""The two element-wise ends of inference: normalise raw rows, and the argmax of the logits.

Between them run the GEMMs; around them, at 4096 features a batch moves hundreds of megabytes,
so both are written to run at memory speed, for every compute dtype, in one module (one NVRTC
compile, cached on disk by CuPy; the bfloat16 conversion, sm_80 and newer, in a second one) that
needs no CUDA headers (conversions are PTX ``cvt``):

``mlptrain_normalise_<dtype>(x, shift, inv, y, rows, f)``
    ``y[r, c] = (x[r, c] - shift[c]) * inv[c]`` from float32 ``x (rows, f)`` into ``y`` of the
    compute dtype, rounded to nearest even: the arithmetic of
    :meth:`mlptrain.data.Normalization.apply` and of the CPU predictor, then the cast.
    ``blockIdx.y`` strides over rows and the threads over columns, so a column's ``shift`` and
    ``inv`` index needs no division; four columns per thread (16-byte loads) when ``f % 4 == 0``
    and ``x`` starts 16-byte aligned.

``mlptrain_argmax_<dtype>(z, out, rows, c)``
    ``out[r] = argmax(z[r, :])`` as int64, the first index of the maximum, a NaN counting as the
    maximum (NumPy's rule). One warp
    per row: each lane scans every 32nd column, then the lanes combine their (value, index) pairs
    with shuffles.

A generic CuPy broadcast (``(x - shift) * inv``) computes a multi-dimensional index per element and
CuPy's ``argmax`` reduction is general-purpose; at 4096 x 4 they cost more than the margin to
``torch.compile``, whose generated kernels are these (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp
import numpy as np

_CONVERT = r"""
__device__ __forceinline__ unsigned short f2h(float v) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); return h; }
__device__ __forceinline__ float h2f(unsigned short h) {
    float v; asm("cvt.f32.f16 %0, %1;" : "=f"(v) : "h"(h)); return v; }
__device__ __forceinline__ float bf2f(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }

"""

_NORMALISE = r"""
// --- normalise: float32 (rows, f) -> OUT (rows, f) ----------------------------------------------
#define MLPTRAIN_NORMALISE(NAME, OUT, CVT)                                                              \
extern "C" __global__ void NAME(const float* __restrict__ x, const float* __restrict__ shift,          \
                                const float* __restrict__ inv, OUT* __restrict__ y, long long rows,    \
                                int f, int vec) {                                                      \
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {                                         \
        const float* xr = x + r * f;                                                                   \
        OUT* yr = y + r * f;                                                                           \
        if (vec) {  /* f % 4 == 0 and x 16-byte aligned: float4 loads */                               \
            const float4* x4 = reinterpret_cast<const float4*>(xr);                                    \
            for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < (f >> 2);                          \
                 q += gridDim.x * blockDim.x) {                                                        \
                const float4 v = x4[q]; const int c = q << 2;                                          \
                yr[c] = CVT((v.x - shift[c]) * inv[c]);                                                \
                yr[c + 1] = CVT((v.y - shift[c + 1]) * inv[c + 1]);                                    \
                yr[c + 2] = CVT((v.z - shift[c + 2]) * inv[c + 2]);                                    \
                yr[c + 3] = CVT((v.w - shift[c + 3]) * inv[c + 3]);                                    \
            }                                                                                          \
        } else {                                                                                       \
            for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < f; c += gridDim.x * blockDim.x)   \
                yr[c] = CVT((xr[c] - shift[c]) * inv[c]);                                              \
        }                                                                                              \
    }                                                                                                  \
}
"""

_SOURCE = (
    _CONVERT
    + _NORMALISE
    + r"""
__device__ __forceinline__ float keep_f(float v) { return v; }
__device__ __forceinline__ double to_d(float v) { return (double)v; }
MLPTRAIN_NORMALISE(mlptrain_normalise_float16, unsigned short, f2h)
MLPTRAIN_NORMALISE(mlptrain_normalise_float32, float, keep_f)
MLPTRAIN_NORMALISE(mlptrain_normalise_float64, double, to_d)

// --- argmax: IN (rows, c) -> int64 (rows,), one warp per row ----------------------------------
#define MLPTRAIN_ARGMAX(NAME, IN, ACC, LOAD)                                                            \
extern "C" __global__ void NAME(const IN* __restrict__ z, long long* __restrict__ out, long long rows, \
                                int c) {                                                               \
    const int lane = threadIdx.x & 31;                                                                 \
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);                                  \
    for (long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows;      \
         r += warps) {                                                                                 \
        const IN* zr = z + r * c;                                                                      \
        ACC best = LOAD(zr[0]); int at = 0;                                                            \
        for (int j = lane; j < c; j += 32) {                                                           \
            const ACC v = LOAD(zr[j]);                                                                 \
            if (mlptrain_before(v, j, best, at)) { best = v; at = j; }                                 \
        }                                                                                              \
        for (int s = 16; s > 0; s >>= 1) {                                                             \
            const ACC ov = __shfl_down_sync(0xffffffffu, best, s);                                     \
            const int oat = __shfl_down_sync(0xffffffffu, at, s);                                      \
            if (mlptrain_before(ov, oat, best, at)) { best = ov; at = oat; }                           \
        }                                                                                              \
        if (lane == 0) out[r] = at;                                                                    \
    }                                                                                                  \
}
// (v, j) comes before (best, at): NumPy's argmax, where a NaN is larger than every number, and of
// equal values (or NaNs) the first index wins.
template <typename T>
__device__ __forceinline__ bool mlptrain_before(T v, int j, T best, int at) {
    const bool vn = v != v, bn = best != best;
    if (vn || bn) return vn && (!bn || j < at);
    return v > best || (v == best && j < at);
}
__device__ __forceinline__ float id_f(float v) { return v; }
__device__ __forceinline__ double id_d(double v) { return v; }
MLPTRAIN_ARGMAX(mlptrain_argmax_float16, unsigned short, float, h2f)
MLPTRAIN_ARGMAX(mlptrain_argmax_bfloat16, unsigned short, float, bf2f)
MLPTRAIN_ARGMAX(mlptrain_argmax_float32, float, float, id_f)
MLPTRAIN_ARGMAX(mlptrain_argmax_float64, double, double, id_d)
"""
)

# bfloat16 conversion (cvt.rn.bf16.f32) needs sm_80 or newer: a module of its own, so that the
# others load on older GPUs too.
_BF16_SOURCE = (
    r"""
__device__ __forceinline__ unsigned short f2bf(float v) {
    unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v)); return h; }
"""
    + _NORMALISE
    + "MLPTRAIN_NORMALISE(mlptrain_normalise_bfloat16, unsigned short, f2bf)\n"
)

_THREADS = 256


@functools.cache
def _module(bf16: bool = False) -> Any:
    return cp.RawModule(code=_BF16_SOURCE if bf16 else _SOURCE)


@functools.cache
def _sms() -> int:
    return int(cp.cuda.Device().attributes["MultiProcessorCount"])


def normalise(x: Any, shift: Any, inv: Any, out: Any) -> Any:
    """``out[:] = (x - shift) * inv`` in ``out``'s dtype; ``x`` float32 and ``out`` C-contiguous ``(rows, f)``."""
    rows, f = x.shape
    dtype = np.dtype(out.dtype).name
    ok = x.dtype == cp.float32 and out.shape == x.shape and x.flags.c_contiguous and out.flags.c_contiguous
    ok = ok and all(a.dtype == cp.float32 and a.shape == (f,) for a in (shift, inv))
    if not ok or dtype not in ("float16", "bfloat16", "float32", "float64"):
        raise ValueError(
            f"normalise needs C-contiguous float32 x (rows, f), float32 shift and inv (f,) and an out of x's shape "
            f"in float16, bfloat16, float32 or float64; got x {x.dtype}{x.shape}, shift {shift.dtype}{shift.shape}, "
            f"inv {inv.dtype}{inv.shape}, out {out.dtype}{out.shape}"
        )
    if rows == 0:
        return out
    kernel = _module(dtype == "bfloat16").get_function(f"mlptrain_normalise_{dtype}")
    vec = f % 4 == 0 and x.data.ptr % 16 == 0
    per_row = -(-(f // 4 if vec else f) // _THREADS)
    grid_y = int(min(rows, max(1, 8 * _sms() // per_row), 65535))
    kernel((per_row, grid_y), (_THREADS,), (x, shift, inv, out, np.int64(rows), np.int32(f), np.int32(vec)))
    return out


def argmax(z: Any, out: Any | None = None) -> Any:
    """The first index of each row's maximum of ``z (rows, c)`` (C-contiguous), as int64 ``(rows,)``."""
    rows, c = z.shape
    if not z.flags.c_contiguous:
        z = cp.ascontiguousarray(z)
    out = cp.empty(rows, dtype=cp.int64) if out is None else out
    if rows == 0:
        return out
    kernel = _module().get_function(f"mlptrain_argmax_{np.dtype(z.dtype).name}")
    per_block = _THREADS // 32
    blocks = int(min(-(-rows // per_block), 16 * _sms()))
    kernel((blocks,), (_THREADS,), (z, out, np.int64(rows), np.int32(c)))
    return out
