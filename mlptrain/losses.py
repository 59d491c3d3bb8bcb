"""Losses: value, gradient of the logits, and the count of correct predictions, in one pass.

Every function returns device arrays (0-d for scalars) and never reads them back to the host,
so a training step stays free of synchronisation. Half-precision logits are upcast to float32
for the loss; the gradient is cast back to the logits' dtype after multiplying by
``grad_scale`` (the dynamic loss scale in fp16, else 1).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from mlptrain.backend import get_array_module


def _loss_dtype(xp: Any, dtype: Any) -> Any:
    return xp.float64 if dtype == xp.float64 else xp.float32


def softmax_cross_entropy(logits: Any, y: Any, grad_scale: Any = 1.0) -> tuple[Any, Any, Any]:
    """Mean softmax cross-entropy of ``logits (B, C)`` against integer labels ``y (B,)``.

    Stable: ``log softmax(z) = z - max(z) - log(sum(exp(z - max(z))))``.

    Returns:
        ``(loss, dlogits, correct)``: loss 0-d (float32 or float64), ``dlogits (B, C)`` =
        ``(softmax(z) - onehot(y)) * grad_scale / B`` in the logits' dtype, and the 0-d count of
        rows whose argmax equals the label.
    """
    xp = get_array_module(logits)
    if xp is not np and logits.dtype != xp.float64:
        return _softmax_cross_entropy_cupy(logits, y, grad_scale)
    B, C = logits.shape
    z = logits.astype(_loss_dtype(xp, logits.dtype))  # (B, C), a copy we may overwrite
    z -= z.max(axis=1, keepdims=True)
    e = xp.exp(z)
    s = e.sum(axis=1, keepdims=True)  # (B, 1)
    onehot = xp.arange(C)[None, :] == y[:, None]  # (B, C) bool
    z_y = (z * onehot).sum(axis=1)  # (B,) the label's shifted logit
    loss = (xp.log(s[:, 0]) - z_y).mean()
    correct = (logits.argmax(axis=1) == y).sum()
    e /= s  # softmax
    e -= onehot
    e *= grad_scale / B if isinstance(grad_scale, float) else grad_scale * (1.0 / B)
    return loss, e.astype(logits.dtype, copy=False), correct


def _softmax_cross_entropy_cupy(logits: Any, y: Any, grad_scale: Any) -> tuple[Any, Any, Any]:
    """The same as the NumPy path in three passes over the logits (fp16/bf16/fp32 on the GPU).

    A chain of array operations reads and writes the (B, C) logits a dozen times in float32; at
    4096 classes and batch 8192 that costs more than a millisecond. Here: a row max, a row sum of
    exp in float32, then one elementwise kernel writing the scaled gradient in the logits' dtype.
    """
    import cupy as cp

    row_max, row_sumexp, grad, pick = _cupy_xent_kernels()
    B, C = logits.shape
    m = row_max(logits, axis=1)  # (B,) float32
    s = row_sumexp(logits, m[:, None], axis=1)  # (B,) sum of exp(z - max)
    scale = grad_scale if isinstance(grad_scale, cp.ndarray) else cp.asarray(grad_scale, dtype=cp.float64)
    d = cp.empty_like(logits)  # (B, C) C-order
    grad(logits, m[:, None], s[:, None], y[:, None], C, scale, 1.0 / B, d)
    z_y = pick(logits, y, C)  # (B,) float32: the label's logit
    loss = (cp.log(s) + m - z_y).mean()
    correct = (logits.argmax(axis=1) == y).sum()
    return loss, d, correct


@functools.cache
def _cupy_xent_kernels() -> tuple[Any, Any, Any, Any]:
    import cupy as cp

    row_max = cp.ReductionKernel(
        "T x", "float32 m", "(float)x", "max(a, b)", "m = a", "__int_as_float(0xff800000)", "mlptrain_row_max"
    )
    row_sumexp = cp.ReductionKernel(
        "T x, float32 m", "float32 s", "expf((float)x - m)", "a + b", "s = a", "0", "mlptrain_row_sumexp"
    )
    grad = cp.ElementwiseKernel(
        "T x, float32 m, float32 s, int64 y, int64 C, raw float64 scale, float64 inv_b",
        "T d",
        """
        const long long j = i % C;  // column of this element in the C-order (B, C) output
        const float p = expf((float)x - m) / s;  // softmax
        d = (T)((p - (j == y ? 1.0f : 0.0f)) * (float)(scale[0] * inv_b));
        """,
        "mlptrain_xent_grad",
    )
    pick = cp.ElementwiseKernel(
        "raw T x, int64 y, int64 C", "float32 z_y", "z_y = (float)x[i * C + y]", "mlptrain_pick_label_logit"
    )
    return row_max, row_sumexp, grad, pick


def mse(logits: Any, y: Any, grad_scale: Any = 1.0) -> tuple[Any, Any, Any]:
    """Mean squared error between ``logits (B, C)`` and the one-hot encoding of ``y (B,)``.

    ``loss = mean over B and C of (z - onehot)^2``; ``dlogits = 2 (z - onehot) / (B C)``.
    """
    xp = get_array_module(logits)
    B, C = logits.shape
    z = logits.astype(_loss_dtype(xp, logits.dtype))
    z -= xp.arange(C)[None, :] == y[:, None]  # residual (B, C)
    loss = (z * z).mean()
    correct = (logits.argmax(axis=1) == y).sum()
    z *= 2.0 * grad_scale / (B * C) if isinstance(grad_scale, float) else grad_scale * (2.0 / (B * C))
    return loss, z.astype(logits.dtype, copy=False), correct


LOSSES = {"cross_entropy": softmax_cross_entropy, "mse": mse}
