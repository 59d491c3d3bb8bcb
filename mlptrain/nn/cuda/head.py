"""The output layer's input gradient as one small kernel (GPU, small heads).

For an MNIST-sized head the output layer's input-gradient GEMM is tiny and awkward::

    dZ_below^T (H, B) = W^T (H, C) @ dlogits^T (C, B),  DRELU_BGRAD with relu_aux of the layer below

K = C = 10: ten products per element. cuBLASLt has no fused kernel for DRELU_BGRAD at that K: it
runs a GEMM, a memset and a separate epilogue kernel, on the critical path of the step
(``benchmarks/probes/step_kernels.py --gemm-head --profile``; the times are in docs/benchmarks.md, "Figures
moved out of the code").

``mlptrain_head_dgrad`` does the same work in one launch. Block ``j`` owns hidden
columns ``8 j .. 8 j + 7`` of ``dZ_below (B, H)``: exactly one byte of relu_aux per row, because
element ``(h, b)`` of the mask is bit ``h % 8`` of byte ``h // 8`` of column ``b``
(:mod:`mlptrain.nn.epilogs`). Its 512 threads are 64 rows x 8 columns; thread ``t`` takes column
``t % 8`` of rows ``t // 8``, ``t // 8 + 64``, ...:

1. every global load is issued before any is used: the thread's column of ``W`` (C values, into
   registers), the mask bytes of its first eight rows, and its share of ``dlogits``, which the
   block stages in shared memory as float32;
2. per row, a float32 dot product of length C, as cuBLASLt accumulates; C is a compile-time
   constant (one kernel per class count), so the loop unrolls exactly;
3. kept where the row's mask bit is set (dReLU), rounded to the compute dtype and stored;
4. the block sums each column over the rows in a fixed tree: the bias gradient of the layer
   below, what DRELU_BGRAD returns. The sums stay inside the block, so no atomics, and the same
   bits every run.

The contract is the GEMM it replaces, ``FusedExecution.input_grad`` with DRELU_BGRAD (or DRELU),
which is how the CPU (and ``execution.head_kernel=false``) computes it and what the GPU tests
hold the kernel to. On random fp16 operands of (256, 10, 1024) it matched cuBLASLt bit for bit.

Where it enters the backward: :meth:`mlptrain.nn.head.OutputHead.grads` calls it (head mode
``kernel``) with the loss, and ``MLP._input_grad`` (``nn/network.py``) takes its ``dZ_below`` in place
of the output layer's :meth:`mlptrain.nn.layers.Linear.grad_below`. An ensemble's members take the
same kernel's arithmetic in one launch: :mod:`mlptrain.nn.cuda.member_head`.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp

from mlptrain.nn.cuda.losses import small_head
from mlptrain.nn.epilogs import relu_aux_shape

COLUMNS_PER_BLOCK = 8  # one relu_aux byte per row
THREADS = 512  # 64 rows per pass of a block of 8 columns; larger batches take several
MAX_CLASSES = 32  # a column of W is held in registers


def head_kernel_applies(batch: int, classes: int) -> bool:
    """Whether the kernel can take the output layer's input gradient of ``(batch, classes)`` logits.

    Only for the heads where the loss is one block too (:func:`mlptrain.nn.cuda.losses.small_head`):
    there the GEMM is latency, not work. :class:`mlptrain.nn.head.OutputHead` decides whether to use it.
    """
    return small_head(batch, classes) and classes <= MAX_CLASSES


def head_input_grad(dlogits: Any, W: Any, relu_aux: Any, *, bias_grad_below: bool = True) -> tuple[Any, Any]:
    """``dZ_below = (dlogits @ W) * relu'(Z_below)``, and its sum over the batch, in one kernel.

    Args:
        dlogits: ``(B, C)`` loss gradient of the logits, C-contiguous, compute dtype.
        W: ``(C, H)`` the output layer's weight in the compute dtype, C-contiguous.
        relu_aux: the layer below's ReLU mask from RELU_AUX_BIAS, uint8 ``(Mb, B)`` column-major.
        bias_grad_below: also return ``dZ_below`` summed over the batch (the bias gradient of
            the layer below), as DRELU_BGRAD does.

    Returns:
        ``(dz_below (B, H), db_below (H,) or None)`` in the compute dtype.

    Raises:
        ValueError: shapes, dtypes or layouts that do not fit together, naming them.
    """
    if dlogits.ndim != 2 or not dlogits.flags.c_contiguous:
        raise ValueError(f"dlogits must be a C-contiguous (batch, classes) array; got shape {dlogits.shape}")
    B, C = dlogits.shape
    if not head_kernel_applies(B, C):
        raise ValueError(f"the head kernel takes B <= 1024, C <= 32 and B * C <= 10240; got dlogits {dlogits.shape}")
    if W.ndim != 2 or W.shape[0] != C or W.dtype != dlogits.dtype or not W.flags.c_contiguous:
        raise ValueError(
            f"the output weight must be C-contiguous ({C}, hidden) {dlogits.dtype} for dlogits {dlogits.shape}; "
            f"got {W.dtype} {W.shape}{'' if W.flags.c_contiguous else ' (not C-contiguous)'}"
        )
    H = W.shape[1]
    expected = relu_aux_shape(H, B)
    mb = expected[0]
    if relu_aux.dtype != cp.uint8 or relu_aux.shape != expected or relu_aux.strides != (1, mb):
        raise ValueError(
            f"relu_aux must be uint8 {expected} column-major (strides (1, {mb})) for {H} hidden units and "
            f"batch {B}; got {relu_aux.dtype} {relu_aux.shape} strides {relu_aux.strides}"
        )
    dz = cp.empty((B, H), dtype=dlogits.dtype)  # (B, H) == the column-major (H, B) DRELU result
    db = cp.empty(H if bias_grad_below else 1, dtype=dlogits.dtype)
    blocks = -(-H // COLUMNS_PER_BLOCK)
    # flat views, no copies: relu_aux.T is the C-order (B, Mb) array of its memory
    args = (dlogits.reshape(-1), W.reshape(-1), relu_aux.T.reshape(-1), B, H, mb, bias_grad_below, dz.reshape(-1), db)
    dgrad_kernel(C)(*args, size=blocks * THREADS, block_size=THREADS)
    return dz, (db if bias_grad_below else None)


def _head_source(classes: int, cols: int, threads: int) -> tuple[str, str]:
    """``(loop_prep, body)`` of the kernel for ``classes`` (a compile-time constant, so the loops
    over it unroll exactly), blocks of ``cols`` columns and ``threads`` threads."""
    prep = f"""
