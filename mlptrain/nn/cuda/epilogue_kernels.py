"""DRELU(_BGRAD) and BGRADB's bias gradient in kernels of mlptrain's own, after a plain GEMM.

cuBLASLt fuses the forward's RELU_AUX_BIAS into its GEMM kernel, but on Hopper it runs the backward's
DRELU and DRELU_BGRAD (FP8 operands, and batched 16-bit operands: an ensemble's) as two kernels: the GEMM,
then an epilogue kernel (``cublasLt::epilogue::impl::globalKernel``) that applies the ReLU mask and sums
the bias gradient, and BGRADB's sum as a kernel of its own (``globalKernelBgradAB``). Those kernels take
several times what a pass over their bytes needs (docs/benchmarks.md: #30 has FP8's kernel table, #50 the
ensemble's). So the FP8 engine (:mod:`mlptrain.nn.cuda.fp8_gemm`) and the 16-bit engine's batched GEMMs and
single bf16 GEMMs of at least 2^31 multiply-adds, where cuBLASLt's epilogued GEMM is slower than the plain one
(:class:`mlptrain.nn.cuda.gemm.NvmathGemm`, ``execution.epilogue_kernels``; docs/benchmarks.md, "Epilogue
kernels, one model") run the GEMM without an epilog and finish it here::

    D  (M, N) bf16, column-major  = A @ B, one rounding              (the plain GEMM)
    D[m, n] = 0 where bit (m, n) of relu_aux is 0                     (DRELU, exact)
    db (M,) = sum over n of D[m, n], float32, rounded once to bf16   (DRELU_BGRAD's bias gradient)

which is the epilog contract exactly (:func:`mlptrain.nn.epilogs.matmul`: the product rounded to D's
type, then the epilog on the rounded values). Only the order of the float32 sum differs from NumPy's.

A batch of ``K`` GEMMs (an ensemble's members) is the same pass: member ``k``'s ``D (M, N)`` follows member
``k - 1``'s in memory, and so does its ``relu_aux (Mb, N)``, so the stack is one column-major ``(M, K * N)``
and its mask one ``(Mb, K * N)``; only the sums stop at each member's last column, giving ``db (K, M)``.

The same kernels, without a mask, sum the B operand of a weight-gradient GEMM over its rows: the bias
gradient that BGRADB computes (:func:`bgradb`; NOT_SUPPORTED with FP8 operands; CuPy's ``sum`` over the
non-contiguous axis is several times slower).

``mlptrain_drelu_partial``: a block of 32 x 8 threads owns 256 rows of D (8 a thread: one 16-byte load, one
byte of relu_aux) and a slab of one member's columns; it masks D in place and writes the slab's row sums to
``partial (K * S, M)`` float32. ``mlptrain_bgrad_finish`` sums each member's S slabs of each row, in order
(the same bits every replay), and rounds to bf16. A sum whose M is not a multiple of 8 (an output layer's
bias, ten classes) has no 16-byte rows: ``mlptrain_row_sums_warp`` gives each row a warp instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import cupy as cp
import numpy as np

SOURCE = r"""
// header-free: bf16 as its 16 bits
__device__ __forceinline__ float mlptrain_bf16_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float mlptrain_bf16_hi(unsigned int w) { return __uint_as_float(w & 0xFFFF0000u); }

