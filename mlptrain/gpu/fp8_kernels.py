"""The FP8 casts and the delayed-scaling update on the GPU: what :mod:`mlptrain.fp8` does in NumPy.

CuPy has no float8 dtype, so an FP8 copy is a ``uint8`` CuPy array holding the FP8 bytes (cuBLASLt
reads it through the layout's data type). Two cast kernels, both reading a bfloat16 tensor, writing
its FP8 bytes and folding ``max |x|`` into the tensor's amax (as float bits: for values >= 0 the
order of the bits is the order of the floats, and any NaN's bits exceed inf's, so one
``atomicMax`` gives the amax, inf or NaN as NumPy's ``max`` would):

* ``mlptrain_fp8_cast_<fmt>``: the same memory order (a weight for the forward, an activation that is
  already the GEMM's column-major B);
* ``mlptrain_fp8_cast_t_<fmt>``: a transposed copy through a 32 x 32 tile in shared memory (W^T for
  the input gradient, X^T and dZ^T for the weight gradient: Hopper runs FP8 only as "TN", K
  contiguous in both operands, and K is the batch there).

The cast itself is the hardware's: PTX ``cvt.rn.satfinite.e4m3x2.f32`` (sm_89+), round to nearest
even, saturating; a non-finite input becomes NaN first (:func:`mlptrain.epilogs_fp8.quantize`).

``mlptrain_fp8_scale_update`` (one thread) then writes the dequantisation scale the GEMM reads
(``1 / scale``: the scale this cast used), takes the amax into the history (unless it is not finite)
and computes the scale of the next cast, with the float64 arithmetic of :meth:`Fp8Scaling.record`
(``2^margin`` passed in as a double, as the CPU computes it).
"""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp
import numpy as np

from mlptrain.epilogs_fp8 import FP8_MAX
from mlptrain.fp8 import Fp8Scaling, TensorScale

