"""The class-weighted softmax cross-entropy on the GPU (``model.class_weight``): the weighted twins of
:mod:`mlptrain.nn.cuda.losses`' kernels.

The contract is :func:`mlptrain.nn.losses.softmax_cross_entropy` with ``class_weight``: row ``i`` weighs
``w_i = class_weight[y_i]``, the loss is ``sum_i w_i l_i / sum_i w_i`` and ``dlogits = (softmax - onehot) * w_i *
grad_scale / sum_i w_i``. ``mlptrain_xent_wsum`` (one block, a fixed-order float64 sum) first writes
``1 / sum_i w_i`` to the device; the twins, the unweighted kernels' source with the edits below, take it in place
of ``1 / B`` and scale each row by its weight. Nothing is read back to the host; the weights were uploaded once.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp

from mlptrain.nn.cuda.losses import device_scale, kernel_sources, small_head


def weighted_cross_entropy_gpu(
    logits: Any, y: Any, grad_scale: Any, bias_grad: bool, inplace: bool, class_weight: Any
) -> tuple:
    """:func:`softmax_cross_entropy_gpu` with ``class_weight (C,)``: the weighted mean ``sum w_i l_i / sum w_i``."""
    wsum, rows, mean = _weighted_kernels()
    B, C = logits.shape
    if not logits.flags.c_contiguous:
        if inplace:
            raise ValueError("an in-place loss gradient needs C-contiguous logits")
        logits = cp.ascontiguousarray(logits)
    scale = device_scale(grad_scale)
    y = y.astype(cp.int64, copy=False)  # (B,) labels
    w = class_weight.astype(cp.float32, copy=False)  # (C,)
    inv_w = cp.empty((), dtype=cp.float64)  # 1 / sum_i w[y_i], on the device
    wsum(y, w, B, C, inv_w, size=256, block_size=256)
    d = logits if inplace else cp.empty_like(logits)  # (B, C) C-order
    loss = cp.empty((), dtype=cp.float32)
    correct = cp.empty((), dtype=cp.int64)
    db = cp.empty(C if bias_grad else 1, dtype=logits.dtype)
    if small_head(B, C):
        small = _small_kernel(C)
        small(logits, y, scale, B, inv_w, w, bias_grad, d, loss, correct, db, size=1024, block_size=1024)
        return (loss, d, correct, db) if bias_grad else (loss, d, correct)
    row_loss = cp.empty(B, dtype=cp.float32)
    row_ok = cp.empty(B, dtype=cp.int32)
    rows(logits, y, scale, C, inv_w, w, d, row_loss, row_ok, size=B * 32, block_size=256)
    mean(row_loss, row_ok, d, B, C, inv_w, bias_grad, loss, correct, db, size=256, block_size=256)
    return (loss, d, correct, db) if bias_grad else (loss, d, correct)


_XENT_WSUM_PREP = r"""
__shared__ double acc_w[256];
double my_w = 0.0;
"""

_XENT_WSUM = r"""
for (long long r = i; r < B; r += 256) {
    const long long label = y[r];
    my_w += label >= 0 && label < C ? (double)w[label] : 0.0;
}
"""

_XENT_WSUM_AFTER = r"""
acc_w[threadIdx.x] = my_w;
__syncthreads();
for (int half = 128; half > 0; half >>= 1) {  // a fixed tree: the same sum on every run
    if (threadIdx.x < half) acc_w[threadIdx.x] += acc_w[threadIdx.x + half];
    __syncthreads();
}
if (threadIdx.x == 0) inv_w[0] = 1.0 / acc_w[0];
"""

# The weighted twins: (what the unweighted source says, what the weighted one says instead). Each row's
# gradient and loss carry w[label]; 1 / sum(w) (inv_w, on the device) takes the place of 1 / B.
_WEIGHTED_ROWS = (
    (
        "const float g = (float)(scale[0] * inv_b);  // loss scale / B\nfor",
        "const float g = (float)(scale[0] * inv_w[0] * (valid ? (double)w[label] : 0.0));  // scale w_i / sum w\nfor",
    ),
    ("valid ? logf(s) + m - x_label :", "valid ? (logf(s) + m - x_label) * w[label] :"),
)
_WEIGHTED_MEAN = (("loss[0] = (float)(acc_loss[0] / (double)B);", "loss[0] = (float)(acc_loss[0] * inv_w[0]);"),)
_WEIGHTED_SMALL = (
    (
        "const float g = (float)(scale[0] * inv_b);  // loss scale / B",
        "const float g0 = (float)(scale[0] * inv_w[0]);  // loss scale / sum w",
    ),
    (
        "const bool valid = label >= 0 && label < C;  // a bad label gives a NaN loss, not a stray read",
        "const bool valid = label >= 0 && label < C;  // a bad label gives a NaN loss, not a stray read\n"
        "    const float wr = valid ? w[label] : 0.0f;\n    const float g = g0 * wr;",
    ),
    ("(double)(logf(s) + m - z[base + label])", "(double)(logf(s) + m - z[base + label]) * (double)wr"),
    ("loss[0] = (float)(l / (double)B);", "loss[0] = (float)(l * inv_w[0]);"),
)


def _weighted_source(source: str, edits: tuple[tuple[str, str], ...]) -> str:
    """``source`` with each edit made; each must match exactly once (a changed kernel fails here, not silently)."""
    for old, new in edits:
        assert source.count(old) == 1, f"the weighted loss kernel's edit no longer matches: {old!r}"
        source = source.replace(old, new)
    return source


@functools.cache
def _weighted_kernels() -> tuple[Any, Any, Any]:
    """``mlptrain_xent_wsum`` and the weighted twins of ``mlptrain_xent_rows`` and ``mlptrain_xent_mean``."""
    src = kernel_sources()
    wsum = cp.ElementwiseKernel(
        "raw int64 y, raw float32 w, int64 B, int64 C",
        "raw float64 inv_w",
        _XENT_WSUM,
        "mlptrain_xent_wsum",
        loop_prep=_XENT_WSUM_PREP,
        after_loop=_XENT_WSUM_AFTER,
        no_return=True,
    )
    rows = cp.ElementwiseKernel(
        "raw T x, raw int64 y, raw float64 scale, int64 C, raw float64 inv_w, raw float32 w",
        "raw T d, raw float32 row_loss, raw int32 row_ok",
        _weighted_source(src["rows"], _WEIGHTED_ROWS),
        "mlptrain_xent_rows_w",
        no_return=True,
    )
    mean = cp.ElementwiseKernel(
        "raw float32 row_loss, raw int32 row_ok, raw T d, int64 B, int64 C, raw float64 inv_w, bool want_db",
        "raw float32 loss, raw int64 correct, raw T db",
        src["mean"],
        "mlptrain_xent_mean_w",
        loop_prep=src["mean_prep"],
        after_loop=_weighted_source(src["mean_after"], _WEIGHTED_MEAN),
        no_return=True,
    )
    return wsum, rows, mean


@functools.cache
def _small_kernel(classes: int) -> Any:
    """The weighted twin of ``mlptrain_xent_small`` for ``classes`` classes (``inv_w`` and ``w`` for ``inv_b``)."""
    src = kernel_sources()
    return cp.ElementwiseKernel(
        "raw T x, raw int64 y, raw float64 scale, int64 B, raw float64 inv_w, raw float32 w, bool want_db",
        "raw T d, raw float32 loss, raw int64 correct, raw T db",
        _weighted_source(src["small"], _WEIGHTED_SMALL),
        "mlptrain_xent_small_w",
        loop_prep=f"const int C = {classes};\n" + src["small_prep"],
        no_return=True,
        options=("--maxrregcount=64",),  # as the unweighted kernel's: 1024 threads a block
    )