// round to nearest even, NaN kept
__device__ __forceinline__ unsigned short mlptrain_to_bf16(float total) {
    const unsigned int u = __float_as_uint(total);
    const bool nan = (u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu);
    return nan ? (unsigned short)((u >> 16) | 0x0040u) : (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// K members' D, each (M, N) column-major, one after the other: column c of the stack (c < K * N) at d + c * M.
// Masked in place by relu_aux (Mb bytes a column, bit m % 8 of byte m / 8; null: D only summed, BGRADB's job).
// Block (x, y) with y = k * S + s: rows [256 x, 256 x + 256) of member k's columns [s * cols, (s + 1) * cols);
// partial[y * M + m] = their sum (partial null: DRELU alone, no sums).
extern "C" __global__ void mlptrain_drelu_partial(unsigned short* d, const unsigned char* aux, long long M,
                                                  long long N, long long Mb, long long cols, int S, float* partial) {
    __shared__ float sums[8][256];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long m0 = ((long long)blockIdx.x * 32 + tx) * 8;
    const long long member = blockIdx.y / S, slab = blockIdx.y % S;
    const long long first = member * N;  // the member's first column in the stack
    const long long n_begin = first + slab * cols;
    const long long n_end = slab * cols + cols < N ? n_begin + cols : first + N;
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
    if (!partial) return;  // (uniform over the block: no thread waits at the barrier below)
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

// db[k * M + m] = bf16(sum over s of partial[(k * S + s) * M + m]), member k's slabs in order
extern "C" __global__ void mlptrain_bgrad_finish(const float* partial, int S, long long M, long long K,
                                                 unsigned short* db) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= K * M) return;
    const long long k = i / M, m = i % M;
    float total = 0.f;
    for (int s = 0; s < S; ++s) total += partial[(k * S + s) * M + m];
    db[i] = mlptrain_to_bf16(total);
}

// db[k * M + m] = bf16(sum over n < N of d[(k * N + n) * M + m]): a warp a row, any M (no 16-byte loads);
// the lanes' partial sums added in a fixed tree (the same bits every replay)
extern "C" __global__ void mlptrain_row_sums_warp(const unsigned short* d, long long M, long long N, long long K,
                                                  unsigned short* db) {
    const long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (row >= K * M) return;  // (a whole warp: K * M rows, 32 lanes each)
    const long long k = row / M, m = row % M;
    float total = 0.f;
    for (long long n = lane; n < N; n += 32) total += __uint_as_float((unsigned int)d[(k * N + n) * M + m] << 16);
    for (int off = 16; off > 0; off >>= 1) total += __shfl_down_sync(0xFFFFFFFFu, total, off);
    if (lane == 0) db[row] = mlptrain_to_bf16(total);
}
"""

# Blocks enough to fill the H200's 132 SMs a few times over; the slabs split N to get there.
TARGET_BLOCKS = 4 * 132

# Where a bias gradient (the result) is allocated: ``alloc(size, dtype)``, or None for ``cupy.empty``. On the side
# stream of the weight gradients the caller passes one drawing from the main stream's free lists
# (:func:`mlptrain.nn.cuda.streams.results_allocator`). Only the result: the ``partial`` scratch is freed on return,
# while the stream that allocated it may still be reading it, which only that stream's own pool orders safely (a
# block handed back to the main stream's lists could be reused there before the side stream's finish kernel ran).
Alloc = Callable[[int, Any], Any] | None


@functools.cache
def module() -> Any:
    """The three kernels, one ``RawModule``."""
    return cp.RawModule(code=SOURCE)


def compile_ahead() -> None:
    """Compile the module with NVRTC before its first launch (a precompile job: :meth:`NvmathGemm.precompile_jobs`)."""
    for name in ("mlptrain_drelu_partial", "mlptrain_bgrad_finish", "mlptrain_row_sums_warp"):
        module().get_function(name)


def drelu(d: Any, relu_aux: Any, bgrad: bool = True, alloc: Alloc = None) -> Any:
    """Mask ``d`` in place with ``relu_aux`` (DRELU) and, with ``bgrad``, return its row sums (DRELU_BGRAD).

    ``d``: bfloat16 ``(M, N)`` column-major, or a batch ``(K, M, N)`` of column-major members one after the
    other; ``M`` a multiple of 8 (:func:`fits`). ``relu_aux``: the uint8 ``(Mb, N)`` column-major mask of
    :func:`mlptrain.nn.epilogs.relu_aux_shape` (a batch: ``(K, Mb, N)``, the members one after the other).
    Returns ``db (M,)`` (a batch: ``(K, M)``) in D's dtype, or None without ``bgrad``; ``alloc(size, dtype)``
    allocates it (default ``cupy.empty``; scratch comes from the current stream's pool either way: :data:`Alloc`)."""
    k, m, n = _members(d)
    mb = relu_aux.shape[-2]
    if relu_aux.shape[:-2] != d.shape[:-2] or relu_aux.shape[-1] != n or mb * 8 < m or not _stacked(relu_aux):
        raise ValueError(f"relu_aux {relu_aux.shape} is not the column-major mask of a {d.shape} result")
    if not fits(d):
        raise ValueError(
            f"the mask kernel needs a column-major bfloat16 (M, N), M a multiple of 8; got {d.dtype} {d.shape}"
        )
    db = _slab_sums(d, relu_aux, mb, k, m, n, bgrad, alloc or cp.empty)
    return None if db is None else db.reshape(d.shape[:-1])


def bgradb(b: Any, alloc: Alloc = None) -> Any:
    """BGRADB's bias gradient: ``b (Kd, N)`` (bfloat16, C order: a weight-gradient GEMM's B operand) summed over
    ``Kd`` in float32 and rounded to bf16, ``(N,)``; a batch ``(K, Kd, N)`` of C-order members gives ``(K, N)``.
    ``b`` is read, not written: as the column-major ``(N, Kd)`` it also is, its rows summed. ``alloc``: as
    :func:`drelu`'s."""
    t = b.swapaxes(-1, -2)  # (..., N, Kd) column-major
    k, m, n = _members(t)
    if b.dtype.name != "bfloat16" or not _stacked(t):
        raise ValueError(
            f"the bias-gradient kernel needs a C-order bfloat16 (Kd, N) or (K, Kd, N); got {b.dtype} {b.shape}"
        )
    if fits(t):
        db = _slab_sums(t, None, 0, k, m, n, True, alloc or cp.empty)
    else:  # N not a multiple of 8 (an output layer of ten classes): a warp a row
        db = (alloc or cp.empty)(k * m, b.dtype)
        warps = k * m
        module().get_function("mlptrain_row_sums_warp")(
            (-(-warps * 32 // 256),), (256,), (t, np.int64(m), np.int64(n), np.int64(k), db)
        )
    return db.reshape(t.shape[:-1])


def fits(d: Any) -> bool:
    """Whether ``d`` suits the 16-byte kernel: bfloat16, column-major members one after the other, 16-byte
    aligned, ``M`` a multiple of 8 (every column starts on a 16-byte boundary)."""
    return (
        d.dtype.name == "bfloat16"
        and d.ndim in (2, 3)
        and d.shape[-2] % 8 == 0
        and _stacked(d)
        and d.data.ptr % 16 == 0
    )


def _members(d: Any) -> tuple[int, int, int]:
    """``(K, M, N)`` of a ``(M, N)`` matrix (``K = 1``) or a ``(K, M, N)`` batch."""
    if d.ndim not in (2, 3):
        raise ValueError(f"expected an (M, N) matrix or a (K, M, N) batch; got shape {d.shape}")
    return (1, *d.shape) if d.ndim == 2 else tuple(d.shape)


def _stacked(a: Any) -> bool:
    """``a (..., M, N)`` is column-major with the members one after the other: the stack is one ``(M, K * N)``."""
    *lead, m, n = a.shape
    want = [a.itemsize, a.itemsize * m] if not lead else [a.itemsize * m * n, a.itemsize, a.itemsize * m]
    return all(s == w for s, w, size in zip(a.strides, want, a.shape, strict=True) if size > 1)


def _slab_sums(d: Any, relu_aux: Any, mb: int, k: int, m: int, n: int, bgrad: bool, alloc: Any) -> Any:
    """The partial kernel over ``K`` members' ``(M, N)``, then (``bgrad``) the finish: ``db (K * M,)`` (from
    ``alloc``) or None. ``partial`` is scratch: freed on return, so it must come from the current stream's pool."""
    row_blocks = -(-m // 256)
    slabs = max(1, min(-(-TARGET_BLOCKS // (row_blocks * k)), -(-n // 8)))  # per member
    cols = -(-n // slabs)
    slabs = -(-n // cols)  # no empty slab
    partial = cp.empty((k * slabs, m), dtype=cp.float32) if bgrad else None
    mask = relu_aux if relu_aux is not None else np.uint64(0)  # a null pointer: sum only
    out = partial if partial is not None else np.uint64(0)  # a null pointer: mask only
    args = (d, mask, np.int64(m), np.int64(n), np.int64(mb), np.int64(cols), np.int32(slabs), out)
    module().get_function("mlptrain_drelu_partial")((row_blocks, k * slabs), (32, 8), args)
    if partial is None:
        return None
    db = alloc(k * m, d.dtype)
    finish = module().get_function("mlptrain_bgrad_finish")
    finish((-(-k * m // 256),), (256,), (partial, np.int32(slabs), np.int64(m), np.int64(k), db))
    return db
