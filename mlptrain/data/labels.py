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

from mlptrain.errors import DatasetError

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


def text_column(cells: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``cells (N,)`` text -> ``(values, missing, mixed)``.

    ``values`` is int64, float64 or str (a missing cell holds 0 or ``""``); ``missing (N,)`` bool;
    ``mixed`` the rows of the minority kind (numbers or text) when the column holds both, else None.
    """
    cells = np.char.strip(np.asarray(cells, dtype=str))
    missing = np.isin(cells, MISSING)
    present = cells[~missing]
    for dtype in (np.int64, np.float64):  # whole numbers exactly (int64), then any number
        try:
            numbers = present.astype(dtype)
        except (ValueError, OverflowError):
            continue
        values = np.zeros(len(cells), dtype)
        values[~missing] = numbers
        return values, missing, None
    kinds, inverse = np.unique(present, return_inverse=True)  # a label column has few distinct values
    numeric = np.array([is_number(str(k)) for k in kinds], dtype=bool)[inverse]  # (present,)
    mixed = None
    if numeric.any() and not numeric.all():
        minority = numeric if 2 * numeric.sum() <= len(numeric) else ~numeric
        mixed = np.flatnonzero(~missing)[minority]
    return np.where(missing, "", cells), missing, mixed


def typed_column(values: np.ndarray, missing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A typed (Parquet) column -> ``(values, missing)``: integers as int64, floats as float64, NaN missing."""
    if values.dtype.kind in "iub":
        return values.astype(np.int64), missing
    values = values.astype(np.float64)
    missing = missing | np.isnan(values)
    return np.where(missing, 0.0, values), missing


def stack(columns: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray | None]:
    """The target columns as ``y (N,)`` (one) or ``(N, T)``, and the rows with a missing cell (None: none)."""
    missing = np.logical_or.reduce([m for _, m in columns])
    if len(columns) == 1:
        y = columns[0][0]
    elif all(v.dtype.kind in "if" for v, _ in columns):
        y = np.stack([v.astype(np.float64) for v, _ in columns], axis=1)
    else:
        y = np.stack([v.astype(str) for v, _ in columns], axis=1)
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
    columns: list[tuple[np.ndarray, np.ndarray | None]], names: list[str], where: Callable[[int], str], path: object
) -> tuple[np.ndarray, np.ndarray | None, str | None]:
    """The target columns (each text cells with None, or typed values with their null mask) as ``y``.

    Returns ``y (N,)`` or ``(N, T)``, the rows with a missing cell (None: none) and the message of the
    first column that mixes numbers and text (None: none).
    """
    out, problem = [], None
    for (cells, nulls), name in zip(columns, names, strict=True):
        if nulls is not None and cells.dtype.kind in "iufb":
            out.append(typed_column(cells, nulls))
            continue
        if nulls is not None:  # a Parquet text column: its nulls read as empty cells
            cells = np.where(nulls, "", cells.astype(str))
        values, missing, mixed = text_column(cells)
        if mixed is not None and problem is None:
            problem = mixed_message(values, mixed, name, where, path)
        out.append((values, missing))
    y, missing = stack(out)
    return y, missing, problem
