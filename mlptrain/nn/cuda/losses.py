"""Softmax cross-entropy on the GPU: mlptrain's own kernels, one or two launches per step.

The contract is :func:`mlptrain.nn.losses.softmax_cross_entropy` (its NumPy path is the reference the
GPU tests hold these kernels to).
"""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp
import numpy as np

from mlptrain.base.backend import scalar
from mlptrain.nn.cuda.members import member_means


def small_head(batch: int, classes: int) -> bool:
    """Whether the GPU loss of ``(batch, classes)`` logits runs as one block (``mlptrain_xent_small``).

    The block holds the whole tile in shared memory (float32, at most 10,240 elements: 40 KiB of
    the 48 KiB a block may declare). There the output layer's bias gradient is nearly free (a
    tree over the block's rows), so the output head takes it from the loss instead of a BGRADB
    epilog (:class:`mlptrain.nn.head.OutputHead`). For larger heads the two-kernel path can sum it
    too, but one block summing many rows is slower than the epilog.
    """
    return batch <= 1024 and classes <= 32 and batch * classes <= 10240


@functools.cache
def _unit_scale(device: int) -> Any:
    """Evaluation's gradient scale, 1.0, on ``device``, made once and only read: copied from the host,
    where ``cp.asarray(1.0)`` would launch CuPy's fill kernel, one more to compile (issue #14)."""
    return scalar(cp, 1.0, np.float64)


def softmax_cross_entropy_gpu(logits: Any, y: Any, grad_scale: Any, bias_grad: bool, inplace: bool = False) -> tuple:
    """The same as the NumPy path in two kernels (fp16/bf16/fp32 logits on the GPU).

    With ``model.class_weight`` :mod:`mlptrain.nn.cuda.weighted_xent` runs these kernels' weighted twins instead.

    ``inplace``: ``dlogits`` is written over ``logits`` (each row's kernel reads every value of its
    row before it writes the row's gradient; the small-head kernel loads the whole tile first).

    A chain of array operations reads and writes the (B, C) logits a dozen times and launches a
    dozen kernels; in a replayed training step each launch costs as much as a small GEMM. Here:

    1. ``mlptrain_xent_rows``: one warp per row. Three passes over the row (max and argmax, sum of
       exp, then the gradient), all in float32 registers, warp shuffles for the row reductions:
       writes ``dlogits`` in the logits' dtype, the row's loss and whether its argmax is the label.
    2. ``mlptrain_xent_mean``: one block sums the B row losses (in float64) and correct flags, in
       a fixed order, so the loss is the same bit for bit on every run; with ``bias_grad`` it also
       sums ``dlogits`` over the batch (float32 accumulation, a fixed order too).

    A small head (:func:`small_head`: MNIST up to batch 1024) is one kernel,
    ``mlptrain_xent_small``: one block loads the whole ``(B, C)`` tile into shared memory with
    coalesced loads, one thread per row does the three passes there, the block stores ``dlogits``
    coalesced, and warp shuffles and a tree give the fixed-order sums. The tile in shared memory is
    faster than each thread reading its row from global memory (30 dependent loads of L2 latency a
    thread) and than holding the row in a 32-wide register array (with 1024 threads a block gets 64
    registers per thread); one kernel is faster than two (``benchmarks/probes/step_kernels.py --profile``; the
    times are in docs/benchmarks.md, "Figures moved out of the code").
    """
    rows, mean = _cupy_xent_kernels()
    B, C = logits.shape
    logits, y, scale, d = _operands(logits, y, grad_scale, inplace)  # d (B, C) C-order
    loss = cp.empty((), dtype=cp.float32)
    correct = cp.empty((), dtype=cp.int64)
    db = cp.empty(C if bias_grad else 1, dtype=logits.dtype)  # (C,): the output layer's bias gradient
    if small_head(B, C):  # MNIST-sized: everything in one block, one row per thread
        # 1024 threads even for a few rows: more threads share the tile's loads (faster than a block of 256)
        small = _xent_small_kernel(C)  # C compiled in: the loops over a row unroll
        small(logits, y, scale, B, 1.0 / B, bias_grad, d, loss, correct, db, size=1024, block_size=1024)
        return (loss, d, correct, db) if bias_grad else (loss, d, correct)
    row_loss = cp.empty(B, dtype=cp.float32)
    row_ok = cp.empty(B, dtype=cp.int32)
    rows(logits, y, scale, C, 1.0 / B, d, row_loss, row_ok, size=B * 32, block_size=256)
    mean(row_loss, row_ok, d, B, C, bias_grad, loss, correct, db, size=256, block_size=256)
    return (loss, d, correct, db) if bias_grad else (loss, d, correct)


