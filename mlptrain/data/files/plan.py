"""The column plan: what each raw column of a table becomes, decided once from the training split.

A :class:`ColumnPlan` holds, for every input column (in the training file's order, after ``data.drop``
and ``data.features``), its kind and what encodes it:

* numeric: the value; an empty cell (empty, ``NA``, ``null``, ``NaN``: :data:`labels.MISSING`) is filled
  with the column's training median, and a 0/1 ``<name>_missing`` column follows it where the training
  split had empty cells in that column (as scikit-learn's ``SimpleImputer(strategy="median",
  add_indicator=True)``);
* categorical (a column with a cell that is not a number, or named by ``data.categorical``): one 0/1
  column per level seen in the training split, sorted (``<name>=<level>``; an empty cell is the level
  ``<empty>``), levels of fewer than ``data.min_frequency`` training rows grouped into one
  ``<name>=<rare>`` column; a level never seen in training encodes as all zeros (an unknown, counted).

The plan is plain data (:meth:`ColumnPlan.to_meta`, :meth:`ColumnPlan.from_meta`): it travels in the
checkpoint's meta, and :mod:`mlptrain.inference` applies it to raw rows. Nothing here reads a file
(:mod:`mlptrain.data.files.cells` does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlptrain.base.errors import DatasetError
from mlptrain.data.files.labels import MISSING

log = logging.getLogger(__name__)

EMPTY = "<empty>"  # the level of a categorical column's empty cells
RARE = "<rare>"  # the column of the levels of fewer than data.min_frequency training rows


def empty_cells(cells: np.ndarray) -> np.ndarray:
    """``(N,)`` bool: the cells of ``cells (N,)`` (stripped text, or numbers: NaN is empty) that hold no value."""
    return np.isnan(cells) if cells.dtype.kind == "f" else np.isin(cells, MISSING)


def numbers(cells: np.ndarray, empty: np.ndarray) -> np.ndarray | None:
    """The cells as float64 (empty ones NaN), or None where a non-empty cell is not a number."""
    if cells.dtype.kind == "f":  # a numeric column of a DataFrame (mlptrain.sklearn.frames): NaN is empty
        return cells.astype(np.float64, copy=False)
    try:
        return np.where(empty, "nan", cells).astype(np.float64)
    except ValueError:
        return None


def level_of(cells: np.ndarray, empty: np.ndarray) -> np.ndarray:
    """The level of each cell: its text, a whole number as an integer (``3.0`` is ``3``), an empty cell ``<empty>``;
    worked out on the distinct cells."""
    uniques, codes = np.unique(np.where(empty, EMPTY, cells), return_inverse=True)
    out = uniques.astype(object)
    for i, u in enumerate(uniques.tolist()):
        try:
            v = float(u)
        except ValueError:
            continue
        if v.is_integer() and u != EMPTY:
            out[i] = str(int(v))
    return out[codes.reshape(-1)]


@dataclass
class Column:
    """One input column's encoding: ``kind`` numeric (``fill``, ``indicator``) or categorical (``levels``, ``rare``)."""

    name: str
    kind: str
    fill: float = 0.0
    indicator: bool = False
    levels: list[str] = field(default_factory=list)
    rare: list[str] = field(default_factory=list)

    def outputs(self) -> list[str]:
        """The names of the encoded columns this column becomes."""
        if self.kind == "numeric":
            return [self.name, *([f"{self.name}_missing"] if self.indicator else [])]
        return [f"{self.name}={v}" for v in self.levels] + ([f"{self.name}={RARE}"] if self.rare else [])


