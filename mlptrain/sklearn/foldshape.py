"""Folds of other shapes as the members of one batched run (:mod:`mlptrain.sklearn.crossval`).

The batched run stacks its members' parameters, ``W_0 (K, H, F)`` ... ``W_last (K, C, H)``, so every member has one
shape. A fold's own fit may have another:

* fewer input columns, ``F_k < F``: a DataFrame fold whose training rows lack a level (or an empty cell) that
  another fold's have encodes to fewer columns. Its rows get ``F - F_k`` columns of zeros appended (:func:`padded`);
  the first layer's weights on them get no gradient from the loss (only ``alpha``'s decay: they multiply zeros);
* fewer classes, ``C_k < C``: a fold whose training rows lack a class of ``y`` (``GroupKFold`` on imbalanced labels).
  Its targets are renumbered among the ``C`` classes (:func:`relabelled`), so it trains with an output for every
  class, the missing ones never a target.

:func:`own_shape` then cuts the member's state back to the fold's own ``(F_k, ..., C_k)``: the weights on the zero
columns and the output rows of the missing classes dropped, so that its fitted estimator takes its own plan's columns
and has its own ``classes_``. Such a fold is the single run of its rows so widened, bit for bit on the CPU, not its
own fit: its initial weights are drawn for the wider layers, and while it trained its softmax had the missing classes'
outputs. :func:`all_classes` puts a fold's probabilities in the columns of all the classes, as scikit-learn's
``cross_val_predict`` does for a fold without a class (0, or the float minimum for log probabilities, and its warning).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np


def padded(ds: Any, width: int) -> Any:
    """The fold's dataset ``ds`` with columns of zeros appended to its rows up to ``width`` (its normalisation, names
    and plan stay its own: :meth:`~mlptrain.data.dataset.Dataset.preprocessing` gives the fold's own)."""
    xs = {f"x_{s}": getattr(ds, f"x_{s}") for s in ("train", "val", "test")}
    return dataclasses.replace(ds, **{n: np.pad(x, ((0, 0), (0, width - x.shape[1]))) for n, x in xs.items()})


def relabelled(ds: Any, keep: np.ndarray, classes: int) -> Any:
    """The fold's dataset ``ds`` (targets ``0 .. C_k - 1``, its own classes) with target ``j`` renumbered ``keep[j]``
    among ``classes`` outputs (``keep (C_k,)``: the positions of its classes among all of ``y``'s)."""
    ys = {f"y_{s}": keep[getattr(ds, f"y_{s}")] for s in ("train", "val", "test")}
    return dataclasses.replace(ds, num_classes=classes, **ys)


def own_shape(
    arrays: dict[str, np.ndarray], widths: list[int], columns: int, keep: np.ndarray | None
) -> tuple[dict[str, np.ndarray], list[int]]:
    """A member's state ``arrays`` (``param/...``, ``optim/...``: its slices, of a run of ``widths``) cut to the fold's
    own shape: the first layer's first ``columns`` input columns, and the last layer's output rows ``keep`` (the
    fold's classes among all; None: every output). Returns the arrays and the fold's widths."""
    last = f"layer{len(widths) - 2}."
    out = {}
    for name, a in arrays.items():
        layer = name.split("/")[1] if "/" in name else ""
        if layer == "layer0.weight":
            a = a[:, :columns]  # (H, F) -> (H, F_k)
        if keep is not None and layer.startswith(last):
            a = a[keep]  # (C, H) -> (C_k, H), (C,) -> (C_k,)
        out[name] = a
    return out, [columns, *widths[1:-1], widths[-1] if keep is None else len(keep)]


def all_classes(found: np.ndarray, own: np.ndarray, classes: np.ndarray, method: str) -> np.ndarray:
    """A fold's ``predict_proba`` or ``predict_log_proba`` ``(n, C_k)`` over its own classes ``own`` as ``(n, C)``
    over all of ``classes``: a missing class's column 0 (``predict_log_proba``: the float minimum), with scikit-learn's
    ``RuntimeWarning`` (``sklearn.model_selection._validation._enforce_prediction_order``); anything else as it is."""
    if method == "predict" or len(own) == len(classes):
        return found
    warnings.warn(
        f"Number of classes in training fold ({len(own)}) does not match total number of classes ({len(classes)}). "
        "Results may not be appropriate for your use case. To fix this, use a cross-validation technique resulting "
        "in properly stratified folds",
        RuntimeWarning,
        stacklevel=3,
    )
    empty = 0.0 if method == "predict_proba" else np.finfo(found.dtype).min
    out = np.full((len(found), len(classes)), empty, dtype=found.dtype)
    out[:, np.searchsorted(classes, own)] = found
    return out
