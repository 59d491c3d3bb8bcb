"""Losses: value, gradient of the logits, and the count of correct predictions, in one pass.

Every function returns device arrays (0-d for scalars) and never reads them back to the host,
so a training step stays free of synchronisation. Half-precision logits are upcast to float32
for the loss; the gradient is cast back to the logits' dtype after multiplying by
``grad_scale`` (the dynamic loss scale in fp16, else 1).
"""

from __future__ import annotations

from typing import Any

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