@dataclass
class ColumnPlan:
    """The columns of a table and how each is encoded (see the module)."""

    columns: list[Column]

    @property
    def names(self) -> list[str]:
        """The raw input columns, in the training file's order."""
        return [c.name for c in self.columns]

    @property
    def feature_names(self) -> list[str]:
        """The encoded columns, the model's inputs."""
        return [n for c in self.columns for n in c.outputs()]

    @property
    def categorical(self) -> bool:
        return any(c.kind == "categorical" for c in self.columns)

    def binary(self) -> np.ndarray:
        """``(F,)`` bool: which encoded columns are 0/1 by construction (``<name>_missing``, one-hot); every
        ``data.normalize`` but ``none`` leaves these 0/1 (a constant one 0), as scikit-learn leaves one-hot columns."""
        flags = [
            [False, True][: len(c.outputs())] if c.kind == "numeric" else [True] * len(c.outputs())
            for c in self.columns
        ]
        return np.array([f for fs in flags for f in fs], dtype=bool)

    def to_meta(self) -> dict[str, Any]:
        return {"columns": [vars(c).copy() for c in self.columns]}

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> ColumnPlan | None:
        return None if meta is None else cls([Column(**c) for c in meta["columns"]])

    def encode(self, cells: dict[str, np.ndarray], where: Callable[[int], str], file: str) -> tuple[np.ndarray, dict]:
        """``cells`` (column -> ``(N,)`` stripped text; a numeric column's may be float, NaN empty) as the model's
        inputs ``(N, F)`` float64, and the unknown levels' counts (column -> rows). ``where(row)`` and ``file``
        name a cell in the messages.

        Raises:
            DatasetError: a column of the plan is missing, or a numeric column holds text.
        """
        missing = [c for c in self.names if c not in cells]
        if missing:
            raise DatasetError(f"{file} has no column {', '.join(map(repr, missing))}; the model takes {self.names}")
        parts: list[np.ndarray] = []
        unknown: dict[str, int] = {}
        for col in self.columns:
            text = cells[col.name]
            empty = empty_cells(text)
            if col.kind == "numeric":
                parts.extend(_numeric(col, text, empty, where, file))
                continue
            levels = level_of(text, empty)
            for v in col.levels:
                parts.append((levels == v).astype(np.float64))
            if col.rare:
                parts.append(np.isin(levels, col.rare).astype(np.float64))
            seen = np.isin(levels, col.levels) | np.isin(levels, col.rare)
            if (~seen).any():
                unknown[col.name] = int((~seen).sum())
        n = len(next(iter(cells.values()))) if cells else 0
        return (np.stack(parts, axis=1) if parts else np.zeros((n, 0))), unknown


def _numeric(col: Column, text: np.ndarray, empty: np.ndarray, where: Callable[[int], str], file: str) -> list:
    values = numbers(text, empty)
    if values is None:
        row = next(i for i in range(len(text)) if not empty[i] and numbers(text[i : i + 1], empty[i : i + 1]) is None)
        raise DatasetError(
            f"{file} {where(row)}, column {col.name!r}: {str(text[row])!r} is not a number; the column was numeric in "
            "the training file (a categorical column's cells may be text; set data.categorical to train it so)"
        )
    out = [np.where(empty, col.fill, values)]
    return out + ([empty.astype(np.float64)] if col.indicator else [])


def fit_plan(cells: dict[str, np.ndarray], rows: np.ndarray, categorical: list[str], min_frequency: int) -> ColumnPlan:
    """The plan of ``cells`` (column -> ``(N,)`` stripped text) from the training split's ``rows``: each column's
    kind from all its cells (a column with a cell that is not a number, or named in ``categorical``, is
    categorical), its levels and fill value from ``rows`` only."""
    plan = []
    for name, text in cells.items():
        empty = empty_cells(text)
        values = None if name in categorical else numbers(text, empty)
        if values is not None:
            train = values[rows]
            seen = train[~np.isnan(train)]
            fill = float(np.median(seen)) if len(seen) else 0.0
            plan.append(Column(name, "numeric", fill=fill, indicator=bool(np.isnan(train).any())))
            continue
        levels, counts = np.unique(level_of(text[rows], empty[rows]).astype(str), return_counts=True)
        order = sorted(range(len(levels)), key=lambda i: _order(str(levels[i])))  # 2 before 10
        levels, rare = levels[order], counts[order] < min_frequency
        plan.append(Column(name, "categorical", levels=levels[~rare].tolist(), rare=levels[rare].tolist()))
    return ColumnPlan(plan)