def member_cross_entropy_gpu(logits: Any, y: Any, grad_scale: Any, inplace: bool = False, sums: Any = None) -> tuple:
    """An ensemble's loss (:class:`mlptrain.nn.members.MemberHead`): ``logits (K, B, C)`` (fp16/bf16/fp32) against
    ``y (K, B)``, each member's the single model's formulas; returns ``(loss (K,), dlogits (K, B, C), correct (K,))``.

    Two launches for any K, where the same formulas as array operations launch a dozen kernels over ``(K, B, C)``.
    First a row kernel over the K members' ``K * B`` rows (``1 / B`` each member's mean): up to
    :data:`THREAD_ROW_CLASSES` classes ``mlptrain_xent_thread_rows``, a thread a row, each row the formulas of the
    single model's one-block kernel ``mlptrain_xent_small`` in its order (so a member's rows are a single model's bit
    for bit where that model's batch takes that kernel, :func:`small_head`); above, ``mlptrain_xent_rows``, a warp a
    row. Then one block sums each member's rows into the ``(K,)`` losses (float32, the mean of the member's B row
    losses, summed in float64) and counts: ``mlptrain_member_means`` (:func:`mlptrain.nn.cuda.members.member_means`;
    with ``sums``, a :class:`~mlptrain.nn.cuda.members.MemberSums`, on its stream, beside the backward).
    """
    k, b, c = logits.shape
    logits, y, scale, d = _operands(logits, y, grad_scale, inplace)  # d (K, B, C)
    row_loss = cp.empty(k * b, dtype=cp.float32)
    row_ok = cp.empty(k * b, dtype=cp.int32)
    if c <= THREAD_ROW_CLASSES:  # a thread a row: a warp a row would leave 32 - C of its lanes idle
        _xent_thread_rows_kernel(c)(logits, y, scale, 1.0 / b, d, row_loss, row_ok, size=k * b)
    else:
        rows, _ = _cupy_xent_kernels()
        rows(logits, y, scale, c, 1.0 / b, d, row_loss, row_ok, size=k * b * 32, block_size=256)
    means = member_means if sums is None else sums.means
    loss, correct = means(row_loss, row_ok, k)  # (K,) float32, (K,) int64
    return loss, d, correct


def _operands(logits: Any, y: Any, grad_scale: Any, inplace: bool) -> tuple[Any, Any, Any, Any]:
    """``(logits, y, scale, d)`` as the row kernels take them: C-contiguous logits, int64 labels (the loader's are
    already), the gradient scale as a 0-d float64 device array, and where ``dlogits`` goes (over the logits with
    ``inplace``, which needs them C-contiguous)."""
    if not logits.flags.c_contiguous:
        if inplace:
            raise ValueError("an in-place loss gradient needs C-contiguous logits")
        logits = cp.ascontiguousarray(logits)
    d = logits if inplace else cp.empty_like(logits)
    return logits, y.astype(cp.int64, copy=False), device_scale(grad_scale), d


def device_scale(grad_scale: Any) -> Any:
    """The gradient scale as a 0-d float64 device array."""
    if isinstance(grad_scale, cp.ndarray):
        return grad_scale  # the training step's: the loss scaler's device array
    if float(grad_scale) == 1.0:
        return _unit_scale(cp.cuda.Device().id)  # evaluation's
    return scalar(cp, float(grad_scale), np.float64)


