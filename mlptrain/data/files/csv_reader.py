"""CSV and TSV read by NumPy alone: the header row, the row checks, and :func:`read_csv_numpy`.

The header and row checks serve the Arrow reader too (:mod:`mlptrain.data.files.arrow_reader`): both
name the same columns and the same line of every problem. A UTF-8 byte-order mark (a spreadsheet's
export) is not part of the first column's name.
"""

from __future__ import annotations

import csv
import gzip
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.base.errors import DatasetError
from mlptrain.data.files import labels
from mlptrain.data.files.table import Table, TextCell, no_column


def lines(path: Path) -> Iterator[str]:
    """The text lines of ``path`` (gzip too), the byte-order mark left out."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8-sig", newline="") as f:  # type: ignore[operator]
            yield from f
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise DatasetError(f"data file {path} cannot be read as UTF-8 text ({type(exc).__name__}: {exc})") from exc


def header_names(path: Path, delimiter: str) -> list[str]:
    """The names of line 1, stripped (``f0, f1, label`` names ``f0``, ``f1`` and ``label``)."""
    first = next(lines(path), "")
    return [n.strip() for n in next(csv.reader([first], delimiter=delimiter), [])]


def header(
    path: Path, delimiter: str, targets: list[str], setting: str = "data.target"
) -> tuple[list[str], list[int], list[int]]:
    """The column names, and the indices of the feature and the target columns."""
    names = header_names(path, delimiter)
    if not any(names):
        raise DatasetError(f"data file {path} line 1 is empty; expected a header row naming the columns")
    missing = [t for t in targets if t not in names]
    if all(map(labels.is_number, names)) or (missing and 2 * sum(map(labels.is_number, names)) >= len(names)):
        first = next(lines(path), "")
        raise DatasetError(
            f"data file {path} has no header row: line 1 holds numbers ({first.strip()[:60]}); the first line must "
            "name the columns"
        )
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup or "" in names:
        raise DatasetError(f"data file {path} line 1: the column names must be unique and non-empty; got {names}")
    if missing:
        raise no_column(path, missing, names, setting)
    features = [i for i, n in enumerate(names) if n not in targets]
    if not features:
        raise DatasetError(f"data file {path} has only target columns ({', '.join(targets)}); no features")
    return names, features, [names.index(t) for t in targets]


def check_rows(path: Path, delimiter: str, fields: int) -> int:
    """Every data line has ``fields`` fields (empty lines aside, as both readers skip them); returns the number of
    rows. A line of spaces or tabs is no empty line to the readers: it is refused by its number."""
    rows = 0
    for line_no, line in enumerate(lines(path), start=1):
        if line_no == 1 or _empty(line):
            continue
        if not line.strip():
            shown = line.rstrip("\r\n")
            raise DatasetError(
                f"data file {path} line {line_no} holds only whitespace ({shown!r}); remove the line, or give it a "
                f"value for each of the {fields} columns"
            )
        n = len(next(csv.reader([line], delimiter=delimiter))) if '"' in line else line.count(delimiter) + 1
        if n != fields:
            raise DatasetError(
                f"data file {path} line {line_no} has {n} fields, the header has {fields}; every row needs a value "
                "for every column"
            )
        rows += 1
    if rows == 0:
        raise DatasetError(f"data file {path} has a header but no data rows")
    return rows


def _empty(line: str) -> bool:
    """Whether ``line`` is empty (its line break aside): the lines NumPy and Arrow skip."""
    return not line.rstrip("\r\n")


def line_of_row(path: Path, row: int) -> int:
    """The file line of data row ``row`` (empty lines skipped, as NumPy skips them)."""
    seen = -1
    for line_no, line in enumerate(lines(path), start=1):
        if line_no > 1 and not _empty(line):
            seen += 1
            if seen == row:
                return line_no
    return row + 2


_NUMPY_BAD = re.compile(r"could not convert string '(.*)' to \w+ at row (\d+), column (\d+)")


def read_csv_numpy(path: Path, delimiter: str, targets: list[str], setting: str = "data.target") -> Table:
    names, features, target_cols = header(path, delimiter, targets, setting)
    check_rows(path, delimiter, len(names))
    opts: dict[str, Any] = {"delimiter": delimiter, "skiprows": 1, "quotechar": '"', "comments": None}
    try:
        x = np.loadtxt(path, usecols=features, dtype=np.float64, ndmin=2, encoding="utf-8", **opts)
    except ValueError as exc:
        m = _NUMPY_BAD.search(str(exc))
        if m is None:
            raise DatasetError(f"data file {path} cannot be read: {exc}") from exc
        value, row, col = m.group(1), int(m.group(2)), int(m.group(3))
        raise TextCell(
            f"data file {path} line {line_of_row(path, row)}, column {names[col - 1]!r}: {value!r} is not a number; "
            "features must be numbers (fill or remove missing values)"
        ) from None
    table = Table(path, x, None, [names[i] for i in features], targets)
    if target_cols:
        cells = np.loadtxt(path, usecols=target_cols, dtype=str, ndmin=2, encoding="utf-8", **opts)  # (N, T) text
        columns = [labels.text_column(cells[:, j]) for j in range(cells.shape[1])]
        table.y, table.missing, table.problem = labels.read_targets(columns, targets, table.where, path)
    return table
