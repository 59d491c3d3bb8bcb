"""NPZ files: ``x`` (N, features) and ``y``, optionally ``x_test``/``y_test``, ``feature_names``, ``target_names``.

Arrays are read without pickle (a pickled object could run code): names saved as a Python object
array (a pandas ``Index``, a list of mixed objects) are refused with the way to save them as text.
``feature_names`` must name every column of ``x`` once; ``x_test`` must have ``x``'s columns.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mlptrain.data import labels
from mlptrain.data.table import Table
from mlptrain.errors import DatasetError

SHAPES = "an NPZ dataset needs 'x' (N, features) and 'y' (N,) or (N, targets), and may hold 'x_test' and 'y_test'"


def _arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        npz = np.load(path, allow_pickle=False)
    except Exception as exc:  # not a zip, a pickled object, a truncated file
        raise DatasetError(f"data file {path} cannot be read as an NPZ file ({type(exc).__name__}: {exc})") from exc
    with npz:
        arrays = {}
        for k in npz.files:
            try:
                arrays[k] = npz[k]
            except ValueError as exc:
                if "allow_pickle" not in str(exc):
                    raise DatasetError(f"data file {path}: its array {k!r} cannot be read ({exc})") from exc
                raise DatasetError(
                    f"data file {path}: its array {k!r} is an array of Python objects (a pandas Index, say), which is "
                    f"not read (unpickling could run code); save it as text: np.savez(..., {k}=np.array(names, "
                    "dtype=str))"
                ) from None
            except Exception as exc:  # a truncated member
                raise DatasetError(f"data file {path}: its array {k!r} cannot be read ({exc})") from exc
    return arrays


def _names(path: Path, arrays: dict[str, np.ndarray], key: str, count: int) -> list[str] | None:
    """``feature_names`` or ``target_names``: one unique name per column (``count``), or None."""
    if key not in arrays:
        return None
    names = [str(s) for s in np.ravel(arrays[key])]
    dup = sorted({n for n in names if names.count(n) > 1})
    if len(names) != count or dup:
        why = f"{', '.join(map(repr, dup))} more than once" if dup else f"{len(names)} names"
        raise DatasetError(
            f"data file {path}: {key} holds {why} for {count} columns; expected one unique name per column"
        )
    return names


def read_npz(path: Path, need_y: bool = True) -> tuple[Table, Table | None]:
    arrays = _arrays(path)
    missing = [k for k in ("x", "y") if k not in arrays and (k == "x" or need_y)]
    if missing:
        raise DatasetError(f"data file {path} holds the arrays {', '.join(sorted(arrays)) or 'none'}; {SHAPES}")
    tables: list[Table] = []
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
        if 0 in x.shape:
            raise DatasetError(f"data file {path}: {xk} has the shape {x.shape}; expected at least one row and column")
        if tables and x.shape[1] != tables[0].x.shape[1]:
            raise DatasetError(
                f"data file {path}: x_test has {x.shape[1]} columns, x has {tables[0].x.shape[1]}; the test rows "
                "need the training rows' features"
            )
        tables.append(_table(path, arrays, x, y if yk in arrays else None))
    return tables[0], (tables[1] if len(tables) > 1 else None)


def _table(path: Path, arrays: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray | None) -> Table:
    names = _names(path, arrays, "feature_names", x.shape[1])
    features = names or [f"x{i}" for i in range(x.shape[1])]
    kept = x.dtype in (np.float16, np.float32, np.float64)  # floats as saved (no copy); integers and others as float64
    table = Table(path, x if kept else x.astype(np.float64), None, features, [], text=False, named=bool(names))
    if y is not None:
        cols = y.reshape(len(y), -1)  # (N, T)
        table.target_names = _names(path, arrays, "target_names", cols.shape[1]) or [
            f"y{i}" for i in range(cols.shape[1])
        ]
        columns = [
            labels.text_column(c) if c.dtype.kind in "US" else labels.typed_column(c, np.zeros(len(c), bool))
            for c in cols.T
        ]
        y_all, table.missing, table.problem = labels.read_targets(columns, table.target_names, table.where, path)
        table.y = y_all.reshape(len(y), -1) if y.ndim == 2 else y_all  # (N, T) stays (N, T), for T = 1 too
    return table