SOURCE = r"""
// header-free: intrinsics only (no math headers, whose max/fmax NVRTC may not declare)
__device__ __forceinline__ float mlptrain_bf16(unsigned short u) { return __uint_as_float(((unsigned int)u) << 16); }
__device__ __forceinline__ unsigned int mlptrain_umax(unsigned int a, unsigned int b) { return a > b ? a : b; }

// fp8(v * scale), the hardware's rounding and saturation; inf and NaN become NaN (the step will be skipped)
#define MLPTRAIN_FP8_CVT(NAME, PTX)                                                                  \
__device__ __forceinline__ unsigned char NAME(float x, float scale) {                               \
    const float v = (__float_as_uint(x) & 0x7F800000u) == 0x7F800000u ? __uint_as_float(0x7FC00000u) \
                                                                       : x * scale;                  \
    unsigned short r;                                                                                \
    asm("cvt.rn.satfinite." PTX "x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));                 \
    return (unsigned char)(r & 0xFFu);  /* the second source lands in the low byte */               \
}
MLPTRAIN_FP8_CVT(mlptrain_to_e4m3, "e4m3")
MLPTRAIN_FP8_CVT(mlptrain_to_e5m2, "e5m2")

// The block's largest |x| bits into *amax_bits (tid, nthreads: the block's flat thread index and size)
__device__ __forceinline__ void mlptrain_block_amax(unsigned int m, int tid, int nthreads, unsigned int* amax_bits) {
    __shared__ unsigned int warp_max[32];
    for (int o = 16; o > 0; o >>= 1) m = mlptrain_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if ((tid & 31) == 0) warp_max[tid >> 5] = m;
    __syncthreads();
    if (tid < 32) {
        m = tid < (nthreads + 31) / 32 ? warp_max[tid] : 0u;
        for (int o = 16; o > 0; o >>= 1) m = mlptrain_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        if (tid == 0 && m) atomicMax(amax_bits, m);
    }
}

// out[i] = fp8(x[i] * scale), n elements in memory order
#define MLPTRAIN_FP8_CAST(NAME, CVT)                                                                 \
extern "C" __global__ void NAME(const unsigned short* x, long long n, const float* scale,            \
                                unsigned char* out, unsigned int* amax_bits) {                       \
    const float s = *scale;                                                                          \
    unsigned int m = 0u;                                                                             \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;                     \
         i += (long long)gridDim.x * blockDim.x) {                                                   \
        const float v = mlptrain_bf16(x[i]);                                                         \
        m = mlptrain_umax(m, __float_as_uint(v) & 0x7FFFFFFFu);                                                \
        out[i] = CVT(v, s);                                                                          \
    }                                                                                                \
    mlptrain_block_amax(m, threadIdx.x, blockDim.x, amax_bits);                                      \
}
MLPTRAIN_FP8_CAST(mlptrain_fp8_cast_e4m3, mlptrain_to_e4m3)
MLPTRAIN_FP8_CAST(mlptrain_fp8_cast_e5m2, mlptrain_to_e5m2)

// x (rows, cols) row-major -> out (cols, rows) row-major, through a 32 x 32 tile; block (32, 8)
#define MLPTRAIN_FP8_CAST_T(NAME, CVT)                                                               \
extern "C" __global__ void NAME(const unsigned short* x, long long rows, long long cols,            \
                                const float* scale, unsigned char* out, unsigned int* amax_bits) {   \
    __shared__ float tile[32][33];                                                                   \
    const float s = *scale;                                                                          \
    const long long c0 = (long long)blockIdx.x * 32, r0 = (long long)blockIdx.y * 32;                \
    unsigned int m = 0u;                                                                             \
    for (int j = threadIdx.y; j < 32; j += 8) {                                                      \
        const long long r = r0 + j, c = c0 + threadIdx.x;                                            \
        float v = 0.0f;                                                                              \
        if (r < rows && c < cols) {                                                                  \
            v = mlptrain_bf16(x[r * cols + c]);                                                      \
            m = mlptrain_umax(m, __float_as_uint(v) & 0x7FFFFFFFu);                                            \
        }                                                                                            \
        tile[j][threadIdx.x] = v;                                                                    \
    }                                                                                                \
    __syncthreads();                                                                                 \
    for (int j = threadIdx.y; j < 32; j += 8) {                                                      \
        const long long c = c0 + j, r = r0 + threadIdx.x;                                            \
        if (r < rows && c < cols) out[c * rows + r] = CVT(tile[threadIdx.x][j], s);                  \
    }                                                                                                \
    mlptrain_block_amax(m, threadIdx.y * 32 + threadIdx.x, 256, amax_bits);                          \
}
MLPTRAIN_FP8_CAST_T(mlptrain_fp8_cast_t_e4m3, mlptrain_to_e4m3)
MLPTRAIN_FP8_CAST_T(mlptrain_fp8_cast_t_e5m2, mlptrain_to_e5m2)

// After a cast: scale_inv = 1 / scale (what the GEMM dequantises with); then, with record, the amax
// enters the history (newest first; not when inf or NaN) and the next scale is fp8_max / (2^margin * max)
extern "C" __global__ void mlptrain_fp8_scale_update(unsigned int* amax_bits, float* history, int len, float* scale,
                                                     float* scale_inv, double fp8_max, double headroom, int record) {
    const unsigned int bits = *amax_bits;
    *amax_bits = 0u;  // ready for the next cast
    const float s = *scale;
    *scale_inv = 1.0f / s;
    if (!record || (bits & 0x7F800000u) == 0x7F800000u) return;
    for (int i = len - 1; i > 0; --i) history[i] = history[i - 1];
    history[0] = __uint_as_float(bits);
    double top = 0.0;
    for (int i = 0; i < len; ++i) top = (double)history[i] > top ? (double)history[i] : top;
    if (top > 0.0) *scale = (float)(fp8_max / (headroom * (top > 1e-30 ? top : 1e-30)));  // headroom = 2^margin
}
"""