_XENT_ROWS = r"""
const long long row = i >> 5;  // one warp per row: lanes 0..31 stride over the C columns
const int lane = i & 31;
const long long base = row * C;
const long long label = y[row];
const bool valid = label >= 0 && label < C;  // a bad label gives a NaN loss, not a stray read
const float x_label = valid ? (float)x[base + label] : 0.0f;  // read before d (which may be x) is written
float m = __int_as_float(0xff800000);  // -inf, the running max; ties and NaN keep the first column, as numpy.argmax
long long am = C;
for (long long j = lane; j < C; j += 32) {
    const float v = (float)x[base + j];
    if (v > m || (v != v && m == m)) { m = v; am = j; }
}
for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
    const long long a2 = __shfl_xor_sync(0xffffffffu, am, off);
    if (m2 > m || (m2 != m2 && m == m) || ((m2 == m || (m2 != m2 && m != m)) && a2 < am)) { m = m2; am = a2; }
}
float s = 0.0f;
for (long long j = lane; j < C; j += 32) s += expf((float)x[base + j] - m);
for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
const float g = (float)(scale[0] * inv_b);  // loss scale / B
for (long long j = lane; j < C; j += 32) {
    const float p = expf((float)x[base + j] - m) / s;  // softmax
    d[base + j] = (T)((p - (j == label ? 1.0f : 0.0f)) * g);
}
if (lane == 0) {
    row_loss[row] = valid ? logf(s) + m - x_label : __int_as_float(0x7fc00000);
    row_ok[row] = am == label;
}
"""

THREAD_ROW_CLASSES = 16  # up to this many classes the members' rows run a thread a row (the logits in registers)

_XENT_THREAD_ROWS = r"""
// Thread i: row i of the K * B rows, its C logits in registers (read before d, which may be x, is written); the
// passes and their order are mlptrain_xent_small's for one row: a member's row gives that kernel's bits.
const long long base = i * C;
const long long label = y[i];
const bool valid = label >= 0 && label < C;  // a bad label gives a NaN loss, not a stray read
float v[C];
#pragma unroll
for (int j = 0; j < C; ++j) v[j] = (float)x[base + j];
float m = __int_as_float(0xff800000);  // -inf; ties and NaN keep the first column, as numpy.argmax
int am = 0;
#pragma unroll
for (int j = 0; j < C; ++j) if (v[j] > m || (v[j] != v[j] && m == m)) { m = v[j]; am = j; }
float s = 0.0f;
#pragma unroll
for (int j = 0; j < C; ++j) s += expf(v[j] - m);
float x_label = 0.0f;
#pragma unroll
for (int j = 0; j < C; ++j) if (j == label) x_label = v[j];  // (a register array indexed by constants only)
const float g = (float)(scale[0] * inv_b);  // loss scale / B
#pragma unroll
for (int j = 0; j < C; ++j) d[base + j] = (T)((expf(v[j] - m) / s - (j == label ? 1.0f : 0.0f)) * g);
row_loss[i] = valid ? logf(s) + m - x_label : __int_as_float(0x7fc00000);
row_ok[i] = am == label;
"""

_XENT_MEAN_PREP = r"""
__shared__ double acc_loss[256];
__shared__ long long acc_ok[256];
__shared__ float acc_db[256];
double my_loss = 0.0;
long long my_ok = 0;
"""

_XENT_MEAN = r"""
for (long long r = i; r < B; r += 256) { my_loss += (double)row_loss[r]; my_ok += row_ok[r]; }
"""

