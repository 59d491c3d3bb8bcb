"""The FP8 casts and the delayed-scaling update on the GPU: what :mod:`mlptrain.nn.fp8` does in NumPy.

CuPy has no float8 dtype, so an FP8 copy is a ``uint8`` CuPy array holding the FP8 bytes (cuBLASLt
reads it through the layout's data type). Two cast kernels, both reading a bfloat16 tensor, writing
its FP8 bytes and folding ``max |x|`` into the tensor's amax (as float bits: for values >= 0 the
order of the bits is the order of the floats, and any NaN's bits exceed inf's, so one
``atomicMax`` gives the amax, inf or NaN as NumPy's ``max`` would):

* ``mlptrain_fp8_cast_<fmt>``: the same memory order (a weight for the forward, an activation that is
  already the GEMM's column-major B), eight elements a thread: one 16-byte load, one 8-byte store;
* ``mlptrain_fp8_cast_t_<fmt>``: a transposed copy through a 64 x 64 tile in shared memory (W^T for
  the input gradient, X^T and dZ^T for the weight gradient: Hopper runs FP8 only as "TN", K
  contiguous in both operands, and K is the batch there), 16-byte loads and 8-byte stores too.

Each has a ``_f32_e4m3`` twin for a weight's float32 master (``compute_copy=cast``, the FP8 default:
no 16-bit copy of the weights is kept): it reads 32 bytes a thread and rounds them to bfloat16 in
registers (``cvt.rn.bf16x2.f32``), so its bytes and amax are those of the kept copy's cast.

All move memory at close to the GPU's bandwidth only with wide accesses: one byte stored per thread
(the first version) left each cast several times slower than its bytes (docs/benchmarks.md, #30).

The cast itself is the hardware's: PTX ``cvt.rn.satfinite.e4m3x2.f32`` (sm_89+), two values at a
time, round to nearest even, saturating; a non-finite input becomes NaN first
(:func:`mlptrain.nn.epilogs_fp8.quantize`).

**The scale update rides on the cast.** The grid's last block to finish (each block counts itself
into ``blocks_done`` after its ``atomicMax``: CUDA's "threadFenceReduction" pattern) writes the
dequantisation scale the GEMM reads (``1 / scale``: the scale this cast used), takes the amax into
the history (unless it is not finite) and computes the scale of the next cast, with the float64
arithmetic of :meth:`Fp8Scaling.record` (``2^margin`` passed in as a double, as the CPU computes it).
Every other block has read the scale by then, so none casts with the new one; and the step has one
launch per cast instead of two.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp
import numpy as np

from mlptrain.nn.epilogs_fp8 import FP8_MAX
from mlptrain.nn.fp8 import Fp8Scaling, TensorScale

SOURCE = r"""
// header-free: intrinsics only (no math headers, whose max/fmax NVRTC may not declare)
__device__ __forceinline__ float mlptrain_bf16(unsigned short u) { return __uint_as_float(((unsigned int)u) << 16); }
__device__ __forceinline__ unsigned int mlptrain_umax(unsigned int a, unsigned int b) { return a > b ? a : b; }
// v * scale, or NaN where v is inf or NaN (the step will be skipped)
__device__ __forceinline__ float mlptrain_fp8_scaled(float x, float scale) {
    return (__float_as_uint(x) & 0x7F800000u) == 0x7F800000u ? __uint_as_float(0x7FC00000u) : x * scale;
}

// Two values at once, the hardware's rounding and saturation: the second source lands in the low byte,
// so fp8(lo) is byte 0 and fp8(hi) byte 1 (memory order on a little-endian GPU)
#define MLPTRAIN_FP8_CVT2(NAME, PTX)                                                                 \
__device__ __forceinline__ unsigned short NAME(float lo, float hi, float scale) {                   \
    unsigned short r;                                                                                \
    asm("cvt.rn.satfinite." PTX "x2.f32 %0, %1, %2;"                                                 \
        : "=h"(r) : "f"(mlptrain_fp8_scaled(hi, scale)), "f"(mlptrain_fp8_scaled(lo, scale)));       \
    return r;                                                                                        \
}
MLPTRAIN_FP8_CVT2(mlptrain_to_e4m3x2, "e4m3")
MLPTRAIN_FP8_CVT2(mlptrain_to_e5m2x2, "e5m2")

