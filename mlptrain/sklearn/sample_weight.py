"""``sample_weight``: the estimators' row weights, checked as scikit-learn checks them, in the CLI's weighted loss.

``fit(X, y, sample_weight=w)`` trains on what ``data.weight=<column>`` trains on (:mod:`mlptrain.data.files.weights`):
the training split's weights travel with its rows (:attr:`mlptrain.data.dataset.Dataset.w_train`) and each step's
loss is ``sum_i w_i l_i / sum_i w_i`` over its batch (:func:`mlptrain.nn.losses.row_weighted`). Where the
estimators follow scikit-learn's MLP rather than the CLI (docs/sklearn.md "Sample weights"):

* ``alpha``'s penalty is relative to the weight of a step's rows, as scikit-learn's ``alpha / sw_sum``: the weight
  decay is ``alpha / (batch_size * mean(w))`` (:func:`decay_scale`), so integer weights train as the rows repeated
  ``w`` times would (a full batch: exactly; all ones: the unweighted decay, bit for bit);
* with ``early_stopping=True`` the held-out rows keep their weights and score by them (scikit-learn's weighted
  accuracy or R^2, as its MLP scores its validation split); the split itself ignores them, as scikit-learn's does.

``sample_weight=None`` is no weights at all: the fit is the unweighted one, step for step.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from mlptrain.base.errors import ConfigError
from mlptrain.data.dataset import Normalization
from mlptrain.data.prepare import normalization


def check_sample_weight(owner: str, sample_weight: Any, rows: int, ensemble_size: int = 1) -> np.ndarray | None:
    """``sample_weight`` as ``(rows,)`` float64, as scikit-learn's ``_check_sample_weight`` reads it (a number is every
    row's weight), after checking that the weights are finite, >= 0 and not all zero. None (no weights) and weights
    that are all 1 give None: the unweighted fit.

    Raises:
        ConfigError (a ValueError): one sentence naming what was given and what is expected; weights other than all
            ones for an ensemble (``ensemble_size > 1``), as ``ensemble.size > 1`` refuses ``data.weight`` (checked
            after the weights themselves: weights of one are no weights, which an ensemble takes).
    """
    if sample_weight is None:
        return None
    given = _given(sample_weight)
    if isinstance(sample_weight, numbers.Number) and not isinstance(sample_weight, bool):
        if isinstance(sample_weight, numbers.Complex) and not isinstance(sample_weight, numbers.Real):
            raise ConfigError(f"{owner} sample_weight={given}: complex weights; expected a real number >= 0")
        w = np.full(rows, float(sample_weight))  # type: ignore[arg-type]  # a Real here
    else:
        try:
            a = np.asarray(sample_weight)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{owner} sample_weight={given}: {exc}; expected ({rows},) numbers >= 0") from exc
        if a.dtype.kind not in "biuf":
            raise ConfigError(
                f"{owner} sample_weight={given} holds {a.dtype} values; expected ({rows},) real numbers >= 0"
            )
        if a.ndim != 1 or len(a) != rows:
            raise ConfigError(f"{owner} sample_weight has shape {a.shape}; expected ({rows},), one weight per row of X")
        w = a.astype(np.float64)  # a copy: the caller's array is never written
    bad = np.flatnonzero(~(np.isfinite(w) & (w >= 0)))
    if len(bad):
        raise ConfigError(
            f"{owner} sample_weight[{int(bad[0])}] = {w[bad[0]]}; sample weights must be finite numbers >= 0"
        )
    if not w.sum() > 0:
        raise ConfigError(f"{owner} sample_weight are all zero ({given}); at least one row must weigh more than zero")
    if np.all(w == 1.0):
        return None  # all ones: no weights, the unweighted fit bit for bit
    if ensemble_size != 1:
        raise ConfigError(
            f"{owner}(ensemble_size={ensemble_size}) does not take sample_weight yet (an ensemble trains without row "
            "weights, as ensemble.size > 1 refuses data.weight); pass sample_weight=None, or fit with ensemble_size=1"
        )
    return w


def train_normalization(method: str, x: np.ndarray, w: np.ndarray, *, seed: int, binary: Any) -> Normalization:
    """The normalisation of the training rows ``x (N, F)`` weighted by ``w (N,)``: what the rows repeated ``w`` times
    would give. ``standard``: the weighted mean and standard deviation (:func:`standardise`); ``minmax``: the
    extremes of the rows that weigh more than 0; ``robust``, ``quantile``: the percentiles of those rows, each
    counted once (not weighted). ``binary``: the column plan's 0/1 columns, as :func:`normalization` takes them."""
    if method == "standard":
        return standardise(x, w, binary)
    return normalization(method, x, np.flatnonzero(w > 0), seed=seed, binary=binary)


def standardise(a: np.ndarray, w: np.ndarray, binary: np.ndarray | None = None) -> Normalization:
    """``(a - mean) / std`` per column of ``a (N, F)`` with each row weighing ``w (N,)``: the weighted mean and the
    weighted population standard deviation (float64); a column constant over the rows of positive weight is shifted
    by its value and not scaled, and a ``binary`` column (the column plan's 0/1 columns) that varies stays 0/1, as
    the unweighted statistics (:meth:`mlptrain.data.files.column_stats.ColumnStats.shift_scale`) do."""
    kept = a[w > 0].astype(np.float64)  # (M, F): the rows that count
    mean = np.average(kept, axis=0, weights=w[w > 0])  # (F,)
    std = np.sqrt(np.average((kept - mean) ** 2, axis=0, weights=w[w > 0]))  # (F,)
    constant = kept.min(axis=0) == kept.max(axis=0)
    shift, scale = np.where(constant, kept[0], mean), np.where(constant | ~(std > 0), 1.0, std)
    if binary is not None:
        zero_one = binary & ~constant  # (F,)
        shift, scale = np.where(zero_one, 0.0, shift), np.where(zero_one, 1.0, scale)
    return Normalization("standard", shift, scale, "train split")


def decay_scale(w: np.ndarray | None) -> float:
    """The mean weight of a training row, ``mean(w)`` (1 without weights): the weight decay ``alpha / batch_size`` is
    divided by it, so that a step's penalty is ``alpha`` over the weight of its rows, as scikit-learn's
    ``alpha / sw_sum`` (exactly for a full batch; a minibatch's weight is taken as the average)."""
    return 1.0 if w is None else float(w.mean())


def _given(sample_weight: Any) -> str:
    """A short account of what was passed (its type and shape; a number: itself)."""
    if isinstance(sample_weight, numbers.Number):
        return repr(sample_weight)
    shape = getattr(sample_weight, "shape", None)
    if shape is None and isinstance(sample_weight, (list, tuple)):
        shape = (len(sample_weight),)
    return f"<{type(sample_weight).__name__}{'' if shape is None else f' of shape {tuple(shape)}'}>"