_XENT_MEAN_AFTER = r"""
acc_loss[threadIdx.x] = my_loss;
acc_ok[threadIdx.x] = my_ok;
__syncthreads();
for (int half = 128; half > 0; half >>= 1) {  // a fixed tree: the same sum on every run
    if (threadIdx.x < half) {
        acc_loss[threadIdx.x] += acc_loss[threadIdx.x + half];
        acc_ok[threadIdx.x] += acc_ok[threadIdx.x + half];
    }
    __syncthreads();
}
if (threadIdx.x == 0) { loss[0] = (float)(acc_loss[0] / (double)B); correct[0] = acc_ok[0]; }
if (want_db) {  // db[c] = sum over rows of d[r, c]
    const int t = threadIdx.x;
    if (C <= 256) {  // R groups of C threads; group g sums rows g, g + R, ...; then each column's R partials
        const int R = 256 / (int)C;
        float part = 0.0f;
        if (t < R * C) for (long long r = t / C; r < B; r += R) part += (float)d[r * C + t % C];
        acc_db[t] = part;
        __syncthreads();
        if (t < C) {
            float s = 0.0f;
            for (int g = 0; g < R; ++g) s += acc_db[g * C + t];
            db[t] = (T)s;
        }
    } else {
        for (long long c = t; c < C; c += 256) {
            float s = 0.0f;
            for (long long r = 0; r < B; ++r) s += (float)d[r * C + c];
            db[c] = (T)s;
        }
    }
}
"""


_XENT_SMALL_PREP = r"""
__shared__ float z[10240];       // the (B, C) logits, then their gradient, float32: B * C <= 10240
__shared__ float acc_db[1024];   // column-sum partials of the bias gradient
__shared__ double warp_loss[32];
__shared__ int warp_ok[32];
"""

_XENT_SMALL = r"""
// One block of N = 1024 threads; this body runs once per thread.
const int t = threadIdx.x;
const int n = (int)(B * C);
const int N = 1024;
// every global load first, so their latencies overlap: the label, the scale, the whole tile
// (coalesced, at most 10240 / 1024 = 10 loads a thread, all issued before any is used)
const long long label = t < B ? y[t] : 0;
const float g = (float)(scale[0] * inv_b);  // loss scale / B
float tile[10];
#pragma unroll
for (int q = 0; q < 10; ++q) tile[q] = t + q * N < n ? (float)x[t + q * N] : 0.0f;
#pragma unroll
for (int q = 0; q < 10; ++q) if (t + q * N < n) z[t + q * N] = tile[q];
__syncthreads();
double my_loss = 0.0;
int my_ok = 0;
if (t < B) {  // thread t: row t, the three passes of mlptrain_xent_rows, from shared memory
    const int base = t * (int)C;
    float m = __int_as_float(0xff800000);  // -inf; ties and NaN keep the first column, as numpy.argmax
    int am = 0;
#pragma unroll
    for (int j = 0; j < C; ++j) {
        const float v = z[base + j];
        if (v > m || (v != v && m == m)) { m = v; am = j; }
    }
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < C; ++j) s += expf(z[base + j] - m);
    const bool valid = label >= 0 && label < C;  // a bad label gives a NaN loss, not a stray read
    my_loss = valid ? (double)(logf(s) + m - z[base + label]) : (double)__int_as_float(0x7fc00000);
    my_ok = am == label;
#pragma unroll
    for (int j = 0; j < C; ++j) {  // the gradient, rounded to T here so db sums what d holds
        z[base + j] = (float)(T)((expf(z[base + j] - m) / s - (j == label ? 1.0f : 0.0f)) * g);
    }
}
__syncthreads();
for (int k = t; k < n; k += N) d[k] = (T)z[k];  // coalesced store of dlogits
// loss and correct: a fixed shuffle tree per warp, then warp 0 over the warp sums (same sum every run)
for (int off = 16; off > 0; off >>= 1) {
    my_loss += __shfl_down_sync(0xffffffffu, my_loss, off);
    my_ok += __shfl_down_sync(0xffffffffu, my_ok, off);
}
if ((t & 31) == 0) { warp_loss[t >> 5] = my_loss; warp_ok[t >> 5] = my_ok; }
__syncthreads();
if (t < 32) {  // N / 32 warps wrote partials
    double l = t < (N >> 5) ? warp_loss[t] : 0.0;
    int o = t < (N >> 5) ? warp_ok[t] : 0;
    for (int off = 16; off > 0; off >>= 1) {
        l += __shfl_down_sync(0xffffffffu, l, off);
        o += __shfl_down_sync(0xffffffffu, o, off);
    }
    if (t == 0) { loss[0] = (float)(l / (double)B); correct[0] = o; }
}
if (want_db) {  // db[c] = sum over rows of d[r, c]: R groups of C threads, then a tree over the groups
    int R = 1;
    while (2 * R * C <= N) R *= 2;
    const int c = t % (int)C, grp = t / (int)C;
    float part = 0.0f;
    if (grp < R) for (int r = grp; r < B; r += R) part += z[r * (int)C + c];
    acc_db[t] = part;
    __syncthreads();
    for (int h = R / 2; h > 0; h >>= 1) {
        if (grp < h) acc_db[t] += acc_db[t + h * (int)C];
        __syncthreads();
    }
    if (t < C) db[t] = (T)acc_db[t];
}
"""


