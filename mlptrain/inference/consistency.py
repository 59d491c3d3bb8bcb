"""Whether a checkpoint can score raw rows: its model and preprocessing, checked when a Predictor loads it.

The SHA-256 and the meta's schema (:func:`mlptrain.run.checkpoint.load`) say that a file is what its
writer wrote; they cannot say that what it holds fits together. A checkpoint whose arrays were
edited and its SHA-256 recomputed (or one written by a bug) can hold a scale of 0 or NaN, a shift
of the wrong length, integer or inf weights, two class names for three outputs, or an unknown
task. Scoring with it gives garbage or an exception deep inside (an IndexError naming a class),
and its ONNX export a broken graph. :func:`check_for_scoring` refuses it first, with one
:class:`~mlptrain.base.errors.CheckpointError` naming the entry and what is wrong with it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlptrain.base.errors import CheckpointError
from mlptrain.config.schema import TASKS
from mlptrain.run.checkpoint import Checkpoint


def check_for_scoring(ckpt: Checkpoint) -> None:
    """Raise CheckpointError if ``ckpt`` (which holds its preprocessing) cannot score raw rows.

    Checked: the task; the widths; the feature, class and target names (a list of distinct strings,
    one per input or output); ``data/shift`` and ``data/scale`` (one finite float per feature, the
    scale > 0: the features are divided by it); ``data/quantiles`` and ``data/quantile_columns`` where one is
    there (``data.normalize=quantile``: finite, each column ascending, distinct columns of the features);
    every parameter (floating point and finite).
    """
    problem = _meta_problem(ckpt.meta) or _array_problem(ckpt.arrays, ckpt.meta["widths"][0])
    if problem:
        hint = "restore the file, or train the model again"
        raise CheckpointError(f"checkpoint {ckpt.path}: {problem}; it cannot score inputs ({hint})")


def _meta_problem(meta: dict[str, Any]) -> str | None:
    widths, data = meta["widths"], meta["data"]
    if len(widths) < 2 or min(widths) < 1:
        return f"widths={widths}; expected at least the inputs and the outputs, each at least 1"
    task = data.get("task")
    if task not in TASKS:
        return f"data.task={task!r}; expected {' or '.join(TASKS)}"
    outputs = "class_names" if task == "classification" else "target_names"
    for key, n, what in (("feature_names", widths[0], "inputs"), (outputs, widths[-1], "outputs")):
        names = data.get(key)
        if names is None:
            continue
        if not isinstance(names, list) or not all(isinstance(s, str) for s in names):
            return f"data.{key} is {names!r}; expected a list of names (strings)"
        if len(names) != n:
            return f"data.{key} has {len(names)} names for the model's {n} {what}"
        twice = next((s for i, s in enumerate(names) if s in names[:i]), None)
        if twice is not None:
            return f"data.{key} names {twice!r} twice; expected one name per {what[:-1]}"
    return None


def _array_problem(arrays: dict[str, np.ndarray], features: int) -> str | None:
    for key in ("data/shift", "data/scale"):
        a = arrays.get(key)
        if a is None:
            return f"it has no {key} entry (the features' normalisation)"
        if a.shape != (features,) or a.dtype.kind != "f":
            return f"{key} is {a.dtype} {a.shape}; expected float ({features},), one value per feature"
        # (x - shift) / scale: a scale of 0, below 0 or NaN makes every score meaningless
        bad = ~np.isfinite(a) if key == "data/shift" else ~(np.isfinite(a) & (a > 0))
        if bad.any():
            i = int(np.argmax(bad))
            return f"{key}[{i}] is {a[i]}; expected a finite number" + (" > 0" if key == "data/scale" else "")
    problem = _quantile_problem(arrays, features)
    if problem:
        return problem
    for key in sorted(k for k in arrays if k.startswith("param/")):
        a = arrays[key]
        if a.dtype.kind != "f":
            return f"{key} is {a.dtype}; expected floating-point parameters"
        if not np.isfinite(a).all():
            where = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
            return f"{key}{list(where)} is {a[where]}; expected finite parameters"
    return None


def _quantile_problem(arrays: dict[str, np.ndarray], features: int) -> str | None:
    """What is wrong with ``data/quantiles (Q, K)`` and ``data/quantile_columns (K,)``, or None (also when both
    are absent: a model trained without ``data.normalize=quantile``)."""
    q, cols = arrays.get("data/quantiles"), arrays.get("data/quantile_columns")
    if q is None and cols is None:
        return None
    if q is None or cols is None:
        return "it has only one of data/quantiles and data/quantile_columns (the quantile map needs both)"
    if cols.ndim != 1 or cols.dtype.kind not in "iu" or len(np.unique(cols)) != len(cols):
        return f"data/quantile_columns is {cols.dtype} {cols.shape}; expected distinct integer column indices"
    if len(cols) and (cols.min() < 0 or cols.max() >= features):
        return f"data/quantile_columns holds {int(cols.max())}; expected indices in [0, {features})"
    if q.dtype.kind != "f" or q.ndim != 2 or q.shape[1] != len(cols) or len(q) < 1:
        return f"data/quantiles is {q.dtype} {q.shape}; expected float (Q, {len(cols)}), one column per mapped feature"
    if not np.isfinite(q).all() or (np.diff(q, axis=0) < 0).any():
        return "data/quantiles holds a value that is not finite, or a column that is not ascending"
    return None
