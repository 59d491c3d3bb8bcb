"""``data=file``: the user's files as a dataset: labels or regression targets, checked.

``data.path`` is read (through the binary cache with ``data.cache=true``, :mod:`mlptrain.data.files.cache`);
``data.test_path``, or the ``x_test``/``y_test`` arrays of an NPZ file, is the test split, else one
is split off the training rows. Then, naming the file, the line and the column of every problem:

* ``data.task=auto`` decides: several target columns, or a numeric column with non-integer values,
  is a regression; integer or text labels are a classification, except whole numbers with many distinct
  values for the rows (more than 20, under 10 rows a value on average), which are refused as ambiguous;
* classification: the classes are the training labels, sorted (their names are kept: ``cat``,
  ``dog``, or ``3``, ``7``); one class only is refused, and so is a test label never seen in training;
* regression: the targets must be numbers;
* features and targets must be finite and within float32's range, where they are normalised (or
  scaled) and trained; a test file must have the training file's columns;
* a missing target (an empty cell, ``NA``, ``null``, ``NaN``: :mod:`mlptrain.data.files.labels`) is an
  error naming the rows, or with ``data.missing=drop`` the row is dropped (counted in the log);
  a target column that mixes numbers and text is an error; whole-number labels must be exact.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from mlptrain.base.errors import DatasetError
from mlptrain.config.schema import DataConfig
from mlptrain.data.dataset import Raw, first_nonfinite
from mlptrain.data.files import cache, labels
from mlptrain.data.files.cells import read_cells, select
from mlptrain.data.files.chunks import log_phase, max_abs, timed
from mlptrain.data.files.npz_reader import in_place
from mlptrain.data.files.plan import empty_cells
from mlptrain.data.files.readers import Table, check_file, file_kind, read_table
from mlptrain.data.files.table import TextCell
from mlptrain.data.files.weights import take_weights

log = logging.getLogger(__name__)
FLOAT32_MAX = float(np.finfo(np.float32).max)  # features are normalised and trained in float32


def load_file(cfg: DataConfig, rng: np.random.Generator) -> Raw:
    """The :class:`Raw` data of ``cfg.path`` (and ``cfg.test_path``); parsed files are cached once they pass.

    A cache entry whose recorded identity still holds is read without reading the file
    (:func:`mlptrain.data.files.cache.trusted`); otherwise the file's SHA-256 (:class:`cache.SourceHash`) is
    taken on a thread of its own while the file is parsed (hashlib releases the GIL), and a file that
    passes is written to the cache on that thread while the caller splits and normalises it
    (``Raw.pending``); a file whose identity changed meanwhile is not cached (the hash and the parse
    may have read different bytes). An NPZ whose tables are memory-mapped where they lie
    (:func:`mlptrain.data.files.npz_reader.in_place`) is read as it is: a cache entry would be a copy of it.
    """
    target = cfg.target if isinstance(cfg.target, str) else list(cfg.target)
    files = [str(cfg.path), *([str(cfg.test_path)] if cfg.test_path else [])]
    for f, setting in zip(files, ("data.path", "data.test_path"), strict=False):
        check_file(Path(f).expanduser(), setting)  # before a thread hashes it: a FIFO would be read forever
    if cfg.drop or cfg.categorical or not isinstance(cfg.features, (int, str, type(None))):
        return load_cells(cfg, files, target)
    try:
        return _load_numbers(cfg, files, target)
    except TextCell as exc:  # text or an empty cell: the column plan reads the table as text
        first = str(exc).split("; ")[0]  # "data file F line 2, column 'c': 'x' is not a number" (not the advice)
        log.info("%s: the columns are read as text and encoded by the column plan (docs/data.md)", first)
        return load_cells(cfg, files, target)


def load_cells(cfg: DataConfig, files: list[str], target: str | list[str]) -> Raw:
    """The :class:`Raw` data of a table read as text cells (``Raw.tables``), each feature column encoded once the
    splits are known (:func:`mlptrain.data.prepare.encode_columns`); ``data.drop`` and ``data.features`` applied."""
    targets = [target] if isinstance(target, str) else list(target)
    keep = None if cfg.features is None or isinstance(cfg.features, int) else list(cfg.features)
    if keep is not None and cfg.weight and cfg.weight not in keep:
        keep.append(cfg.weight)  # kept by data.features too, then taken out of the features (_weighed)
    tables = []
    for f in files:
        path = Path(f).expanduser()
        kind, delimiter = file_kind(path)
        if kind == "npz" and _has_test(path):
            raise DatasetError(f"data file {path}: an NPZ file with x_test is read as numbers only; set data.test_path")
        table = select(read_cells(path, kind, delimiter, targets), list(cfg.drop), keep, list(cfg.categorical))
        tables.append(_complete(table, str(cfg.missing)))
    for table in tables:
        if str(cfg.impute) == "error":
            refuse_empty(table)
    train, test, w = _weighed(cfg, tables[0], tables[1] if len(tables) > 1 else None)
    return dataclasses.replace(_raw(cfg, train, test), tables=(train, test), w=w)


def _weighed(cfg: DataConfig, train: Table, test: Table | None) -> tuple[Table, Table | None, np.ndarray | None]:
    """``(train, test, w)``: ``data.weight``'s column taken out of both tables' features, and the training
    file's weights ``w (N,)`` (:mod:`mlptrain.data.files.weights`); without ``data.weight``, the tables and None."""
    if not cfg.weight:
        return train, test, None
    train, w = take_weights(train, str(cfg.weight))
    if test is not None:  # a test file may have the column or not: its weights are not used
        test, _ = take_weights(test, str(cfg.weight), required=False)
    return train, test, w


