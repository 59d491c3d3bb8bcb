"""DRELU_BGRAD after an FP8 GEMM, and BGRADB's bias gradient, in kernels of mlptrain's own.

cuBLASLt plans DRELU_BGRAD with e4m3 x e5m2 operands, but on Hopper it runs as two kernels: the GEMM,
then an epilogue kernel (``cublasLt::epilogue::impl::globalKernel``) that applies the ReLU mask and
sums the bias gradient, and that kernel takes several times what a pass over its bytes needs
(docs/benchmarks.md, #30, has the kernel table). So the FP8 engine runs the input gradient's GEMM
without an epilog and finishes it here::

    D  (M, N) bf16, column-major  = dequantised (W8^T @ dZ8), one rounding  (the plain FP8 GEMM)
    D[m, n] = 0 where bit (m, n) of relu_aux is 0                            (the ReLU derivative, exact)
    db (M,) = sum over n of D[m, n], float32, rounded once to bf16          (the bias gradient)

which is :func:`mlptrain.nn.epilogs_fp8.matmul_fp8`'s contract exactly: the product rounded to D's type,
then the epilog of the 16-bit contract on the rounded values. Only the order of the float32 sum
differs from NumPy's.

The same kernels, without a mask, sum the gradient of a weight-gradient GEMM over the batch: the bias
gradient that BGRADB computes in 16 bits and that cuBLASLt refuses with FP8 operands
(:func:`column_sums`; CuPy's ``sum`` over the non-contiguous axis is several times slower).

``mlptrain_fp8_drelu_partial``: a block of 32 x 8 threads owns 256 rows of D (8 a thread: one 16-byte
load, one byte of relu_aux) and a slab of columns; it masks D in place and writes the slab's row
sums to ``partial (S, M)`` float32. ``mlptrain_fp8_bgrad_finish`` sums the S slabs of each row, in
order (the same bits every replay), and rounds to bf16.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp
import numpy as np

SOURCE = r"""
// header-free: bf16 as its 16 bits
__device__ __forceinline__ float mlptrain_bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float mlptrain_bf16_hi(unsigned int w) { return __uint_as_float(w & 0xFFFF0000u); }

// D (M, N) column-major, masked in place by relu_aux (Mb bytes a column, bit m % 8 of byte m / 8);
// partial[s * M + m] = the sum of D[m, n] over slab s's columns [s * cols, (s + 1) * cols)
// (aux null: no mask, D only summed: the bias gradient of a plain weight-gradient GEMM, BGRADB's job in 16 bits)
extern "C" __global__ void mlptrain_fp8_drelu_partial(unsigned short* d, const unsigned char* aux, long long M,
                                                      long long N, long long Mb, long long cols, float* partial) {
    __shared__ float sums[8][256];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long m0 = ((long long)blockIdx.x * 32 + tx) * 8;
    const long long n_begin = (long long)blockIdx.y * cols;
    const long long n_end = n_begin + cols < N ? n_begin + cols : N;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (m0 < M) {
        for (long long n = n_begin + ty; n < n_end; n += 8) {
            uint4* p = (uint4*)(d + n * M + m0);
            const unsigned int bits = aux ? aux[n * Mb + m0 / 8] : 0xFFu;
            uint4 v = *p;
            unsigned int w[4] = {v.x, v.y, v.z, v.w};
            for (int j = 0; j < 4; ++j) {  // elements 2j (low half) and 2j + 1 (high half)
                const unsigned int keep = ((bits >> (2 * j)) & 1u ? 0x0000FFFFu : 0u)
                                        | ((bits >> (2 * j + 1)) & 1u ? 0xFFFF0000u : 0u);
                w[j] &= keep;
                acc[2 * j] += mlptrain_bf16_lo(w[j]);
                acc[2 * j + 1] += mlptrain_bf16_hi(w[j]);
            }
            if (aux) *p = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
    for (int j = 0; j < 8; ++j) sums[ty][tx * 8 + j] = acc[j];
    __syncthreads();
    for (int i = ty * 32 + tx; i < 256; i += 256) {  // one thread a row: the 8 column groups, in order
        const long long m = (long long)blockIdx.x * 256 + i;
        if (m < M) {
            float total = 0.f;
            for (int g = 0; g < 8; ++g) total += sums[g][i];
            partial[blockIdx.y * M + m] = total;
        }
    }
}

// db[m] = bf16(sum over s of partial[s * M + m]), the slabs in order; round to nearest even, NaN kept
extern "C" __global__ void mlptrain_fp8_bgrad_finish(const float* partial, int S, long long M, unsigned short* db) {
    const long long m = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M) return;
    float total = 0.f;
    for (int s = 0; s < S; ++s) total += partial[s * M + m];
    const unsigned int u = __float_as_uint(total);
    const bool nan = (u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu);
    db[m] = nan ? (unsigned short)((u >> 16) | 0x0040u) : (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
"""

# Blocks enough to fill the H200's 132 SMs a few times over; the slabs split N to get there.
TARGET_BLOCKS = 4 * 132


@functools.cache
def module() -> Any:
    """The two kernels, one ``RawModule``."""
    return cp.RawModule(code=SOURCE)


def drelu_bgrad(d: Any, relu_aux: Any) -> Any:
    """Mask ``d (M, N)`` (bfloat16, column-major) in place with ``relu_aux`` and return its row sums ``db (M,)``.

    ``M`` must be a multiple of 8 (FP8 GEMMs take multiples of 16); ``relu_aux`` is the uint8
    ``(Mb, N)`` column-major mask of :func:`mlptrain.nn.epilogs.relu_aux_shape`."""
    mb = relu_aux.shape[0]
    m, n = d.shape
    if relu_aux.shape[1] != n or mb * 8 < m or not relu_aux.flags.f_contiguous:
        raise ValueError(f"relu_aux {relu_aux.shape} is not the column-major mask of a ({m}, {n}) result")
    return _row_sums(d, relu_aux, mb)


def column_sums(b: Any) -> Any:
    """``b (K, N)`` (bfloat16, C order) summed over K in float32 and rounded to bf16: ``(N,)``, the bias
    gradient BGRADB would give a 16-bit weight-gradient GEMM (NOT_SUPPORTED in FP8). ``b`` as the
    column-major ``(N, K)`` it also is, its rows summed."""
    return _row_sums(b.T, None, 0)


def _row_sums(d: Any, relu_aux: Any, mb: int) -> Any:
    m, n = d.shape
    if d.dtype.name != "bfloat16" or not d.flags.f_contiguous or m % 8 or d.data.ptr % 16:
        raise ValueError(
            f"the FP8 bias gradient needs a column-major bfloat16 (M, N), M a multiple of 8; got {d.dtype} {d.shape}"
        )
    row_blocks = -(-m // 256)
    slabs = max(1, min(-(-TARGET_BLOCKS // row_blocks), -(-n // 8)))
    cols = -(-n // slabs)
    slabs = -(-n // cols)  # no empty slab
    partial = cp.empty((slabs, m), dtype=cp.float32)
    mask = relu_aux if relu_aux is not None else np.uint64(0)  # a null pointer: sum only
    args = (d, mask, np.int64(m), np.int64(n), np.int64(mb), np.int64(cols), partial)
    module().get_function("mlptrain_fp8_drelu_partial")((row_blocks, slabs), (32, 8), args)
    db = cp.empty(m, dtype=d.dtype)
    finish = module().get_function("mlptrain_fp8_bgrad_finish")
    finish((-(-m // 256),), (256,), (partial, np.int32(slabs), np.int64(m), db))
    return db
