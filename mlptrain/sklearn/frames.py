"""A pandas DataFrame with text, ``category`` or empty cells, as the estimators take it: through the column plan.

The plan is the CLI's (:mod:`mlptrain.data.files.plan`, what ``data=file`` builds from a CSV): a numeric column's
empty cells (NaN, None, ``pd.NA``) filled with its training median plus a 0/1 ``<name>_missing`` column, a
categorical column one-hot over its training levels (an empty cell is a level of its own, an unseen level all
zeros, levels of fewer than ``min_frequency`` rows one ``<rare>`` column). Which columns are categorical comes
from the dtype, as ``HistGradientBoostingClassifier(categorical_features="from_dtype")``: ``category``, ``object``
and ``string`` columns; ``categorical_features`` may name integer-coded ones besides (names or positions).

A DataFrame goes through a plan when it needs one (:func:`needs_plan`: a categorical column, or a numeric column
with an empty cell); anything else (every NumPy array, a frame of complete numeric columns) is scikit-learn's
numeric input, as before. The plan is fitted on the train split's rows (:func:`encode`), kept in the checkpoint
(``meta["data"]["columns"]``) and applied by ``predict``, ``predict_proba`` and ``score``, which match the
columns by name (:func:`arrange`: any order; a missing column is one error; an extra one is scikit-learn's).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
from sklearn.utils.validation import check_array, check_consistent_length, column_or_1d, validate_data

from mlptrain.base.errors import ConfigError, DatasetError
from mlptrain.data.files.plan import ColumnPlan, fit_plan

FROM_DTYPE = "from_dtype"
Encoder = Callable[[np.ndarray], tuple[np.ndarray, ColumnPlan]]  # train rows -> the inputs (N, F), the plan


class ColumnsError(DatasetError, ValueError):
    """A DataFrame lacks a column the fitted plan takes, or has text in a numeric one (a ValueError, as
    scikit-learn's errors of the input are)."""


def is_frame(x: Any) -> bool:
    """Whether ``x`` is a pandas DataFrame (without importing pandas)."""
    return hasattr(x, "columns") and hasattr(x, "dtypes") and hasattr(x, "iloc")


def _text_dtype(dtype: Any) -> bool:
    """A ``category``, ``object`` or ``string`` dtype: categorical from the dtype."""
    return str(dtype) == "category" or getattr(dtype, "kind", "O") in ("O", "U", "S") or str(dtype) in ("string", "str")


def categorical_columns(owner: str, frame: Any, asked: Any) -> list[str]:
    """The names of ``frame``'s categorical columns: those of a text or ``category`` dtype, and those ``asked``
    (``categorical_features``: ``"from_dtype"``, or a list of column names or positions besides).

    Raises:
        ConfigError: ``asked`` is neither, or names a column the frame does not have.
    """
    names = [str(c) for c in frame.columns]
    out = {n for n, d in zip(names, frame.dtypes, strict=True) if _text_dtype(d)}
    if isinstance(asked, str) and asked == FROM_DTYPE:
        return [n for n in names if n in out]
    items = list(asked) if isinstance(asked, (list, tuple, np.ndarray)) else None
    for item in items if items is not None else [None]:
        if isinstance(item, numbers.Integral) and not isinstance(item, bool) and -len(names) <= int(item) < len(names):
            out.add(names[int(item)])
        elif isinstance(item, str) and item in names:
            out.add(item)
        else:
            raise ConfigError(
                f"{owner} categorical_features={asked!r}: {item!r} is not a column of X ({names[:8]}); expected "
                f"{FROM_DTYPE!r} or a list of column names or positions (text and category columns are categorical "
                "already)"
            )
    return [n for n in names if n in out]


def check_params(owner: str, p: dict[str, Any]) -> None:
    """Raise ConfigError for ``categorical_features`` or ``min_frequency`` out of range (``fit`` calls it)."""
    asked = p["categorical_features"]
    if not (isinstance(asked, str) and asked == FROM_DTYPE) and not isinstance(asked, (list, tuple, np.ndarray)):
        raise ConfigError(
            f"{owner} categorical_features={asked!r}; expected {FROM_DTYPE!r} or a list of column names or positions"
        )
    m = p["min_frequency"]
    if not isinstance(m, numbers.Integral) or isinstance(m, bool) or m < 1:
        raise ConfigError(f"{owner} min_frequency={m!r}; expected a positive integer (1: no level grouped)")


def needs_plan(frame: Any, categorical: list[str]) -> bool:
    """Whether ``frame`` needs the column plan: a categorical column, or a numeric column with an empty cell."""
    return bool(categorical) or bool(frame.isna().to_numpy().any())


def cells(frame: Any, categorical: list[str]) -> dict[str, np.ndarray]:
    """Each column of ``frame`` as the plan reads it: a categorical column (or one of a text dtype) as ``(N,)``
    stripped text, an empty cell ``""``; a numeric one as ``(N,)`` float64, an empty cell NaN."""
    out = {}
    for name, dtype in zip(frame.columns, frame.dtypes, strict=True):
        col = frame[name]
        empty = col.isna().to_numpy()
        if str(name) in categorical or _text_dtype(dtype):
            text = np.char.strip(np.asarray(col.astype(object).to_numpy(), dtype=str))
            out[str(name)] = np.where(empty, "", text)
        else:  # bool, int, float and pandas' nullable numbers
            out[str(name)] = col.to_numpy(dtype=np.float64, na_value=np.nan)
    return out


def fit_input(est: Any, X: Any, y: Any, *, fresh: bool, regression: bool) -> tuple[Any, Any, Encoder | None]:
    """``(X, y, encoder)`` checked as ``fit`` needs them: ``X`` as scikit-learn's ``validate_data`` makes it and
    ``encoder`` None; or, for a frame that needs a plan (or continues a fit that has one), ``X`` None and
    ``encoder(train rows)`` the inputs ``(N, F)`` and the plan (a fresh fit's fitted on those rows)."""
    name = type(est).__name__
    fitted = None if fresh else est.column_plan_
    categorical = categorical_columns(name, X, est.categorical_features) if is_frame(X) and fresh else []
    uses_plan = (is_frame(X) and needs_plan(X, categorical)) if fresh else fitted is not None
    if not uses_plan:
        X, y = validate_data(est, X, y, reset=fresh, dtype=np.float64, multi_output=regression, y_numeric=regression)
        return X, y, None
    rare = int(est.min_frequency)
    X = X if fitted is None else arrange(est, X, fitted)
    validate_data(est, X, reset=fresh, skip_check_array=True)  # n_features_in_, feature_names_in_
    if len(X) == 0:
        raise ValueError(f"Found array with 0 sample(s) (shape={X.shape}) while a minimum of 1 is required.")
    if regression:
        y = check_array(y, ensure_2d=False, dtype=np.float64, input_name="y")
    else:
        y = column_or_1d(check_array(y, ensure_2d=False, dtype=None, input_name="y"), warn=True)
    check_consistent_length(X, y)
    if fitted is not None:  # a continued fit: the first fit's plan, its kinds
        raw = cells(_frame(X, fitted), _categorical(fitted))
    else:
        raw = cells(X, categorical)
    return None, y, lambda train: encode(raw, train, fitted, categorical, rare)


def encode(
    columns: dict[str, np.ndarray], train: np.ndarray, plan: ColumnPlan | None, categorical: list[str], rare: int
) -> tuple[np.ndarray, ColumnPlan]:
    """The raw ``columns`` as the model's inputs ``(N, F)`` float64 and the plan that encoded them: ``plan``, or
    (None) the one fitted on the ``train`` rows (kinds from the dtypes, levels and medians from those rows)."""
    plan = plan or fit_plan(columns, train, categorical, rare)
    try:
        x, _ = plan.encode(columns, lambda row: f"row {row}", "X")
    except DatasetError as exc:  # a continued fit: text in a column the first fit's plan has as numeric
        raise ColumnsError(_words(str(exc))) from exc
    return x, plan


def arrange(est: Any, X: Any, plan: ColumnPlan) -> Any:
    """A frame ``X`` with the plan's columns in the fitted order (matched by name), or ``X`` as it is where it has
    columns the plan does not know (scikit-learn's ``validate_data`` then names them) or is not a frame.

    Raises:
        ColumnsError: ``X`` is a frame without a column of the plan.
    """
    if not is_frame(X):
        return X
    names = [str(c) for c in X.columns]
    missing = [c for c in plan.names if c not in names]
    if missing:
        raise ColumnsError(
            f"X lacks the column(s) {missing[:8]} that {type(est).__name__} was fitted with; it takes the "
            f"{len(plan.names)} columns {plan.names[:8]}{' ...' if len(plan.names) > 8 else ''} (in any order)"
        )
    return X if len(names) != len(plan.names) else X[[X.columns[names.index(c)] for c in plan.names]]


def predict_input(est: Any, X: Any, plan: ColumnPlan) -> np.ndarray:
    """Rows ``X`` (a frame matched by name, or an array of the fitted columns in order) as the model's inputs
    ``(N, F)`` by ``plan``; unseen levels are all zeros (counted in the predictor's log)."""
    X = arrange(est, X, plan)
    validate_data(est, X, reset=False, skip_check_array=True)  # scikit-learn's errors for other names or counts
    try:
        return est.predictor_.encode(cells(_frame(X, plan), _categorical(plan)), "X", lambda row: f"row {row}")
    except DatasetError as exc:  # text in a numeric column: a ValueError, in the estimators' words
        raise ColumnsError(_words(str(exc))) from exc


def _words(message: str) -> str:
    """The plan's message (:func:`mlptrain.data.files.plan.ColumnPlan.encode`) with the estimators' names."""
    return message.replace("the training file", "fit's X").replace("data.categorical", "categorical_features")


def _categorical(plan: ColumnPlan) -> list[str]:
    return [c.name for c in plan.columns if c.kind == "categorical"]


def _frame(X: Any, plan: ColumnPlan) -> Any:
    """``X`` as a DataFrame: an array's columns are the plan's, in order (scikit-learn checked their count)."""
    if is_frame(X):
        return X
    import pandas as pd

    return pd.DataFrame(np.asarray(X, dtype=object), columns=plan.names).infer_objects()