def _has_test(path: Path) -> bool:
    with np.load(path, allow_pickle=False) as npz:
        return "x_test" in npz.files


def refuse_empty(table: Table) -> None:
    """``data.impute=error``: an empty feature cell is refused, naming its line and column."""
    for name, cells in (table.cells or {}).items():
        rows = np.flatnonzero(empty_cells(cells))
        if len(rows):
            raise DatasetError(
                f"data file {table.path} {table.where(int(rows[0]))}, column {name!r}: an empty cell ({len(rows)} in "
                "the column); fill them, or let data.impute=fill fill them with the training median"
            )


def _load_numbers(cfg: DataConfig, files: list[str], target: str | list[str]) -> Raw:
    worker = ThreadPoolExecutor(1, thread_name_prefix="mlptrain-data-file")  # the hashes, then the cache writes
    try:
        hashes = [cache.SourceHash(f, worker) if cfg.cache and not _in_place(f) else None for f in files]
        cached = [cache.load(f, target, h) if h else None for f, h in zip(files, hashes, strict=True)]
        for h, c in zip(hashes, cached, strict=True):
            if h is not None and c is None:
                h.start()  # hashed while it is parsed, for the entry written after
        parsed = [c if c is not None else _read(f, target) for f, c in zip(files, cached, strict=True)]
        train, test = parsed[0][0], parsed[1][0] if cfg.test_path else parsed[0][1]
        missing = str(cfg.missing)
        with timed("check", sum(t.x.nbytes for t in (train, test) if t is not None)):
            train, test, w = _weighed(
                cfg, _complete(train, missing), None if test is None else _complete(test, missing)
            )
            raw = _raw(cfg, train, test)
        writes = [
            worker.submit(_store, f, target, p, h)
            for f, h, c, p in zip(files, hashes, cached, parsed, strict=True)
            if h is not None and c is None
        ]  # written while the data is split and normalised: load_dataset waits for them
    finally:
        worker.shutdown(wait=False)
    return dataclasses.replace(raw, pending=writes, w=w)


def _in_place(path: str) -> bool:
    if not in_place(path):
        return False
    log.info("data file %s: its tables are memory-mapped in the NPZ (stored uncompressed); not cached", path)
    return True


def _store(path: str, target: str | list[str], tables: tuple[Table, Table | None], source: cache.SourceHash) -> None:
    taken = source()  # on this thread, hashed before: the worker runs its jobs in order
    if _unchanged(path, taken):
        cache.store(path, target, tables, taken)