@functools.cache
def module() -> Any:
    """The cast and update kernels, one ``RawModule`` (compiled for this GPU, which must be sm_89+)."""
    return cp.RawModule(code=SOURCE)


def _grid(n: int, threads: int = 256) -> int:
    return max(1, min(-(-n // threads), 4096))  # a grid-stride loop past 4096 blocks


def cast(x: Any, scale: Any, fmt: str, amax_bits: Any, transpose: bool) -> Any:
    """The FP8 bytes of the C-contiguous bfloat16 ``x (R, C)``: ``(R, C)``, or ``(C, R)`` with ``transpose``;
    ``max |x|`` folded into ``amax_bits`` (uint32 (1,), float bits)."""
    if x.dtype.name != "bfloat16" or not x.flags.c_contiguous or x.ndim != 2:
        raise ValueError(f"the FP8 cast needs a C-contiguous 2-d bfloat16 array; got {x.dtype} {x.shape}")
    rows, cols = x.shape
    if not transpose:
        out = cp.empty((rows, cols), dtype=cp.uint8)
        n = rows * cols
        module().get_function(f"mlptrain_fp8_cast_{fmt}")((_grid(n),), (256,), (x, np.int64(n), scale, out, amax_bits))
        return out
    out = cp.empty((cols, rows), dtype=cp.uint8)
    grid = (-(-cols // 32), -(-rows // 32))  # tiles of 32 columns x 32 rows
    args = (x, np.int64(rows), np.int64(cols), scale, out, amax_bits)
    module().get_function(f"mlptrain_fp8_cast_t_{fmt}")(grid, (32, 8), args)
    return out


class GpuTensorScale(TensorScale):
    """A :class:`TensorScale` with the two arrays the kernels need: ``amax_bits`` (uint32 (1,): the casts'
    running amax) and ``scale_inv`` (float32 (): the dequantisation scale of the last cast)."""

    def __init__(self, history_len: int) -> None:
        super().__init__(cp, history_len)
        self.amax_bits = cp.asarray(np.zeros(1, np.uint32))  # host copies: no fill kernel to compile
        self.scale_inv = cp.asarray(np.ones(1, np.float32)).reshape(())


class GpuFp8Scaling(Fp8Scaling):
    """:class:`Fp8Scaling` with the casts and the update as kernels (the host never reads a scale)."""

    def __init__(self, *, amax_history: int = 16, margin: int = 0) -> None:
        super().__init__(cp, amax_history=amax_history, margin=margin)

    def get(self, name: str) -> TensorScale:
        if name not in self.tensors:
            self.tensors[name] = GpuTensorScale(self.history_len)
        return self.tensors[name]

    def quantize(self, name: str, x: Any, fmt: str, record: bool = True, order: str = "K") -> tuple[Any, Any]:
        """The FP8 bytes of ``x (R, C)`` (uint8, x's shape) in memory ``order`` ``"C"`` or ``"F"``, and the
        dequantisation scale; a transposed cast where x has the other order."""
        st = self.get(name)
        assert isinstance(st, GpuTensorScale)
        if order not in ("C", "F"):
            raise ValueError(f"an FP8 operand's order is 'C' (A) or 'F' (B); got {order!r}")
        src = x if order == "C" else x.T  # the array whose C order is the wanted memory
        if src.flags.c_contiguous:
            q = cast(src, st.scale, fmt, st.amax_bits, transpose=False)
        else:
            q = cast(cp.ascontiguousarray(src.T), st.scale, fmt, st.amax_bits, transpose=True)
        history = (st.amax_history, np.int32(self.history_len))
        limits = (np.float64(FP8_MAX[fmt]), np.float64(2.0**self.margin), np.int32(record))
        update = module().get_function("mlptrain_fp8_scale_update")
        update((1,), (1,), (st.amax_bits, *history, st.scale, st.scale_inv, *limits))  # one thread, after the cast
        return (q if order == "C" else q.T), st.scale_inv
