"""Your own data files: CSV and TSV with a header row (gzip-compressed too), NPZ, and Parquet.

:func:`read_table` reads one file into a :class:`Table`: the feature columns as float64 ``(N, F)``
and the target column(s) as they are (numbers or strings; :mod:`mlptrain.data.sources` turns them
into labels or regression targets). NumPy alone reads CSV, TSV and NPZ; with ``pyarrow``
installed (``pip install 'mlptrain[arrow]'``) CSV is read by Arrow's multi-threaded parser and
Parquet can be read too.

Every problem is one :class:`~mlptrain.errors.DatasetError` naming the file, the line (or row) and
the column, and what was expected: a missing or empty file, no header row, a target column that
is not there (the columns are listed), a row with another number of fields than the header, a
feature value that is not a number, an NPZ file without ``x`` and ``y``. Reading writes nothing.
"""

from __future__ import annotations

import csv
import gzip
import io
import re
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.errors import DatasetError

# suffix -> (kind, delimiter)
FORMATS = {
    ".csv": ("csv", ","),
    ".csv.gz": ("csv", ","),
    ".tsv": ("csv", "\t"),
    ".tsv.gz": ("csv", "\t"),
    ".tab": ("csv", "\t"),
    ".npz": ("npz", None),
    ".parquet": ("parquet", None),
    ".pq": ("parquet", None),
}


@dataclass
class Table:
    """One file's rows: ``x (N, F)`` float features, ``y (N,)`` or ``(N, T)`` targets as read."""

    path: Path
    x: np.ndarray
    y: Any  # np.ndarray, or None for a file read without its targets
    feature_names: list[str]
    target_names: list[str]
    text: bool = True  # rows are lines of a text file, after a header line
    named: bool = True  # the file names its feature columns (an NPZ file without feature_names does not)

    def where(self, row: int) -> str:
        """``line 7`` of a text file (row 0 is line 2), ``row 5`` of an NPZ or Parquet file."""
        return f"line {row + 2}" if self.text else f"row {row}"


def arrow_available() -> bool:
    try:
        import pyarrow.csv  # noqa: F401
    except ImportError:
        return False
    return True


def file_kind(path: Path) -> tuple[str, str | None]:
    name = path.name.lower()
    for suffix, kind in sorted(FORMATS.items(), key=lambda kv: -len(kv[0])):
        if name.endswith(suffix):
            return kind
    raise DatasetError(f"data file {path}: unknown format; expected a file ending in {', '.join(FORMATS)}")


def read_table(path: str | Path, target: str | list[str], *, reader: str = "auto") -> tuple[Table, Table | None]:
    """The rows of ``path`` (and, for an NPZ holding ``x_test``/``y_test``, its test rows).

    Args:
        path: a CSV/TSV (optionally .gz), NPZ or Parquet file.
        target: the target column, or several (regression); NPZ files hold them as ``y``. An empty
            list reads features only (inputs to score; ``Table.y`` is None).
        reader: ``auto`` (Arrow when installed), ``numpy`` or ``arrow``, for CSV and TSV.
    """
    path = Path(path).expanduser()
    _check_file(path)
    kind, delimiter = file_kind(path)
    targets = [target] if isinstance(target, str) else list(target)
    if kind == "npz":
        return _read_npz(path, need_y=bool(targets))
    if kind == "parquet" or (kind == "csv" and (reader == "arrow" or (reader == "auto" and arrow_available()))):
        return _read_arrow(path, kind, delimiter or ",", targets), None
    return _read_csv_numpy(path, delimiter or ",", targets), None


def _check_file(path: Path) -> None:
    try:
        st = path.stat()
    except OSError:
        raise DatasetError(f"data file {path} does not exist; set data.path to an existing file") from None
    if not stat.S_ISREG(st.st_mode):
        raise DatasetError(f"data file {path} is not a regular file (a directory or a device)")
    if st.st_size == 0:
        raise DatasetError(f"data file {path} is empty; expected a header row and data rows")


# --- CSV and TSV ------------------------------------------------------------------------------


