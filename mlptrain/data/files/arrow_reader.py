"""CSV parsed by Arrow's multi-threaded reader, and Parquet files (``pip install -e '.[arrow]'``).

The header is read and checked as the NumPy reader reads it (:mod:`mlptrain.data.files.csv_reader`): its
names stripped, so a header ``f0, f1, label`` names the column ``label``; the target cells go
through :mod:`mlptrain.data.files.labels` as text, as the NumPy reader's do, so both readers give the same
labels. Every problem names the file and the line (or the row of a Parquet file).
"""

from __future__ import annotations

import csv
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.base.errors import DatasetError
from mlptrain.data.files import labels
from mlptrain.data.files.csv_reader import check_rows, header, lines
from mlptrain.data.files.table import Table, TextCell, no_column


def first_line(exc: BaseException) -> str:
    """An Arrow message's first line (some append the whole schema, one field a line)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def read_arrow(path: Path, kind: str, delimiter: str, targets: list[str], setting: str = "data.target") -> Table:
    """A CSV's features parsed as float64 and its targets as text (no type guessing); or a Parquet file.

    Two choices, for speed (docs/benchmarks.md, "Reading a large CSV"). The system allocator: Arrow's
    own (mimalloc) hands freed memory back to the kernel and takes it again as fresh pages, which the
    kernel zeroes. No null spellings (``NA``, ``null``, the empty cell...: Arrow compares every cell
    with each): a feature reads the same without them or fails; a failure reads again with the
    defaults, which name the bad cell as NaN.
    """
    try:
        import pyarrow as pa
        import pyarrow.csv as pcsv
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DatasetError(f"data file {path}: reading {kind} files needs pyarrow (pip install -e '.[arrow]')") from exc
    if kind == "parquet":
        try:
            unique_names(path, pq.read_schema(path).names)  # before reading: Arrow's own error lists the schema
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"data file {path} cannot be read as Parquet: {first_line(exc)}") from exc
        return arrow_table(path, table, targets, False, setting)
    names, features, _ = header(path, delimiter, targets, setting)  # checked as the NumPy path checks it
    kw = {
        "parse_options": pcsv.ParseOptions(delimiter=delimiter),
        "read_options": pcsv.ReadOptions(column_names=names, skip_rows=1),  # the stripped names
        "memory_pool": pa.system_memory_pool(),
    }
    types = {**{names[i]: pa.float64() for i in features}, **{t: pa.string() for t in targets}}
    try:
        table = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(column_types=types, null_values=[]), **kw)
    except (pa.ArrowInvalid, OSError):
        table = None  # a cell that is not a number (or an unreadable file): the second read says which
    try:
        if table is None:  # the first table let go before the second read
            table = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(column_types=types), **kw)
    except (pa.ArrowInvalid, OSError) as exc:
        explain_arrow_error(path, delimiter, names, str(exc))
        raise DatasetError(f"data file {path} cannot be read: {first_line(exc)}") from exc
    if table.num_rows == 0:
        check_rows(path, delimiter, len(names))  # names the ragged line, or says there are no data rows
    return arrow_table(path, table, targets, True, setting)


def explain_arrow_error(path: Path, delimiter: str, names: list[str], message: str) -> None:
    """Raise the DatasetError (with the line) behind an Arrow parse error, where it can be found."""
    check_rows(path, delimiter, len(names))  # a row of another width, or no data rows, by its line
    m = re.search(r"In CSV column #(\d+): CSV conversion error to \w+: invalid value '(.*)'", message)
    if m:
        col = names[int(m.group(1))]
        for line_no, line in enumerate(lines(path), start=1):
            if line_no > 1 and line.strip():
                cell = next(csv.reader([line], delimiter=delimiter))[int(m.group(1))].strip()
                if cell and not labels.is_number(cell):
                    raise TextCell(
                        f"data file {path} line {line_no}, column {col!r}: {cell!r} is not a number; features must "
                        "be numbers (fill or remove missing values)"
                    )


def unique_names(path: Path, names: list[str]) -> None:
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DatasetError(
            f"data file {path} has the column {', '.join(map(repr, dup))} more than once; the column names must be "
            "unique"
        )


def arrow_table(path: Path, table: Any, targets: list[str], text: bool, setting: str = "data.target") -> Table:
    """An Arrow table as a :class:`Table`: the features as float64 ``(N, F)``, the targets through labels."""

    names = list(table.column_names)
    unique_names(path, names)
    missing = [t for t in targets if t not in names]
    if missing:
        raise no_column(path, missing, names, setting)
    features = [n for n in names if n not in targets]
    if table.num_rows == 0 or not features:
        raise DatasetError(f"data file {path} has {table.num_rows} rows and {len(features)} feature columns")
    out = Table(path, feature_matrix(path, table, features, text), None, features, targets, text=text)
    if targets:
        columns = [target_cells(table.column(t)) for t in targets]
        out.y, out.missing, out.problem = labels.read_targets(columns, targets, out.where, path)
    return out


def target_cells(col: Any) -> labels.Column:
    """A target column normalised as :mod:`mlptrain.data.files.labels` does it, in Arrow where that is faster.

    Text (a CSV's cells, a Parquet string column) is trimmed; all numbers are cast by Arrow (int64
    exact, else float64: what :func:`labels.as_numbers` makes of them); anything else is dictionary-encoded
    and worked out on its distinct cells (:func:`labels.coded_column`). Typed columns keep their nulls.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type):
        nulls = pc.is_null(col).to_numpy(zero_copy_only=False)
        filler = pa.scalar(False if pa.types.is_boolean(col.type) else 0, col.type)
        return labels.typed_column(pc.fill_null(col, filler).to_numpy(zero_copy_only=False), nulls)
    text = col if pa.types.is_string(col.type) else pc.cast(col, pa.string())  # dates, categories: their text
    text = pc.utf8_trim_whitespace(pc.fill_null(text, ""))  # a null reads as an empty cell: missing
    for to in (pa.int64(), pa.float64()):
        try:  # the first cells first: a failed cast of a whole text column takes as long as a parse
            pc.cast(text.slice(0, 1024), to)
            values = pc.cast(text, to).to_numpy(zero_copy_only=False)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            continue
        return labels.typed_column(values, np.zeros(len(values), bool))
    coded = pc.dictionary_encode(text).combine_chunks()  # (N,) codes into the distinct cells
    uniques = np.asarray(coded.dictionary.to_numpy(zero_copy_only=False), dtype=str)
    return labels.coded_column(uniques, coded.indices.to_numpy(zero_copy_only=False))


