"""A table's feature cells as text, for the column plan (:mod:`mlptrain.data.files.plan`).

:func:`read_cells` reads a CSV/TSV (gzip too), Parquet or NPZ file into a :class:`Table` whose ``cells`` hold
each feature column's stripped text (``x`` is empty until the plan encodes it) and whose targets are read as
every reader reads them (:mod:`mlptrain.data.files.labels`). :func:`select` applies ``data.drop`` and
``data.features``. Used where a table has text, empty cells or columns to leave out; a table of numbers alone
goes through the fast readers (:func:`mlptrain.data.files.readers.read_table`) as before.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from mlptrain.base.errors import DatasetError
from mlptrain.data.files import labels
from mlptrain.data.files.csv_reader import check_rows, header, lines
from mlptrain.data.files.table import Table, no_column


def read_cells(path: Path, kind: str, delimiter: str | None, targets: list[str], setting: str = "data.target") -> Table:
    """The rows of ``path``: ``cells`` (every column but ``targets``, as stripped text) and the targets."""
    if kind == "csv":
        names, _, _ = header(path, delimiter or ",", targets, setting)
        check_rows(path, delimiter or ",", len(names))
        rows = list(csv.reader((s for i, s in enumerate(lines(path)) if i and s.strip()), delimiter=delimiter or ","))
        text = np.array(rows, dtype=str).reshape(len(rows), len(names))  # (N, columns)
        columns = {n: np.char.strip(text[:, j]) for j, n in enumerate(names)}
    elif kind == "npz":
        with np.load(path, allow_pickle=False) as npz:
            x = np.asarray(npz["x"], dtype=np.float64).reshape(len(npz["x"]), -1)
            names = [str(n) for n in npz["feature_names"]] if "feature_names" in npz.files else []
            y = npz["y"] if targets and "y" in npz.files else None
        names = names or [f"x{j}" for j in range(x.shape[1])]
        columns = {n: np.array([repr(v) for v in x[:, j].tolist()], dtype=str) for j, n in enumerate(names)}
        if y is not None:
            columns[targets[0]] = np.asarray(y).astype(str)
    else:
        columns = _parquet(path)
    missing = [t for t in targets if t not in columns]
    if missing:
        raise no_column(path, missing, list(columns), setting)
    n = len(next(iter(columns.values())))
    feats = {k: v for k, v in columns.items() if k not in targets}
    table = Table(path, np.zeros((n, 0)), None, list(feats), targets, text=kind == "csv", cells=feats)
    if targets:
        cols = [labels.text_column(columns[t]) for t in targets]
        table.y, table.missing, table.problem = labels.read_targets(cols, targets, table.where, path)
    return table


def _parquet(path: Path) -> dict[str, np.ndarray]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        hint = "pip install -e '.[arrow]'"
        raise DatasetError(f"data file {path}: reading Parquet files needs pyarrow ({hint})") from exc
    table = pq.read_table(path)
    out = {}
    for name in table.column_names:
        values = table.column(name).to_pylist()
        out[name] = np.array(["" if v is None else (repr(v) if isinstance(v, float) else str(v)) for v in values])
        out[name] = np.char.strip(out[name].astype(str))
    return out


def select(table: Table, drop: list[str], keep: list[str] | None, categorical: list[str] = []) -> Table:  # noqa: B006
    """``table`` without the ``drop`` columns, and (``keep`` not None) with only the ``keep`` columns; the
    ``categorical`` names must be feature columns too.

    Raises:
        DatasetError: a name that is not a feature column of the file (its columns are listed).
    """
    assert table.cells is not None
    names = list(table.cells)
    for setting, asked in (("data.drop", drop), ("data.features", keep or []), ("data.categorical", categorical)):
        unknown = [c for c in asked if c not in names]
        if unknown:
            raise no_column(table.path, unknown, [*names, *table.target_names], setting)
    chosen = [c for c in names if (keep is None or c in keep) and c not in drop]  # the file's order
    if not chosen:
        raise DatasetError(f"data file {table.path}: data.drop and data.features leave no feature column")
    table.cells = {c: table.cells[c] for c in chosen}
    table.feature_names = chosen
    return table