def _lines(path: Path) -> Iterator[str]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", newline="") as f:  # type: ignore[operator]
            yield from f
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise DatasetError(f"data file {path} cannot be read as UTF-8 text ({type(exc).__name__}: {exc})") from exc


def _header(path: Path, delimiter: str, targets: list[str]) -> tuple[list[str], list[int], list[int]]:
    """The column names, and the indices of the feature and the target columns."""
    first = next(_lines(path), "")
    names = [n.strip() for n in next(csv.reader([first], delimiter=delimiter), [])]
    if not any(names):
        raise DatasetError(f"data file {path} line 1 is empty; expected a header row naming the columns")
    missing = [t for t in targets if t not in names]
    if all(_is_number(n) for n in names) or (missing and 2 * sum(map(_is_number, names)) >= len(names)):
        raise DatasetError(
            f"data file {path} has no header row: line 1 holds numbers ({first.strip()[:60]}); the first line must "
            "name the columns"
        )
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup or "" in names:
        raise DatasetError(f"data file {path} line 1: the column names must be unique and non-empty; got {names}")
    if missing:
        raise DatasetError(
            f"data file {path} has no column {', '.join(map(repr, missing))} (data.target); its columns are "
            f"{', '.join(names)}"
        )
    features = [i for i, n in enumerate(names) if n not in targets]
    if not features:
        raise DatasetError(f"data file {path} has only target columns ({', '.join(targets)}); no features")
    return names, features, [names.index(t) for t in targets]


def columns(path: str | Path) -> list[str]:
    """The column names of a data file; an NPZ file's ``feature_names`` (or ``x0 ...``), then ``y`` with targets."""
    path = Path(path).expanduser()
    _check_file(path)
    kind, delimiter = file_kind(path)
    if kind == "csv":
        first = next(_lines(path), "")
        return [n.strip() for n in next(csv.reader([first], delimiter=delimiter or ","), [])]
    if kind == "npz":
        table, _ = _read_npz(path, need_y=False)
        return [*table.feature_names, *(table.target_names if table.y is not None else [])]
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        hint = "pip install 'mlptrain[arrow]'"
        raise DatasetError(f"data file {path}: reading Parquet files needs pyarrow ({hint})") from exc
    return list(pq.read_schema(path).names)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_rows(path: Path, delimiter: str, fields: int) -> int:
    """Every data line has ``fields`` fields (blank lines aside); returns the number of rows."""
    rows = 0
    for line_no, line in enumerate(_lines(path), start=1):
        if line_no == 1 or not line.strip():
            continue
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


def _line_of_row(path: Path, row: int) -> int:
    """The file line of data row ``row`` (blank lines skipped, as NumPy skips them)."""
    seen = -1
    for line_no, line in enumerate(_lines(path), start=1):
        if line_no > 1 and line.strip():
            seen += 1
            if seen == row:
                return line_no
    return row + 2


_NUMPY_BAD = re.compile(r"could not convert string '(.*)' to \w+ at row (\d+), column (\d+)")


def _read_csv_numpy(path: Path, delimiter: str, targets: list[str]) -> Table:
    names, features, target_cols = _header(path, delimiter, targets)
    _check_rows(path, delimiter, len(names))
    opts: dict[str, Any] = {"delimiter": delimiter, "skiprows": 1, "quotechar": '"', "comments": None}
    try:
        x = np.loadtxt(path, usecols=features, dtype=np.float64, ndmin=2, encoding="utf-8", **opts)
    except ValueError as exc:
        m = _NUMPY_BAD.search(str(exc))
        if m is None:
            raise DatasetError(f"data file {path} cannot be read: {exc}") from exc
        value, row, col = m.group(1), int(m.group(2)), int(m.group(3))
        raise DatasetError(
            f"data file {path} line {_line_of_row(path, row)}, column {names[col - 1]!r}: {value!r} is not a number; "
            "features must be numbers (fill or remove missing values)"
        ) from None
    y = None
    if target_cols:
        y = _numbers_if_numeric(np.char.strip(np.loadtxt(path, usecols=target_cols, dtype=str, ndmin=2, **opts)))
    return Table(path, x, y, [names[i] for i in features], targets)