def feature_matrix(path: Path, table: Any, features: list[str], text: bool) -> np.ndarray:
    """The feature columns as float64 ``(N, F)`` (a Parquet file's integers cast; nulls as NaN)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    x = table.select(features)
    for j, name in enumerate(features):  # a CSV's are float64 already
        col = table.column(name)
        try:
            x = x if col.type == pa.float64() else x.set_column(j, name, pc.cast(col, pa.float64()))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            row = next(i for i, v in enumerate(col.to_pylist()) if v is not None and not labels.is_number(str(v)))
            where = f"line {row + 2}" if text else f"row {row}"
            raise TextCell(
                f"data file {path} {where}, column {name!r}: {col[row].as_py()!r} is not a number; features must be "
                "numbers (fill or remove missing values)"
            ) from None
    # A batch (a block of the file) at a time: Arrow lays it out column-major (nulls as NaN), NumPy copies it;
    # under half the CPU of copying column by column. The threads share the kernel's first touch of xt's pages.
    xt = np.empty((len(features), table.num_rows), dtype=np.float64)
    batches = [b for b in x.to_batches() if b.num_rows]
    starts = np.cumsum([0, *(b.num_rows for b in batches)])

    def copy(i: int) -> None:
        block = batches[i].to_tensor(null_to_nan=True, row_major=False, memory_pool=pa.system_memory_pool())
        xt[:, starts[i] : starts[i + 1]] = np.asarray(block).T  # (rows, F) column-major -> rows of xt

    with ThreadPoolExecutor(pa.cpu_count()) as threads:  # Arrow's own count (OMP_NUM_THREADS, set_cpu_count)
        list(threads.map(copy, range(len(batches))))
    return xt.T
