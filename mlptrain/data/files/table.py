"""The :class:`Table`: one data file's rows as a reader returns them, before they become a dataset."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.base.errors import DatasetError


@dataclass
class Table:
    """One file's rows: ``x (N, F)`` float features, ``y (N,)`` or ``(N, T)`` targets as read.

    The target cells are normalised by :mod:`mlptrain.data.files.labels` (the same for every reader):
    ``missing`` marks the rows with a missing target cell (their ``y`` holds a filler), ``problem``
    is the message of a target that mixes numbers and text (raised by whoever trains on it).
    """

    path: Path
    x: np.ndarray
    y: Any  # np.ndarray, or None for a file read without its targets
    feature_names: list[str]
    target_names: list[str]
    text: bool = True  # rows are lines of a text file, after a header line
    named: bool = True  # the file names its feature columns (an NPZ file without feature_names does not)
    missing: np.ndarray | None = None  # (N,) bool: a target cell is empty, NA, null or NaN
    problem: str | None = None  # a target column that mixes numbers and text
    rows: np.ndarray | None = None  # (N,) int64: each row's index in the file, once rows were dropped
    cells: dict[str, np.ndarray] | None = None  # feature column -> (N,) stripped text, for the column plan (x empty)

    def where(self, row: int) -> str:
        """``line 7`` of a text file (row 0 is line 2), ``row 5`` of an NPZ or Parquet file."""
        row = int(self.rows[row]) if self.rows is not None else row
        return f"line {row + 2}" if self.text else f"row {row}"

    def where_rows(self, rows: np.ndarray, shown: int = 5) -> str:
        """``lines 3, 8 and 12`` or ``rows 0, 4, 9, 11, 20 and 7 more``: some of ``rows``, and how many."""
        places = [self.where(int(r)).split(" ")[1] for r in rows[:shown]]
        word = ("line" if self.text else "row") + ("s" if len(rows) > 1 else "")
        if len(rows) > shown:
            return f"{word} {', '.join(places)} and {len(rows) - shown} more"
        return f"{word} {' and '.join([', '.join(places[:-1]), places[-1]] if len(places) > 1 else places)}"


class TextCell(DatasetError):
    """A feature cell that is not a number (text, or empty): the table is read again as text for the column plan."""


def no_column(path: Path, missing: list[str], names: list[str], setting: str) -> DatasetError:
    """The error of columns the file does not have (asked for by ``setting``): it lists those it has."""
    return DatasetError(
        f"data file {path} has no column {', '.join(map(repr, missing))} ({setting}); its columns are "
        f"{', '.join(names)}"
    )