// Eight consecutive 16-bit values, elements e .. e + 7 (e a multiple of 8), as four words of bfloat16
// pairs (element 2j in word j's low half): a bfloat16 tensor read with one 16-byte load, or a float32
// master weight read with two and rounded to bfloat16 in registers (cvt.rn.bf16x2.f32: round to
// nearest even, as the optimizer's kept copy is written), so both give the same bytes and amax
__device__ __forceinline__ void mlptrain_load8_bf16(const void* x, long long e, unsigned int w[4]) {
    const uint4 v = *(const uint4*)((const unsigned short*)x + e);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
}
__device__ __forceinline__ unsigned int mlptrain_bf16x2(unsigned int lo, unsigned int hi) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(__uint_as_float(hi)), "f"(__uint_as_float(lo)));
    return r;
}
__device__ __forceinline__ void mlptrain_load8_f32(const void* x, long long e, unsigned int w[4]) {
    const uint4 a = *(const uint4*)((const float*)x + e), b = *(const uint4*)((const float*)x + e + 4);
    w[0] = mlptrain_bf16x2(a.x, a.y); w[1] = mlptrain_bf16x2(a.z, a.w);
    w[2] = mlptrain_bf16x2(b.x, b.y); w[3] = mlptrain_bf16x2(b.z, b.w);
}

// The scale update, run by the grid's last block once every block has folded its amax in:
// scale_inv = 1 / scale (what the GEMM dequantises with: the scale this cast used); then, with record,
// the amax enters the history (newest first; not when inf or NaN) and the next scale is
// fp8_max / (2^margin * max(history)), in float64 as Fp8Scaling.record computes it (headroom = 2^margin)
struct mlptrain_fp8_state {
    unsigned int* amax_bits; unsigned int* blocks_done; float* history; float* scale; float* scale_inv;
    double fp8_max; double headroom; int len; int record;
};
// the kernels' last arguments: the tensor's state (GpuTensorScale) and the update's constants
#define MLPTRAIN_FP8_STATE_ARGS                                                                      \
    unsigned int *amax_bits, unsigned int *blocks_done, float *history, int len, float *scale,      \
    float *scale_inv, double fp8_max, double headroom, int record
#define MLPTRAIN_FP8_STATE {amax_bits, blocks_done, history, scale, scale_inv, fp8_max, headroom, len, record}
__device__ void mlptrain_fp8_update(const mlptrain_fp8_state& st) {
    const unsigned int bits = atomicExch(st.amax_bits, 0u);  // the grid's amax, and 0 for the next cast
    const float s = *st.scale;  // every block has read it: the last one to finish is the only one left
    *st.scale_inv = 1.0f / s;
    if (!st.record || (bits & 0x7F800000u) == 0x7F800000u) return;
    for (int i = st.len - 1; i > 0; --i) st.history[i] = st.history[i - 1];
    st.history[0] = __uint_as_float(bits);
    double top = 0.0;
    for (int i = 0; i < st.len; ++i) top = (double)st.history[i] > top ? (double)st.history[i] : top;
    if (top > 0.0) *st.scale = (float)(st.fp8_max / (st.headroom * (top > 1e-30 ? top : 1e-30)));
}