def kernel_sources() -> dict[str, str]:
    """The CUDA source of the kernels below, by name: what :mod:`mlptrain.nn.cuda.weighted_xent` edits."""
    return {
        "rows": _XENT_ROWS,
        "mean_prep": _XENT_MEAN_PREP,
        "mean": _XENT_MEAN,
        "mean_after": _XENT_MEAN_AFTER,
        "small_prep": _XENT_SMALL_PREP,
        "small": _XENT_SMALL,
    }


@functools.cache
def _cupy_xent_kernels() -> tuple[Any, Any]:
    rows = cp.ElementwiseKernel(
        "raw T x, raw int64 y, raw float64 scale, int64 C, float64 inv_b",
        "raw T d, raw float32 row_loss, raw int32 row_ok",
        _XENT_ROWS,
        "mlptrain_xent_rows",
        no_return=True,
    )
    mean = cp.ElementwiseKernel(
        "raw float32 row_loss, raw int32 row_ok, raw T d, int64 B, int64 C, bool want_db",
        "raw float32 loss, raw int64 correct, raw T db",
        _XENT_MEAN,
        "mlptrain_xent_mean",
        loop_prep=_XENT_MEAN_PREP,
        after_loop=_XENT_MEAN_AFTER,
        no_return=True,
    )
    return rows, mean


@functools.cache
def _xent_thread_rows_kernel(classes: int) -> Any:
    """``mlptrain_xent_thread_rows`` for ``classes`` classes (a compile-time constant: the loops unroll)."""
    return cp.ElementwiseKernel(
        "raw T x, raw int64 y, raw float64 scale, float64 inv_b",
        "raw T d, raw float32 row_loss, raw int32 row_ok",
        _XENT_THREAD_ROWS,
        "mlptrain_xent_thread_rows",
        loop_prep=f"const int C = {classes};",
        no_return=True,
    )


@functools.cache
def _xent_small_kernel(classes: int) -> Any:
    """``mlptrain_xent_small`` for ``classes`` classes, a compile-time constant (one per model)."""
    return cp.ElementwiseKernel(
        "raw T x, raw int64 y, raw float64 scale, int64 B, float64 inv_b, bool want_db",
        "raw T d, raw float32 loss, raw int64 correct, raw T db",
        _XENT_SMALL,
        "mlptrain_xent_small",
        loop_prep=f"const int C = {classes};\n" + _XENT_SMALL_PREP,
        no_return=True,
        # a block of 1024 threads leaves 64 registers a thread; CuPy's kernels carry no launch
        # bounds, so unrolled over 32 classes NVRTC takes more and the launch would fail
        # (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES); capped, it spills instead
        options=("--maxrregcount=64",),
    )
