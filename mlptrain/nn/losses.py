"""Losses: value, gradient of the logits, and the count of correct predictions, in one pass.

Written once with ``xp`` for NumPy and CuPy; on the GPU the cross-entropy of fp16, bf16 and fp32
logits runs as mlptrain's own kernels instead (:mod:`mlptrain.nn.cuda.losses`), with the same results.
Every function returns device arrays (0-d for scalars) and never reads them back to the host,
so a training step stays free of synchronisation. Half-precision logits are upcast to float32
for the loss; the gradient is cast back to the logits' dtype after multiplying by
``grad_scale`` (the dynamic loss scale in fp16, else 1).

:data:`LOSSES` registers each loss as a :class:`LossSpec`, named by ``model.loss``: a new loss is a
function with the signature of :func:`mse` (``bias_grad`` and ``inplace`` included), added there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlptrain.base.backend import get_array_module
from mlptrain.base.registry import Registry


def _loss_dtype(xp: Any, dtype: Any) -> Any:
    return xp.float64 if dtype == xp.float64 else xp.float32


def softmax_cross_entropy(
    logits: Any,
    y: Any,
    grad_scale: Any = 1.0,
    *,
    bias_grad: bool = False,
    inplace: bool = False,
    class_weight: Any = None,
    row_weight: Any = None,
) -> tuple:
    """Mean softmax cross-entropy of ``logits (B, C)`` against integer labels ``y (B,)``.

    Stable: ``log softmax(z) = z - max(z) - log(sum(exp(z - max(z))))``.

    Args:
        bias_grad: also return ``dlogits`` summed over the batch, ``(C,)`` in the logits' dtype:
            the output layer's bias gradient, which then needs no BGRADB epilog (on the GPU the
            loss kernel's reduction pass computes it; worthwhile for small ``B * C``, see
            :class:`mlptrain.nn.head.OutputHead`).
        inplace: write ``dlogits`` over ``logits`` and return that array: the training step needs the
            logits no more once the loss has read them, so their memory holds their gradient (a
            ``(B, C)`` array less at the step's peak; 0.25 GiB for 8192 classes at batch 16384 in fp16).
        class_weight: ``(C,)`` float32 device array (``model.class_weight``), or None: the plain mean (the
            code path of an unweighted run, unchanged). Weighted, row ``i`` counts ``w_i = class_weight[y_i]``
            and the loss is the weighted mean ``sum_i w_i l_i / sum_i w_i``, as torch's
            ``cross_entropy(weight=...)`` normalises it; ``dlogits = (softmax(z) - onehot(y)) * w_i *
            grad_scale / sum_i w_i``.
        row_weight: ``(B,)`` float32 weights of the batch's rows (a row weight column), or None; with
            ``class_weight`` too a row weighs ``class_weight[y_i] * row_weight_i``. A zero-weighted row counts
            for nothing: the loss of a batch whose other rows weigh 1 is their plain mean. On the GPU it runs as
            array operations (the fused kernels take class weights only).

    Returns:
        ``(loss, dlogits, correct)``: loss 0-d (float32 or float64), ``dlogits (B, C)`` =
        ``(softmax(z) - onehot(y)) * grad_scale / B`` in the logits' dtype, and the 0-d count of
        rows whose argmax equals the label; with ``bias_grad`` the sums as a fourth element.
    """
    xp = get_array_module(logits)
    if row_weight is not None:  # CPU or GPU, array operations
        return _weighted_cross_entropy(logits, y, grad_scale, bias_grad, inplace, class_weight, row_weight)
    if xp is not np and logits.dtype != xp.float64:  # fp16/bf16/fp32 on the GPU: one or two kernels
        if class_weight is not None:
            from mlptrain.nn.cuda.weighted_xent import weighted_cross_entropy_gpu

            return weighted_cross_entropy_gpu(logits, y, grad_scale, bias_grad, inplace, class_weight)
        from mlptrain.nn.cuda.losses import softmax_cross_entropy_gpu

        return softmax_cross_entropy_gpu(logits, y, grad_scale, bias_grad, inplace)
    if class_weight is not None:
        return _weighted_cross_entropy(logits, y, grad_scale, bias_grad, inplace, class_weight)
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
    return _with_gradient(loss, e, correct, logits, bias_grad, inplace)


def _weighted_cross_entropy(
    logits: Any, y: Any, grad_scale: Any, bias_grad: bool, inplace: bool, class_weight: Any, row_weight: Any = None
) -> tuple:
    """:func:`softmax_cross_entropy` with ``class_weight (C,)`` and/or ``row_weight (B,)``: the weighted mean, in
    the loss's dtype."""
    xp = get_array_module(logits)
    B, C = logits.shape
    dtype = _loss_dtype(xp, logits.dtype)
    z = logits.astype(dtype)  # (B, C)
    z -= z.max(axis=1, keepdims=True)
    e = xp.exp(z)
    s = e.sum(axis=1, keepdims=True)  # (B, 1)
    onehot = xp.arange(C)[None, :] == y[:, None]  # (B, C) bool
    w = class_weight.astype(dtype)[y] if class_weight is not None else xp.ones(B, dtype)  # (B,) each row's weight
    if row_weight is not None:
        w *= row_weight.astype(dtype)
    inv = 1.0 / w.sum()  # 0-d; a batch of zero-weighted rows gives inf here and a NaN loss, as torch's
    loss = ((xp.log(s[:, 0]) - (z * onehot).sum(axis=1)) * w).sum() * inv
    correct = (logits.argmax(axis=1) == y).sum()
    e /= s  # softmax
    e -= onehot
    e *= (w * inv)[:, None]  # (B, 1): the row's share of the weighted mean
    e *= grad_scale
    return _with_gradient(loss, e, correct, logits, bias_grad, inplace)


def class_weighted(class_weight: Any) -> Callable[..., tuple]:
    """:func:`softmax_cross_entropy` weighting each row by ``class_weight (C,)`` of its label (a float32 device
    array, uploaded once: ``model.class_weight``)."""
    return functools.partial(softmax_cross_entropy, class_weight=class_weight)


def class_weight_problem(spec: Any) -> str | None:
    """What is wrong with a ``model.class_weight`` setting before the classes are known, or None."""
    if spec is None or spec == "balanced":
        return None
    if isinstance(spec, str) or not hasattr(spec, "__len__"):
        return f"model.class_weight={spec!r} must be null, balanced or a list of one weight per class"
    bad = [w for w in spec if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0 or w == float("inf")]
    if bad:
        return f"model.class_weight={list(spec)}: {bad[0]!r} is not a weight; expected finite numbers >= 0"
    if not sum(spec) > 0:
        return f"model.class_weight={list(spec)} needs at least one weight above 0"
    return None


def class_weights(spec: Any, y_train: np.ndarray, classes: int) -> np.ndarray | None:
    """``model.class_weight`` as ``(classes,)`` float32, or None (``null``: the unweighted loss).

    ``balanced`` is scikit-learn's rule, ``n_samples / (n_classes * count_c)`` over the training labels
    ``y_train (N,)`` (``compute_class_weight("balanced")``); a class absent from them weighs 0 (it has no rows).
    A list gives one weight per class, in the classes' order.
    """
    if spec is None:
        return None
    if (problem := class_weight_problem(spec)) is not None:
        raise ValueError(problem)
    if spec == "balanced":
        counts = np.bincount(np.asarray(y_train, np.int64), minlength=classes).astype(np.float64)
        present = counts > 0
        w = np.zeros(classes)
        w[present] = len(y_train) / (present.sum() * counts[present])
        return w.astype(np.float32)
    if len(spec) != classes:
        raise ValueError(f"model.class_weight has {len(spec)} weights for {classes} classes; give one per class")
    return np.asarray(list(spec), np.float32)


def _with_gradient(loss: Any, g: Any, correct: Any, logits: Any, bias_grad: bool, inplace: bool) -> tuple:
    """``(loss, dlogits, correct[, db])`` with ``dlogits``, ``g`` in the logits' dtype (written over the logits
    when ``inplace``), and ``db`` its sum over the batch."""
    if inplace:
        logits[...] = g  # the same rounding as astype
        d = logits
    else:
        d = g.astype(logits.dtype, copy=False)
    if bias_grad:
        return loss, d, correct, g.sum(axis=0).astype(logits.dtype, copy=False)
    return loss, d, correct


def mse(
    logits: Any,
    y: Any,
    grad_scale: Any = 1.0,
    *,
    bias_grad: bool = False,
    inplace: bool = False,
    weight: Any = None,
    row_weight: Any = None,
) -> tuple:
    """Mean squared error of ``logits (B, C)`` against regression targets ``y (B, C)``, or against
    the one-hot encoding of class labels ``y (B,)``. ``bias_grad`` and ``inplace`` as for
    :func:`softmax_cross_entropy`.

    ``loss = mean over B and C of (z - t)^2``; ``dlogits = 2 (z - t) / (B C)``. ``correct`` counts
    the rows whose argmax is the label (classification); it is 0 for a regression.

    ``weight``: ``(C,)`` float32, the reported loss is ``mean of weight * (z - t)^2`` while the
    gradient stays that of the unweighted loss. With standardised targets (``t = (y - shift) /
    scale``) and ``weight = scale^2`` the loss is the MSE in the targets' own units,
    ``mean((z * scale + shift - y)^2)``, and the model still trains on the standardised problem.

    ``row_weight``: ``(B,)`` weights of the batch's rows (``data.weight``), or None. Weighted, the loss is
    ``sum_i w_i l_i / sum_i w_i`` with ``l_i`` row ``i``'s mean over ``C``, and ``dlogits = 2 (z - t) w_i /
    (C sum_i w_i)``: scikit-learn's ``mean_squared_error(sample_weight=w)``.
    """
    xp = get_array_module(logits)
    B, C = logits.shape
    z = logits.astype(_loss_dtype(xp, logits.dtype))
    if y.ndim == 2:  # regression targets
        z -= y  # residual (B, C)
        correct = xp.zeros((), dtype=xp.int64)
    else:
        z -= xp.arange(C)[None, :] == y[:, None]  # residual (B, C)
        correct = (logits.argmax(axis=1) == y).sum()
    if row_weight is not None:
        return _row_weighted_mse(z, row_weight, weight, grad_scale, correct, logits, bias_grad, inplace)
    loss = (z * z).mean() if weight is None else (z * z * weight).mean()  # (B, C) * (C,): in the targets' units
    z *= 2.0 * grad_scale / (B * C) if isinstance(grad_scale, float) else grad_scale * (2.0 / (B * C))
    return _with_gradient(loss, z, correct, logits, bias_grad, inplace)


def _row_weighted_mse(
    r: Any, row_weight: Any, weight: Any, grad_scale: Any, correct: Any, logits: Any, bias_grad: bool, inplace: bool
) -> tuple:
    """:func:`mse` of the residual ``r (B, C)`` with ``row_weight (B,)``: the weighted mean over the rows."""
    C = r.shape[1]
    w = row_weight.astype(r.dtype)  # (B,)
    inv = 1.0 / w.sum()  # 0-d; all rows weighing 0 give a NaN loss, as scikit-learn's division by 0 does
    sq = r * r if weight is None else r * r * weight  # (B, C)
    loss = (sq.mean(axis=1) * w).sum() * inv
    r *= (w * (inv * (2.0 / C)))[:, None]  # (B, 1): the row's share of the weighted mean
    r *= grad_scale
    return _with_gradient(loss, r, correct, logits, bias_grad, inplace)


def row_weighted(loss_fn: Callable[..., tuple], classification: bool) -> Callable[..., tuple]:
    """The training step's ``loss_fn`` for batches whose targets carry each row's weight (``data.weight``).

    The loaders hold a weighted split's targets as ``yw (N, 1 + T)`` float64
    (:func:`mlptrain.data.loader.with_weights`): the label (or the ``T`` targets), then the row's weight, so the
    weight is gathered with the batch in the same kernel and copies as ``y``. Here they are split again, on the
    device, and the loss takes the weights as ``row_weight`` (times ``model.class_weight`` where that is set too).
    """

    def weighted(logits: Any, yw: Any, grad_scale: Any = 1.0, **kw: Any) -> tuple:
        y, w = split_weights(yw, classification)
        return loss_fn(logits, y, grad_scale, row_weight=w, **kw)

    return weighted


def split_weights(yw: Any, classification: bool) -> tuple[Any, Any]:
    """``yw (B, 1 + T)`` -> ``(y, w)``: ``y (B,)`` int64 labels (classification) or ``(B, T)`` float32 targets, and
    ``w (B,)`` the rows' weights (a view)."""
    xp = get_array_module(yw)
    y = yw[:, 0].astype(xp.int64) if classification else yw[:, :-1].astype(xp.float32)
    return y, yw[:, -1]


def mse_in_units(scale: Any) -> Callable[..., tuple]:
    """:func:`mse` of standardised targets reported in their units: ``scale (C,)`` the targets' standard
    deviations on the device (``weight = scale^2``), the gradient that of the standardised loss."""
    return functools.partial(mse, weight=scale * scale)


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: ``fn(logits, y, grad_scale, *, bias_grad, inplace) -> (loss, dlogits, correct[, db])``.

    ``regression``: it trains on regression targets ``(B, C)`` too (a regression dataset needs such a
    loss). ``head_kernel``: the GPU's head kernel follows it (:mod:`mlptrain.nn.cuda.head`, the
    cross-entropy kernel only); any loss runs in the head's ``gemm`` and ``loss_bias`` modes.
    """

    fn: Callable[..., tuple]
    regression: bool = False
    head_kernel: bool = False


LOSSES: Registry[LossSpec] = Registry("model.loss")
LOSSES.add("cross_entropy", LossSpec(softmax_cross_entropy, head_kernel=True), "classification")
LOSSES.add("mse", LossSpec(mse, regression=True), "regression, or one-hot")


def regression_losses() -> list[str]:
    """The losses that take regression targets."""
    return [name for name, spec in LOSSES.items() if spec.regression]