const int C = {classes};        // K of the product: the loops over it unroll
const int COLS = {cols};        // columns per block: a warp stores {32 // cols} row(s) x {cols} neighbouring columns
const int NT = {threads};       // threads per block
__shared__ float dls[{10240 // classes * classes}];  // dlogits as float32 (B * C <= 10240)
__shared__ float red[{threads}];  // the bias-gradient partials
"""
    return prep, _HEAD_BODY


_HEAD_BODY = r"""
const int t = threadIdx.x, col = t % COLS, sub = t / COLS;  // sub: this thread's row within a pass
const int PASS = NT / COLS;                                 // rows per pass of the block
const long long h = (long long)blockIdx.x * COLS + col;
const bool in = h < H;
const int n = (int)B * C;
// every global load issued before any is used: W's column h, the first rows' mask bytes, dlogits
float wc[C];
#pragma unroll
for (int c = 0; c < C; ++c) wc[c] = in ? (float)W[c * H + h] : 0.0f;
const long long byte = h >> 3;
const int bit = (int)(h & 7);
unsigned char m[8];
#pragma unroll
for (int q = 0; q < 8; ++q) m[q] = sub + q * PASS < B && in ? aux[(sub + q * PASS) * Mb + byte] : 0;
for (int k0 = 0; k0 < n; k0 += 8 * NT) {  // dlogits into shared memory, 8 loads a thread in flight
    float v[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] = k0 + q * NT + t < n ? (float)d[k0 + q * NT + t] : 0.0f;
#pragma unroll
    for (int q = 0; q < 8; ++q) if (k0 + q * NT + t < n) dls[k0 + q * NT + t] = v[q];
}
__syncthreads();
float part = 0.0f;  // this thread's share of db_below[h]
for (int r0 = sub; r0 < B; r0 += 8 * PASS) {  // 8 rows a thread at a time
    if (r0 != sub) {  // the next 8 rows' mask bytes (the first 8 came with the loads above)
#pragma unroll
        for (int q = 0; q < 8; ++q) m[q] = r0 + q * PASS < B && in ? aux[(r0 + q * PASS) * Mb + byte] : 0;
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        const int r = r0 + q * PASS;
        if (r < B && in) {
            const float* z = dls + r * C;
            float acc = 0.0f;  // dZ[r, h] = sum over c of dlogits[r, c] W[c, h], float32
#pragma unroll
            for (int c = 0; c < C; ++c) acc = fmaf(z[c], wc[c], acc);
            const T v = (T)(((m[q] >> bit) & 1) ? acc : 0.0f);  // dReLU of the layer below
            dzb[r * H + h] = v;
            part += (float)v;  // sum what dzb holds
        }
    }
}
if (want_db) {  // a fixed tree over the PASS partials of each column
    red[t] = part;
    __syncthreads();
    for (int s = NT / 2; s >= COLS; s >>= 1) {
        if (t < s) red[t] += red[t + s];
        __syncthreads();
    }
    if (t < COLS && in) db[h] = (T)red[t];
}
"""


def compile_ahead(weight: tuple[int, int], dtype: Any, rows: list[int], *, bias_grad_below: bool) -> None:
    """:func:`head_input_grad` for an output weight of shape ``weight`` (C, H) and each training batch of ``rows``,
    on zeros: the job :meth:`mlptrain.nn.head.OutputHead.precompile_jobs` declares."""
    w = cp.zeros(weight, dtype)  # (C, H)
    for r in rows:
        aux = cp.zeros(relu_aux_shape(w.shape[1], r)[::-1], cp.uint8).T  # (Mb, B) column-major, as RELU_AUX_BIAS
        head_input_grad(cp.zeros((r, w.shape[0]), w.dtype), w, aux, bias_grad_below=bias_grad_below)


@functools.cache
def dgrad_kernel(classes: int, cols: int = COLUMNS_PER_BLOCK, threads: int = THREADS) -> Any:
    """The kernel for ``classes`` classes (compiled once per class count; a model has one)."""
    prep, body = _head_source(classes, cols, threads)
    return cp.ElementwiseKernel(
        "raw T d, raw T W, raw uint8 aux, int64 B, int64 H, int64 Mb, bool want_db",
        "raw T dzb, raw T db",
        body,
        "mlptrain_head_dgrad",
        loop_prep=prep,
        no_return=True,
        options=(f"--maxrregcount={min(255, 65536 // threads)}",),  # a full block shares the register file
    )