def _numbers_if_numeric(y: np.ndarray) -> np.ndarray:
    """Target cells as float64 when every one is a number, else as strings; ``(N,)`` for one target."""
    y = y[:, 0] if y.ndim == 2 and y.shape[1] == 1 else y
    try:
        return y.astype(np.float64)
    except ValueError:
        return y.astype(str)


# --- Arrow: fast CSV and Parquet --------------------------------------------------------------


def _read_arrow(path: Path, kind: str, delimiter: str, targets: list[str]) -> Table:
    """A CSV's features parsed as float64 (no type guessing), its targets guessed; or a Parquet file.

    Two choices, measured on 1,000,000 x 100 (docs/benchmarks.md). The system allocator: Arrow's own
    (mimalloc) hands freed memory back to the kernel and takes it again as fresh pages, which the
    kernel zeroes (half the CPU of a first read on the 2-core VM). No null spellings (``NA``, ``null``,
    the empty cell...: a tenth of the parse): a feature reads the same without them or fails, and so
    does a target unless it holds a spelling. A failure or such a target reads again with the defaults.
    """
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.csv as pcsv
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DatasetError(
            f"data file {path}: reading {kind} files needs pyarrow (pip install 'mlptrain[arrow]')"
        ) from exc
    if kind == "parquet":
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"data file {path} cannot be read as Parquet: {exc}") from exc
        return _arrow_table(path, table, targets, False)
    names, features, _ = _header(path, delimiter, targets)  # checked as the NumPy path checks it
    kw = {"parse_options": pcsv.ParseOptions(delimiter=delimiter), "memory_pool": pa.system_memory_pool()}
    types = {names[i]: pa.float64() for i in features}
    spellings = pa.array(pcsv.ConvertOptions().null_values)

    def same(col: Any) -> bool:  # whether the defaults read this target the same: integers (no spelling is one),
        if pa.types.is_floating(col.type):  # floats without NaN (nan is the one spelling that parses), text
            return not pc.any(pc.is_nan(col)).as_py()  # without a spelling; not dates or booleans
        text = pa.types.is_string(col.type) and not pc.any(pc.is_in(pc.utf8_trim_whitespace(col), spellings)).as_py()
        return pa.types.is_integer(col.type) or text

    try:
        table = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(column_types=types, null_values=[]), **kw)
        table = table if all(same(table.column(t)) for t in targets) else None
    except (pa.ArrowInvalid, OSError):
        table = None  # a cell that is not a number (or an unreadable file): the second read says which
    try:
        if table is None:  # the first table let go before the second read
            table = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(column_types=types), **kw)
    except (pa.ArrowInvalid, OSError) as exc:
        _explain_arrow_error(path, delimiter, names, str(exc))
        raise DatasetError(f"data file {path} cannot be read: {exc}") from exc
    return _arrow_table(path, table, targets, True)


def _explain_arrow_error(path: Path, delimiter: str, names: list[str], message: str) -> None:
    """Raise the DatasetError (with the line) behind an Arrow parse error, where it can be found."""
    if "columns, got" in message:
        _check_rows(path, delimiter, len(names))  # finds and names the line
    m = re.search(r"In CSV column #(\d+): CSV conversion error to \w+: invalid value '(.*)'", message)
    if m:
        col = names[int(m.group(1))]
        for line_no, line in enumerate(_lines(path), start=1):
            if line_no > 1 and line.strip():
                cell = next(csv.reader([line], delimiter=delimiter))[int(m.group(1))].strip()
                if cell and not _is_number(cell):
                    raise DatasetError(
                        f"data file {path} line {line_no}, column {col!r}: {cell!r} is not a number; features must "
                        "be numbers (fill or remove missing values)"
                    )