def _read(path: str, target: str | list[str]) -> tuple[Table, Table | None]:
    start = time.perf_counter()
    tables = read_table(path, target)
    log_phase("read", start, os.stat(path).st_size)
    return tables


def _unchanged(path: str, source: dict | None) -> bool:
    """Whether ``path`` is still the file it was when ``source`` (:func:`cache.source_of`) was taken."""
    now = cache.identity_of(path)
    same = source is not None and now is not None and all(now[k] == source[k] for k in cache.IDENTITY)
    if source is not None and not same:
        log.info("data file %s changed while it was read; it is not cached", path)
    return same


def _complete(table: Table, missing: str) -> Table:
    """``table`` with no missing target: refused (naming the rows), or those rows dropped (``missing=drop``)."""
    if table.problem:
        raise DatasetError(table.problem)
    if table.missing is None or not table.missing.any():
        return table
    rows = np.flatnonzero(table.missing)
    if missing != "drop":
        verb = "has" if len(rows) == 1 else "have"
        raise DatasetError(
            f"data file {table.path} {table.where_rows(rows)}: {len(rows)} of {len(table.missing)} rows {verb} no "
            f"target (an empty cell, NA, null or NaN in {', '.join(table.target_names)}); fill them, or drop those "
            "rows with data.missing=drop"
        )
    keep = np.flatnonzero(~table.missing)
    where = table.where_rows(rows)
    log.warning(
        "data file %s: %d of %d rows dropped, %s: no target (data.missing=drop)",
        table.path,
        len(rows),
        len(table.missing),
        where,
    )
    y = np.asarray(table.y)[keep]
    cells = None if table.cells is None else {k: v[keep] for k, v in table.cells.items()}
    return dataclasses.replace(table, x=np.asarray(table.x)[keep], y=y, missing=None, rows=keep, cells=cells)


def _raw(cfg: DataConfig, train: Table, test: Table | None) -> Raw:
    if cfg.test_path and test is not None:
        if (test.feature_names, test.target_names) != (train.feature_names, train.target_names):
            raise DatasetError(
                f"test file {test.path} has the columns {[*test.feature_names, *test.target_names]}, the training file "
                f"{train.path} has {[*train.feature_names, *train.target_names]}; they must be the same"
            )
    tables = [t for t in (train, test) if t is not None]
    for table in tables:
        _check_finite(table, table.x, table.feature_names, "features")
    task = _task(cfg.task.value, train)
    if task == "regression":
        ys = [_regression_targets(t) for t in tables]
        return Raw(
            train.x,
            ys[0],
            _x(test),
            ys[1] if test else None,
            ys[0].shape[1],
            None,
            task,
            train.feature_names,
            train.target_names,
        )
    classes, names = _classes(train)
    ys = [_labels(t, classes) for t in tables]
    return Raw(train.x, ys[0], _x(test), ys[1] if test else None, len(classes), names, task, train.feature_names)


def _x(table: Table | None) -> np.ndarray | None:
    return None if table is None else table.x


def _task(task: str, train: Table) -> str:
    if task != "auto":
        return task
    y = train.y
    if y.ndim == 2:  # several target columns
        return "regression"
    if y.dtype.kind in "fc" and not np.all(np.mod(y[np.isfinite(y)], 1) == 0):
        return "regression"  # fractional values
    values = len(np.unique(y[np.isfinite(y)] if y.dtype.kind in "fc" else y)) if y.dtype.kind in "fciu" else 0
    if values > AMBIGUOUS_VALUES and len(y) < AMBIGUOUS_ROWS * values:  # a quantity, or classes?
        raise DatasetError(
            f"data file {train.path}: the target column {train.target_names[0]!r} holds {values} distinct whole "
            f"numbers in {len(y)} rows ({len(y) / values:.1f} rows a value), which reads as a quantity as well as as "
            "classes; set data.task=regression with model.loss=mse (or model.loss=mse alone), or "
            "data.task=classification"
        )
    return "classification"


# data.task=auto refuses a whole-number target with more distinct values than this ...
AMBIGUOUS_VALUES = 20
AMBIGUOUS_ROWS = 10  # ... and fewer training rows a value than this on average: a quantity, or classes?


