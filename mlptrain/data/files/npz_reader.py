"""NPZ files: ``x`` (N, features) and ``y``, optionally ``x_test``/``y_test``, ``feature_names``, ``target_names``.

Arrays are read without pickle (a pickled object could run code): names saved as a Python object
array (a pandas ``Index``, a list of mixed objects) are refused with the way to save them as text.
``feature_names`` must name every column of ``x`` once; ``x_test`` must have ``x``'s columns.

The tables ``x`` and ``x_test`` of an NPZ saved without compression (``np.savez``) are memory-mapped
where they lie in the zip (:func:`stored_member`: the member's data offset, past its local header and
its ``.npy`` header), so reading them copies nothing and the first pass over them reads the page
cache; a compressed member (``np.savez_compressed``) is inflated into memory as NumPy reads it.
Such a table is not copied into the cache either (:func:`in_place`): there is nothing to parse.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mlptrain.base.errors import DatasetError
from mlptrain.data.dataset import check_real
from mlptrain.data.files import labels
from mlptrain.data.files.table import Table

TABLES = ("x", "x_test")  # the members memory-mapped in place when stored
_LOCAL_HEADER = 30  # bytes of a zip member's local header before its name and extra field
SHAPES = "an NPZ dataset needs 'x' (N, features) and 'y' (N,) or (N, targets), and may hold 'x_test' and 'y_test'"


class Member(NamedTuple):
    """Where an uncompressed ``.npy`` member's array lies in its zip file."""

    offset: int  # of the first data byte, from the start of the file
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool


def stored_member(path: Path, name: str) -> Member | None:
    """The place of member ``name`` (``"x"``) of the NPZ ``path`` when it can be memory-mapped: stored
    (not compressed, not encrypted), a ``.npy`` of format 1.0 or 2.0, a non-empty array of numbers,
    all of its bytes inside the member. None otherwise (then it is read as NumPy reads it).

    A zip member's data starts after its *local* header (30 bytes, its name and an extra field whose
    length may differ from the central directory's), and the array's bytes after the ``.npy`` header.
    """
    try:
        with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
            info = zf.getinfo(f"{name}.npy")
            if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
                return None
            f.seek(info.header_offset)
            local = f.read(_LOCAL_HEADER)
            if len(local) < _LOCAL_HEADER or local[:4] != b"PK\x03\x04":
                return None
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            start = info.header_offset + _LOCAL_HEADER + name_len + extra_len
            f.seek(start)
            version = np.lib.format.read_magic(f)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read_header:
                return None
            shape, fortran, dtype = read_header[version](f)
            offset = f.tell()
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, struct.error):
        return None  # read as NumPy reads it, which names what is wrong
    size = int(np.prod(shape)) * dtype.itemsize
    if dtype.hasobject or dtype.kind not in "biuf" or size == 0 or offset + size > start + info.file_size:
        return None
    return Member(offset, tuple(shape), dtype, bool(fortran))


def in_place(path: str | Path) -> bool:
    """Whether every table of the NPZ ``path`` (``x``, and ``x_test`` if it has one) is memory-mapped
    where it lies, in a float dtype kept as saved: then the file is read as fast as a cache entry."""
    path = Path(path).expanduser()
    if not path.name.lower().endswith(".npz"):
        return False
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n[: -len(".npy")] for n in zf.namelist() if n.endswith(".npy")]
    except (OSError, zipfile.BadZipFile):
        return False
    members = [stored_member(path, t) for t in TABLES if t in names]
    return bool(members) and all(m is not None and m.dtype.kind == "f" for m in members)


def _mapped(path: Path, member: Member) -> np.ndarray:
    """The member's array, a read-only memory map of its bytes in the zip file (no copy)."""
    return np.memmap(path, member.dtype, "r", member.offset, member.shape, "F" if member.fortran else "C")


def _arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        npz = np.load(path, allow_pickle=False)
    except Exception as exc:  # not a zip, a pickled object, a truncated file
        raise DatasetError(f"data file {path} cannot be read as an NPZ file ({type(exc).__name__}: {exc})") from exc
    with npz:
        arrays = {}
        for k in npz.files:
            member = stored_member(path, k) if k in TABLES else None
            if member is not None:
                arrays[k] = _mapped(path, member)
                continue
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
        for k, a in ((xk, x), (yk, y)):
            check_real(a, f"data file {path}: {k}")
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
