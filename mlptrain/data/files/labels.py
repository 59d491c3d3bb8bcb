"""Target cells, as every reader normalises them: stripped, missing values marked, numbers typed.

The NumPy reader, the Arrow reader and Parquet files hand their target columns here, so a file
reads the same whatever reads it: ``" a"`` is ``a``; an empty cell, ``NA``, ``null``, ``NaN`` (the
spellings of :data:`MISSING`) or a Parquet null is a missing value; a column of integers is
int64 (exact: ``2**53`` and ``2**53 + 1`` are two labels), of other numbers float64, else text.
A column that holds numbers and text is a mistake (one stray cell would turn a regression into a
classification of every distinct value): the table carries its message, and training refuses it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mlptrain.base.errors import DatasetError

# pandas' and Arrow's default spellings of a missing value (and Python's None), after stripping.
MISSING = (
    *("", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>"),
    *("N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"),
)
EXACT = 2**53  # float64 holds every whole number up to here exactly, and no more


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


Column = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]  # values, missing (N,) bool, mixed rows or None


def text_column(cells: np.ndarray) -> Column:
    """``cells (N,)`` text -> ``(values, missing, mixed)``.

    ``values`` is int64, float64 or str (a missing cell holds 0 or ``""``); ``missing (N,)`` bool;
    ``mixed`` the rows of the minority kind (numbers or text) when the column holds both, else None.
    """
    cells = np.char.strip(np.asarray(cells, dtype=str))
    numbers = as_numbers(cells)  # every cell a number: the usual target, at once
    if numbers is not None:
        return numbers
    uniques, codes = np.unique(cells, return_inverse=True)  # a label column has few distinct cells
    return coded_column(uniques, codes.reshape(-1))


def coded_column(uniques: np.ndarray, codes: np.ndarray) -> Column:
    """:func:`text_column` of ``uniques[codes]`` (stripped, distinct cells), worked out on the distinct cells."""
    uniques = np.asarray(uniques, dtype=str)
    missing_u = np.isin(uniques, MISSING)
    numbers = as_numbers(uniques[~missing_u])
    if numbers is not None:  # numbers and missing cells
        values_u = np.zeros(len(uniques), numbers[0].dtype)
        values_u[~missing_u] = numbers[0]
        missing_u[~missing_u] = numbers[1]
        return values_u[codes], missing_u[codes], None
    numeric_u = np.array([is_number(str(u)) for u in uniques], dtype=bool) & ~missing_u
    missing, numeric = missing_u[codes], numeric_u[codes]  # (N,)
    text = ~missing & ~numeric
    mixed = None
    if numeric.any() and text.any():
        mixed = np.flatnonzero(numeric if numeric.sum() <= text.sum() else text)  # the fewer: the odd ones
    return np.where(missing_u, "", uniques)[codes], missing, mixed


def as_numbers(cells: np.ndarray) -> Column | None:
    """``(values, missing, None)`` of text cells that are all numbers: int64 (exact) if whole, else float64."""
    for dtype in (np.int64, np.float64):
        try:
            values = cells.astype(dtype)
        except (ValueError, OverflowError):
            continue
        return typed_column(values, np.zeros(len(values), bool))  # NaN (nan, NaN) is missing
    return None


def typed_column(values: np.ndarray, missing: np.ndarray) -> Column:
    """A typed (Parquet) column -> ``(values, missing, None)``: integers int64, floats float64, NaN missing."""
    if values.dtype.kind in "iub":
        return values.astype(np.int64), missing, None
    values = values.astype(np.float64)
    missing = missing | np.isnan(values)
    return np.where(missing, 0.0, values), missing, None


def stack(columns: list[Column]) -> tuple[np.ndarray, np.ndarray | None]:
    """The target columns as ``y (N,)`` (one) or ``(N, T)``, and the rows with a missing cell (None: none)."""
    missing = np.logical_or.reduce([m for _, m, _ in columns])
    if len(columns) == 1:
        y = columns[0][0]
    elif all(v.dtype.kind in "if" for v, _, _ in columns):
        y = np.stack([v.astype(np.float64) for v, _, _ in columns], axis=1)
    else:
        y = np.stack([v.astype(str) for v, _, _ in columns], axis=1)
    return y, (missing if missing.any() else None)


def mixed_message(cells: np.ndarray, rows: np.ndarray, name: str, where: Callable[[int], str], path: object) -> str:
    """The message of a target column ``name`` whose ``rows`` are numbers among text (or text among numbers)."""
    kind = "numbers" if is_number(str(cells[rows[0]])) else "text"
    other = "text" if kind == "numbers" else "numbers"
    return (
        f"data file {path} {where(int(rows[0]))}, column {name!r}: {str(cells[rows[0]]).strip()!r} is one of "
        f"{len(rows)} cells of {kind} in a column of {other}; a target holds numbers or class names, not both "
        "(fix or remove those rows)"
    )


def check_exact(values: np.ndarray, name: str, where: Callable[[int], str], path: object) -> None:
    """Float class labels must be whole numbers that float64 holds exactly (``|v| <= 2**53``)."""
    if values.dtype.kind != "f":
        return
    bad = np.flatnonzero((np.mod(values, 1) != 0) | (np.abs(values) > EXACT))
    if len(bad):
        row = int(bad[0])
        raise DatasetError(
            f"data file {path} {where(row)}, column {name!r}: label {float(values[row])!r} is not a whole number that "
            f"float64 holds exactly (up to 2**53 = {EXACT}); write class labels as integers or as text"
        )


def read_targets(
    columns: list[Column], names: list[str], where: Callable[[int], str], path: object
) -> tuple[np.ndarray, np.ndarray | None, str | None]:
    """The normalised target columns (:func:`text_column`, :func:`coded_column`, :func:`typed_column`) as ``y``.

    Returns ``y (N,)`` or ``(N, T)``, the rows with a missing cell (None: none) and the message of the
    first column that mixes numbers and text (None: none).
    """
    problem = None
    for (values, _, mixed), name in zip(columns, names, strict=True):
        if mixed is not None and problem is None:
            problem = mixed_message(values, mixed, name, where, path)
    y, missing = stack(columns)
    return y, missing, problem