def _arrow_table(path: Path, table: Any, targets: list[str], text: bool) -> Table:
    import pyarrow as pa
    import pyarrow.compute as pc

    names = list(table.column_names)
    missing = [t for t in targets if t not in names]
    if missing:
        raise DatasetError(
            f"data file {path} has no column {', '.join(map(repr, missing))} (data.target); its columns are "
            f"{', '.join(names)}"
        )
    features = [n for n in names if n not in targets]
    if table.num_rows == 0 or not features:
        raise DatasetError(f"data file {path} has {table.num_rows} rows and {len(features)} feature columns")
    x = table.select(features)
    for j, name in enumerate(features):  # a CSV's are float64 already; a Parquet file's integers are cast
        col = table.column(name)
        try:
            x = x if col.type == pa.float64() else x.set_column(j, name, pc.cast(col, pa.float64()))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            row = next(i for i, v in enumerate(col.to_pylist()) if v is not None and not _is_number(str(v)))
            where = f"line {row + 2}" if text else f"row {row}"
            raise DatasetError(
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
    cells = [table.column(t).to_numpy(zero_copy_only=False) for t in targets]
    if not cells:
        return Table(path, xt.T, None, features, targets, text=text)
    y = np.stack(cells, axis=1) if len(cells) > 1 else cells[0]
    if y.dtype == object:
        y = np.array(["" if v is None else str(v) for v in y.ravel()]).reshape(y.shape)
    return Table(path, xt.T, y if y.dtype.kind in "fiub" else y.astype(str), features, targets, text=text)


# --- NPZ --------------------------------------------------------------------------------------


def _read_npz(path: Path, need_y: bool = True) -> tuple[Table, Table | None]:
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as exc:  # not a zip, a pickled object, a truncated file
        raise DatasetError(f"data file {path} cannot be read as an NPZ file ({type(exc).__name__}: {exc})") from exc
    missing = [k for k in ("x", "y") if k not in arrays and (k == "x" or need_y)]
    if missing:
        raise DatasetError(
            f"data file {path} holds the arrays {', '.join(sorted(arrays)) or 'none'}; an NPZ dataset needs 'x' "
            "(N, features) and 'y' (N,) or (N, targets), and may hold 'x_test' and 'y_test'"
        )
    tables = []
    for xk, yk in (("x", "y"), ("x_test", "y_test")):
        if xk not in arrays and yk not in arrays:
            continue
        if (xk in arrays) != (yk in arrays) and (need_y or xk not in arrays):
            raise DatasetError(f"data file {path} holds {xk if xk in arrays else yk} without its partner")
        x, y = arrays[xk], arrays.get(yk, np.zeros((len(arrays[xk]), 0)))
        if x.ndim != 2 or y.ndim not in (1, 2) or len(x) != len(y) or not np.issubdtype(x.dtype, np.number):
            raise DatasetError(
                f"data file {path}: {xk} is {x.dtype} {x.shape} and {yk} is {y.dtype} {y.shape}; expected numbers "
                "(N, features) and (N,) or (N, targets)"
            )
        t = y.shape[1] if y.ndim == 2 else 1
        names = [str(s) for s in arrays["feature_names"]] if "feature_names" in arrays else None
        targets = [str(s) for s in arrays["target_names"]] if "target_names" in arrays else [f"y{i}" for i in range(t)]
        features = names or [f"x{i}" for i in range(x.shape[1])]
        has_y = yk in arrays
        x64 = x.astype(np.float64, copy=False)
        tables.append(
            Table(path, x64, y if has_y else None, features, targets if has_y else [], text=False, named=bool(names))
        )
    return tables[0], (tables[1] if len(tables) > 1 else None)


def write_csv(path: Path, x: np.ndarray, y: np.ndarray, feature_names: list[str], target: str = "label") -> None:
    """Write features and one target column as a CSV with a header (gzip-compressed for ``.gz``)."""
    text = io.StringIO()
    w = csv.writer(text, lineterminator="\n")
    w.writerow([*feature_names, target])
    for row, label in zip(x.tolist(), y.tolist(), strict=True):
        w.writerow([*(repr(v) for v in row), label])
    data = text.getvalue().encode("utf-8")
    Path(path).write_bytes(gzip.compress(data, mtime=0) if str(path).endswith(".gz") else data)
