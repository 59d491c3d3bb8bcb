"""A file's columns matched to a model's: the features put in the model's order by name, a target
column's labels read as the model's class indices.

:class:`~mlptrain.inference.predictor.Predictor` (``arrange``, ``check_columns``, ``labels``) passes what the
checkpoint says of its columns: the feature names (None for a model trained on unnamed columns),
the number of features, the target columns and the class names. Nothing here reads a file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mlptrain.base.errors import DatasetError


def arrange(
    names: list[str],
    x: np.ndarray,
    where: str,
    expected: list[str] | None,
    num_features: int,
    targets: list[str],
    *,
    named: bool = True,
) -> np.ndarray:
    """The columns of a file (``names``, values ``x (N, len(names))``) in the model's feature order.

    Raises:
        DatasetError: a feature column is missing, or the file has a column the model does not
            know (renamed columns are both), or (files without names) another number of columns.
    """
    if expected is None or not named:
        if x.shape[1] != num_features:
            raise DatasetError(
                f"{where} has {x.shape[1]} feature columns; the model takes {num_features}{names_hint(expected)}"
            )
        return x
    check_columns(names, where, expected, targets)
    return x[:, [names.index(c) for c in expected]]


def check_columns(names: list[str], where: str, expected: list[str] | None, targets: list[str]) -> None:
    """Raise DatasetError if the feature columns ``names`` are not the model's ``expected`` ones
    (missing, or unknown ones); ``targets``, the columns that may come besides them, are named in the message.

    Called on a file's header before its cells are read, so that a file of another model is
    named as such rather than by its first cell that is not a number.
    """
    if expected is None:
        return
    missing = [c for c in expected if c not in names]
    extra = [c for c in names if c not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"lacks the feature column(s) {listed(missing)}")
        if extra:
            parts.append(f"has column(s) the model was not trained on: {listed(extra)}")
        hint = " (renamed?)" if missing and extra and len(missing) == len(extra) else ""
        if len(missing) == len(expected) and extra:  # not one of the model's columns
            hint = " (a file of another model?)"
        raise DatasetError(
            f"{where} {' and '.join(parts)}{hint}; the model takes the {len(expected)} columns "
            f"{listed(expected)}, and optionally the target {listed(targets)}"
        )


def labels(y: np.ndarray, where: str, names: list[str], place: Callable[[int], str] | None = None) -> np.ndarray:
    """Class indices of a target column ``y``: by class name (``names``, the model's), or an integer class index.

    ``place(row)`` says where row ``row`` of ``y`` is in its file (``line 7``); default ``row <row>`` (0-based).
    """
    index = {n: i for i, n in enumerate(names)}
    # A number stands for a class index only where the class names are not numbers themselves
    # (fashion_mnist's "Trouser" is label 1; with classes "1", "2", "3", label 1 is class "1").
    by_index = not all(_number(n) is not None for n in names)
    out = np.empty(len(y), dtype=np.int64)
    for row, v in enumerate(y.tolist()):
        number = _number(v)  # 3, 3.0 and "3.0" are class "3"
        key = str(int(number)) if number is not None and number.is_integer() else str(v).strip()
        if key in index:
            out[row] = index[key]
        elif by_index and number is not None and number.is_integer() and 0 <= number < len(names):
            out[row] = int(number)
        else:
            at = place(row) if place is not None else f"row {row}"
            raise DatasetError(f"{where} {at}: label {v!r} is not a class of the model ({listed(names)})")
    return out


def listed(names: list[str], most: int = 8) -> str:
    """``names`` quoted for a message, the first ``most`` of them."""
    shown = ", ".join(map(repr, names[:most]))
    return shown + (f", ... ({len(names)} in all)" if len(names) > most else "")


def names_hint(names: list[str] | None) -> str:
    """`` (the names)`` for a message, or nothing without names."""
    return f" ({listed(names)})" if names else ""


def _number(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None