def _check_finite(table: Table, values: np.ndarray, names: list[str], what: str) -> None:
    flat = values.reshape(len(values), -1)  # (N, columns)
    if flat.size == 0:  # text cells, not yet encoded (the column plan checks them)
        return
    bad = first_nonfinite(flat)
    if bad is not None:
        row, col = bad
        error = TextCell if what == "features" and np.isnan(flat[bad]) else DatasetError  # NaN: an empty cell
        raise error(
            f"data file {table.path} {table.where(row)}, column {names[col]!r}: {flat[bad]} is not a finite number; "
            f"{what} must be finite (fill or remove missing values)"
        )
    wide = flat.dtype.kind == "f" and flat.dtype.itemsize > 4  # finite narrower values are within float32's range
    if len(flat) and wide and max_abs(flat) > FLOAT32_MAX:
        at = np.unravel_index(int(np.argmax(np.abs(flat))), flat.shape)
        how = "features are normalised and trained" if what == "features" else "targets are scaled and trained"
        raise DatasetError(
            f"data file {table.path} {table.where(int(at[0]))}, column {names[int(at[1])]!r}: {flat[at]:g} is beyond "
            f"float32's range (+-{FLOAT32_MAX:.3g}), in which {how}; rescale the column"
        )


def _regression_targets(table: Table) -> np.ndarray:
    y = table.y
    if y.dtype.kind not in "fiub":
        row = next(i for i, v in enumerate(y.reshape(len(y), -1)) if not _all_numbers(v))
        raise DatasetError(
            f"data file {table.path} {table.where(row)}: target {y.reshape(len(y), -1)[row].tolist()} is not a number; "
            f"a regression needs numeric targets in {', '.join(table.target_names)} (data.task=regression, or auto "
            "with a regression loss such as model.loss=mse; for mse on one-hot classes set data.task=classification)"
        )
    y = y.reshape(len(y), -1)  # (N, T) as read: a value beyond float32's range is named as such, not as inf
    _check_finite(table, y, table.target_names, "targets")
    return y.astype(np.float32)


def _all_numbers(values: np.ndarray) -> bool:
    try:
        np.asarray(values, dtype=np.float64)
    except ValueError:
        return False
    return True


def _classes(train: Table) -> tuple[np.ndarray, list[str]]:
    y = train.y
    if y.dtype.kind in "fc":
        labels.check_exact(y, train.target_names[0], train.where, train.path)
        y = y.astype(np.int64)  # whole and exact: checked
    classes = np.unique(y)
    if len(classes) < 2:
        raise DatasetError(
            f"data file {train.path}: the target column {train.target_names[0]!r} holds one class only "
            f"({classes[0] if len(classes) else 'no rows'}); a classifier needs at least two"
        )
    return classes, [str(c) for c in classes]


def _labels(table: Table, classes: np.ndarray) -> np.ndarray:
    """The class index of every row; a label the training file does not have is an error."""
    y = table.y
    if y.ndim != 1:
        raise DatasetError(
            f"data file {table.path}: a classification takes one target column, got {table.target_names}"
        )
    if y.dtype.kind in "fc":
        if not np.all(np.mod(y, 1) == 0):
            row = int(np.flatnonzero(np.mod(y, 1) != 0)[0])
            raise DatasetError(f"data file {table.path} {table.where(row)}: label {y[row]} is not a whole number")
        labels.check_exact(y, table.target_names[0], table.where, table.path)
        y = y.astype(np.int64)
    if classes.dtype.kind != y.dtype.kind and not (classes.dtype.kind in "iu" and y.dtype.kind in "iu"):
        y, classes = y.astype(str), classes.astype(str)
    idx = np.searchsorted(classes, y)
    idx[idx >= len(classes)] = 0
    unknown = np.flatnonzero(classes[idx] != y)
    if len(unknown):
        row = int(unknown[0])
        raise DatasetError(
            f"data file {table.path} {table.where(row)}: label {y[row].item()!r} is not among the training labels "
            f"({', '.join(map(str, classes[:20]))}{', ...' if len(classes) > 20 else ''})"
        )
    return idx.astype(np.int64)
