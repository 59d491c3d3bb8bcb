"""Your own data files: CSV and TSV with a header row (gzip-compressed too), NPZ, and Parquet.

:func:`read_table` reads one file into a :class:`Table`: the feature columns as float64 ``(N, F)``
and the target column(s) normalised the same by every reader (:mod:`mlptrain.data.files.labels`: numbers
or text, missing cells marked); :mod:`mlptrain.data.user_source` turns them into labels or
regression targets. NumPy alone reads CSV, TSV and NPZ (:mod:`~mlptrain.data.files.csv_reader`,
:mod:`~mlptrain.data.files.npz_reader`); with ``pyarrow`` installed (``pip install -e '.[arrow]'``) CSV
is read by Arrow's multi-threaded parser and Parquet can be read too (:mod:`~mlptrain.data.files.arrow_reader`).

Every problem is one :class:`~mlptrain.base.errors.DatasetError` naming the file, the line (or row) and
the column, and what was expected: a missing or empty file, no header row, a target column that
is not there (the columns are listed), a row with another number of fields than the header, a
feature value that is not a number, an NPZ file without ``x`` and ``y``. Reading writes nothing.
"""

from __future__ import annotations

import csv
import gzip
import io
import stat
from pathlib import Path

import numpy as np

from mlptrain.base.errors import DatasetError
from mlptrain.base.fs import file_type
from mlptrain.data.files.arrow_reader import read_arrow
from mlptrain.data.files.csv_reader import header_names, read_csv_numpy
from mlptrain.data.files.npz_reader import read_npz
from mlptrain.data.files.table import Table

__all__ = ["FORMATS", "Table", "arrow_available", "check_file", "columns", "file_kind", "read_table", "write_csv"]

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


def read_table(
    path: str | Path,
    target: str | list[str],
    *,
    reader: str = "auto",
    setting: str = "data.path",
    target_setting: str = "data.target",
) -> tuple[Table, Table | None]:
    """The rows of ``path`` (and, for an NPZ holding ``x_test``/``y_test``, its test rows).

    Args:
        path: a CSV/TSV (optionally .gz), NPZ or Parquet file.
        target: the target column, or several (regression); NPZ files hold them as ``y``. An empty
            list reads features only (inputs to score; ``Table.y`` is None).
        reader: ``auto`` (Arrow when installed), ``numpy`` or ``arrow``, for CSV and TSV.
        setting: the setting that named ``path``, for the messages (``predict`` passes ``input``).
        target_setting: the setting that named ``target`` (``predict`` passes ``keep``).
    """
    path = Path(path).expanduser()
    check_file(path, setting)
    kind, delimiter = file_kind(path)
    targets = [target] if isinstance(target, str) else list(target)
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if twice:
        raise DatasetError(
            f"{target_setting}={targets} names the column {', '.join(map(repr, twice))} more than once; name each "
            "target column once"
        )
    if kind == "npz":
        return read_npz(path, need_y=bool(targets))
    if kind == "parquet" or (kind == "csv" and (reader == "arrow" or (reader == "auto" and arrow_available()))):
        return read_arrow(path, kind, delimiter or ",", targets, target_setting), None
    return read_csv_numpy(path, delimiter or ",", targets, target_setting), None


def check_file(path: Path, setting: str = "data.path") -> None:
    """Raise DatasetError unless ``path`` is a non-empty regular file (or a link to one): a FIFO or a device
    (``/dev/zero``) would be read forever, so it is refused before anything opens it."""
    try:
        st = path.stat()
    except OSError:
        raise DatasetError(f"data file {path} does not exist; set {setting} to an existing file") from None
    if not stat.S_ISREG(st.st_mode):
        raise DatasetError(
            f"{setting}={path} is {file_type(st.st_mode)}, not a regular file; set {setting} to a data file (CSV, "
            "TSV, NPZ or Parquet)"
        )
    if st.st_size == 0:
        raise DatasetError(f"data file {path} is empty; expected a header row and data rows")


def columns(path: str | Path, *, setting: str = "data.path") -> list[str]:
    """The column names of a data file; an NPZ file's ``feature_names`` (or ``x0 ...``), then ``y`` with targets."""
    path = Path(path).expanduser()
    check_file(path, setting)
    kind, delimiter = file_kind(path)
    if kind == "csv":
        return header_names(path, delimiter or ",")
    if kind == "npz":
        table, _ = read_npz(path, need_y=False)
        return [*table.feature_names, *(table.target_names if table.y is not None else [])]
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        hint = "pip install -e '.[arrow]'"
        raise DatasetError(f"data file {path}: reading Parquet files needs pyarrow ({hint})") from exc
    try:
        return list(pq.read_schema(path).names)
    except Exception as exc:  # not Parquet, truncated
        raise DatasetError(f"data file {path} cannot be read as Parquet ({type(exc).__name__})") from exc


def write_csv(path: Path, x: np.ndarray, y: np.ndarray, feature_names: list[str], target: str = "label") -> None:
    """Write features and one target column as a CSV with a header (gzip-compressed for ``.gz``)."""
    text = io.StringIO()
    w = csv.writer(text, lineterminator="\n")
    w.writerow([*feature_names, target])
    for row, label in zip(x.tolist(), y.tolist(), strict=True):
        w.writerow([*(repr(v) for v in row), label])
    data = text.getvalue().encode("utf-8")
    Path(path).write_bytes(gzip.compress(data, mtime=0) if str(path).endswith(".gz") else data)