def _order(level: str) -> tuple[int, float, str]:
    """Levels sorted numbers first (by value), then text."""
    try:
        return (0, float(level), level)
    except ValueError:
        return (1, 0.0, level)


def log_empty(cells: dict[str, np.ndarray], plan: ColumnPlan, file: str) -> None:
    """One log line: how many cells are empty in which columns, and what they became (a warning, as the rows of
    ``data.missing=drop`` are: written into the run's ``mlptrain.log`` though said before it is opened)."""
    counts = {c.name: int(empty_cells(cells[c.name]).sum()) for c in plan.columns}
    filled = [f"{c.name} ({counts[c.name]})" for c in plan.columns if counts[c.name] and c.kind == "numeric"]
    level = [f"{c.name} ({counts[c.name]})" for c in plan.columns if counts[c.name] and c.kind == "categorical"]
    said = [f"filled with the column's training median in {', '.join(filled)}"] if filled else []
    said += [f"a level of their own in {', '.join(level)}"] if level else []
    if said:
        log.warning("%s: %d empty cells: %s (data.impute=fill)", file, sum(counts.values()), "; ".join(said))


SUSPECT_ROWS = 10_000  # rows read, in file order, to recognise an id column
SUSPECT_MIN_ROWS = 20  # a table of fewer rows is too short to tell


def suspect_columns(x: np.ndarray, names: list[str], plan: ColumnPlan | None, train_rows: int) -> dict[str, str]:
    """The columns that look like a row's name rather than a feature, each with why (column -> reason):

    * a numeric column of ``x (N, F)`` (named by ``names``) holding a different whole number on every row,
      rising down the file (of its first :data:`SUSPECT_ROWS` rows, in file order): an id or a row counter;
    * a categorical column of ``plan`` with as many training levels as half the ``train_rows``: free text or an
      id, whose one-hot columns each match a row or two, and a new row's level none of them.

    Tables of fewer than :data:`SUSPECT_MIN_ROWS` rows are too short to tell: none is named.
    """
    found: dict[str, str] = {}
    head = np.asarray(x[:SUSPECT_ROWS], dtype=np.float64)  # (n, F) in file order
    if len(head) >= SUSPECT_MIN_ROWS:
        with np.errstate(invalid="ignore"):  # NaN (an empty cell) compares False: such a column is not named
            whole = (head == np.round(head)).all(axis=0)  # (F,)
            rising = (np.diff(head, axis=0) > 0).all(axis=0)  # (F,)
        for j in np.flatnonzero(whole & rising):
            found[names[j]] = "a different whole number on every row, rising down the file"
    if plan is not None and train_rows >= SUSPECT_MIN_ROWS:
        for col in plan.columns:
            levels = len(col.levels) + len(col.rare)
            if col.kind == "categorical" and 2 * levels >= train_rows:
                found[col.name] = f"{levels} levels in {train_rows} training rows"
    return found


def log_suspects(found: dict[str, str], file: str) -> None:
    """One warning naming the :func:`suspect_columns` and how to leave them out. They are trained on as they are
    (``data.drop`` is the user's call), but a model learns nothing from them that holds for a new row."""
    if found:
        it, them = ("it", "it") if len(found) == 1 else ("each", "them")
        log.warning(
            "%s: %s: an id, a row counter or free text? As a feature %s tells the rows apart, not what they are, "
            "and a new row's value is one the model never saw; data.drop=[%s] leaves %s out",
            file,
            "; ".join(f"{name!r} ({why})" for name, why in found.items()),
            it,
            ",".join(found),
            them,
        )