// The block's largest |x| bits into *amax_bits (tid, nthreads: the block's flat thread index and size);
// the last block of the grid to finish then runs the scale update ("threadFenceReduction" pattern)
__device__ __forceinline__ void mlptrain_block_amax(unsigned int m, int tid, int nthreads,
                                                    const mlptrain_fp8_state& st) {
    __shared__ unsigned int warp_max[32];
    __shared__ bool last;
    for (int o = 16; o > 0; o >>= 1) m = mlptrain_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    if ((tid & 31) == 0) warp_max[tid >> 5] = m;
    __syncthreads();
    if (tid < 32) {
        m = tid < (nthreads + 31) / 32 ? warp_max[tid] : 0u;
        for (int o = 16; o > 0; o >>= 1) m = mlptrain_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        if (tid == 0) {
            if (m) atomicMax(st.amax_bits, m);
            __threadfence();  // this block's amax is visible before it counts itself done
            const unsigned int blocks = gridDim.x * gridDim.y;
            last = atomicAdd(st.blocks_done, 1u) == blocks - 1u;
        }
    }
    __syncthreads();
    if (last && tid == 0) {
        __threadfence();
        *st.blocks_done = 0u;
        mlptrain_fp8_update(st);
    }
}

// out[i] = fp8(x[i] * scale), n elements in memory order, 8 a thread (16-byte loads, 8-byte stores):
// n a multiple of 8 and both pointers 16- and 8-byte aligned (the caller checks); LOAD8 reads x
#define MLPTRAIN_FP8_CAST(NAME, CVT2, LOAD8)                                                         \
extern "C" __global__ void NAME(const void* x, long long n8, unsigned long long* out,               \
                                MLPTRAIN_FP8_STATE_ARGS) {                                           \
    const mlptrain_fp8_state st = MLPTRAIN_FP8_STATE;                                                \
    const float s = *scale;                                                                       \
    unsigned int m = 0u;                                                                             \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n8;                    \
         i += (long long)gridDim.x * blockDim.x) {                                                   \
        unsigned int w[4];                                                                           \
        LOAD8(x, 8 * i, w);                                                                          \
        unsigned long long q = 0ull;                                                                 \
        for (int j = 0; j < 4; ++j) {  /* bf16 pair j: element 2j in the low half */                 \
            const float lo = __uint_as_float(w[j] << 16), hi = __uint_as_float(w[j] & 0xFFFF0000u);  \
            m = mlptrain_umax(m, mlptrain_umax(__float_as_uint(lo) & 0x7FFFFFFFu, __float_as_uint(hi) & 0x7FFFFFFFu)); \
            q |= (unsigned long long)CVT2(lo, hi, s) << (16 * j);                                   \
        }                                                                                            \
        out[i] = q;                                                                                  \
    }                                                                                                \
    mlptrain_block_amax(m, threadIdx.x, blockDim.x, st);                                             \
}
MLPTRAIN_FP8_CAST(mlptrain_fp8_cast_e4m3, mlptrain_to_e4m3x2, mlptrain_load8_bf16)
MLPTRAIN_FP8_CAST(mlptrain_fp8_cast_e5m2, mlptrain_to_e5m2x2, mlptrain_load8_bf16)
MLPTRAIN_FP8_CAST(mlptrain_fp8_cast_f32_e4m3, mlptrain_to_e4m3x2, mlptrain_load8_f32)

// x (rows, cols) row-major -> out (cols, rows) row-major through a 64 x 64 tile; block 256 threads.
// Read: 8 threads cover a tile row's 64 columns with 16-byte loads (32 rows a pass, 2 passes).
// Write: 8 threads cover an output row's 64 bytes with 8-byte stores. rows, cols multiples of 8.
#define MLPTRAIN_FP8_CAST_T(NAME, CVT2, LOAD8)                                                       \
extern "C" __global__ void NAME(const void* x, long long rows, long long cols,                      \
                                unsigned char* out, MLPTRAIN_FP8_STATE_ARGS) {                       \
    const mlptrain_fp8_state st = MLPTRAIN_FP8_STATE;                                                \
    __shared__ float tile[64][65];                                                                   \
    const float s = *scale;                                                                       \
    const long long c0 = (long long)blockIdx.x * 64, r0 = (long long)blockIdx.y * 64;                \
    const int t = threadIdx.x, lane8 = t & 7, row32 = t >> 3;                                        \
    unsigned int m = 0u;                                                                             \
    for (int p = 0; p < 2; ++p) {                                                                    \
        const int tr = row32 + 32 * p;                                                               \
        const long long r = r0 + tr, c = c0 + 8 * lane8;                                             \
        unsigned int w[4] = {0u, 0u, 0u, 0u};                                                        \
        if (r < rows && c < cols) LOAD8(x, r * cols + c, w);                                         \
        for (int j = 0; j < 4; ++j) {                                                                \
            const float lo = __uint_as_float(w[j] << 16), hi = __uint_as_float(w[j] & 0xFFFF0000u);  \
            m = mlptrain_umax(m, mlptrain_umax(__float_as_uint(lo) & 0x7FFFFFFFu, __float_as_uint(hi) & 0x7FFFFFFFu)); \
            tile[tr][8 * lane8 + 2 * j] = lo;                                                        \
            tile[tr][8 * lane8 + 2 * j + 1] = hi;                                                    \
        }                                                                                            \
    }                                                                                                \
    __syncthreads();                                                                                 \
    for (int p = 0; p < 2; ++p) {                                                                    \
        const int tc = row32 + 32 * p;  /* the output row: x's column c0 + tc */                     \
        const long long c = c0 + tc, r = r0 + 8 * lane8;                                             \
        if (c < cols && r < rows) {                                                                  \
            unsigned long long q = 0ull;                                                             \
            for (int j = 0; j < 4; ++j) {  /* rows r + 2j and r + 2j + 1 of column c */               \
                const float lo = tile[8 * lane8 + 2 * j][tc], hi = tile[8 * lane8 + 2 * j + 1][tc];     \
                q |= (unsigned long long)CVT2(lo, hi, s) << (16 * j);                                   \
            }                                                                                        \
            *(unsigned long long*)(out + c * rows + r) = q;                                          \
        }                                                                                            \
    }                                                                                                \
    mlptrain_block_amax(m, t, 256, st);                                                              \
}
MLPTRAIN_FP8_CAST_T(mlptrain_fp8_cast_t_e4m3, mlptrain_to_e4m3x2, mlptrain_load8_bf16)
MLPTRAIN_FP8_CAST_T(mlptrain_fp8_cast_t_e5m2, mlptrain_to_e5m2x2, mlptrain_load8_bf16)
MLPTRAIN_FP8_CAST_T(mlptrain_fp8_cast_t_f32_e4m3, mlptrain_to_e4m3x2, mlptrain_load8_f32)
"""


@functools.cache
def module() -> Any:
    """The cast and update kernels, one ``RawModule`` (compiled for this GPU, which must be sm_89+)."""
    return cp.RawModule(code=SOURCE)


def _grid(n: int, threads: int = 256) -> int:
    return max(1, min(-(-n // threads), 4096))  # a grid-stride loop past 4096 blocks


def cast(x: Any, fmt: str, st: GpuTensorScale, limits: tuple[Any, ...], transpose: bool) -> Any:
    """The FP8 bytes of the C-contiguous bfloat16 ``x (R, C)``: ``(R, C)``, or ``(C, R)`` with ``transpose``.

    One kernel: the cast with ``st``'s scale, ``max |x|`` folded into ``st.amax_bits``, and, in the grid's
    last block, the scale update (``limits``: fp8_max and 2^margin as float64, record as int32). A float32
    ``x`` (a master weight, cast to e4m3) is rounded to bfloat16 first, in the kernel: the bytes of
    ``cast(x.astype(bfloat16))`` without that copy."""
    f32 = x.dtype == cp.float32
    if f32 and fmt != "e4m3":
        raise ValueError(f"the FP8 cast of a float32 master weight writes e4m3; got {fmt}")
    if (x.dtype.name != "bfloat16" and not f32) or not x.flags.c_contiguous or x.ndim != 2:
        raise ValueError(f"the FP8 cast needs a C-contiguous 2-d bfloat16 or float32 array; got {x.dtype} {x.shape}")
    rows, cols = x.shape
    if rows % 8 or cols % 8:  # FP8 GEMMs take multiples of 16 (epilogs_fp8.fits_fp8): the casts 8 at a time
        raise ValueError(f"the FP8 cast takes dimensions that are multiples of 8; got {x.shape}")
    if x.data.ptr % 16:
        x = x.copy()  # the 16-byte loads need an aligned start (a pool allocation is)
    state = (st.amax_bits, st.blocks_done, st.amax_history, np.int32(st.amax_history.size), st.scale, st.scale_inv)
    if not transpose:
        out = cp.empty((rows, cols), dtype=cp.uint8)
        n8 = rows * cols // 8
        kernel = module().get_function(f"mlptrain_fp8_cast_{'f32_' if f32 else ''}{fmt}")
        kernel((_grid(n8),), (256,), (x, np.int64(n8), out, *state, *limits))
        return out
    out = cp.empty((cols, rows), dtype=cp.uint8)
    grid = (-(-cols // 64), -(-rows // 64))  # tiles of 64 columns x 64 rows
    if grid[1] > 65535:
        raise ValueError(f"the transposed FP8 cast takes at most {65535 * 64} rows; got {rows}")
    kernel = module().get_function(f"mlptrain_fp8_cast_t_{'f32_' if f32 else ''}{fmt}")
    kernel(grid, (256,), (x, np.int64(rows), np.int64(cols), out, *state, *limits))
    return out


class GpuTensorScale(TensorScale):
    """A :class:`TensorScale` with the arrays the kernels need: ``amax_bits`` (uint32 (1,): the cast's running
    amax), ``blocks_done`` (uint32 (1,): the cast's blocks that have folded theirs in; the last one updates
    the scale and sets it back to 0) and ``scale_inv`` (float32 (): the dequantisation scale of the last cast)."""

    def __init__(self, history_len: int) -> None:
        super().__init__(cp, history_len)
        self.amax_bits = cp.asarray(np.zeros(1, np.uint32))  # host copies: no fill kernel to compile
        self.blocks_done = cp.asarray(np.zeros(1, np.uint32))
        self.scale_inv = cp.asarray(np.ones(1, np.float32)).reshape(())


class GpuFp8Scaling(Fp8Scaling):
    """:class:`Fp8Scaling` with the casts and the update as kernels (the host never reads a scale)."""

    def __init__(self, *, amax_history: int = 16, margin: int = 0) -> None:
        super().__init__(cp, amax_history=amax_history, margin=margin)

    def get(self, name: str) -> TensorScale:
        if name not in self.tensors:
            self.tensors[name] = GpuTensorScale(self.history_len)
        return self.tensors[name]

    def quantize(
        self, name: str, x: Any, fmt: str, record: bool = True, order: str = "K", via: Any = None
    ) -> tuple[Any, Any]:
        """The FP8 bytes of ``x (R, C)`` (uint8, x's shape) in memory ``order`` ``"C"`` or ``"F"``, and the
        dequantisation scale; a transposed cast where x has the other order. ``via``: the 16-bit dtype a
        float32 ``x`` stands for (a master weight): bfloat16 is rounded to in the cast kernel, another by a copy."""
        if via is not None and not (np.dtype(via).name == "bfloat16" and fmt == "e4m3"):
            x = x.astype(via)
        st = self.get(name)
        assert isinstance(st, GpuTensorScale)
        if order not in ("C", "F"):
            raise ValueError(f"an FP8 operand's order is 'C' (A) or 'F' (B); got {order!r}")
        src = x if order == "C" else x.T  # the array whose C order is the wanted memory
        limits = (np.float64(FP8_MAX[fmt]), np.float64(2.0**self.margin), np.int32(record))
        if src.flags.c_contiguous:
            q = cast(src, fmt, st, limits, transpose=False)
        else:
            q = cast(cp.ascontiguousarray(src.T), fmt, st, limits, transpose=True)
        return (q if order == "C" else q.T), st.scale_inv
