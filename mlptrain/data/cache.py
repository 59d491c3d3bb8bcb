"""A parsed data file kept as NumPy arrays, memory-mapped by the next run (``data.cache=true``).

Parsing a large CSV takes seconds to minutes; the second run of the same file reads
``<cache>/tables/<key>/`` instead: ``x.npy`` memory-mapped, the targets and the column names. The
entry is keyed by the file's path and the target columns, and stamped with the file's size,
modification time and SHA-256: a file whose size and time are unchanged is read from the cache at
once; one that was only touched (same bytes) is recognised by its content; any other change parses
the file again. The cache lives in :func:`mlptrain.files.cache_root`, never in a run directory,
and a cache that cannot be read or written is skipped with a warning: it never stops a run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from mlptrain.data.files import Table, read_table
from mlptrain.files import cache_root, fsync_dir, sha256_file

log = logging.getLogger(__name__)


def _entry(path: Path, target: str | list[str]) -> Path:
    key = hashlib.sha256(json.dumps([str(path), target]).encode()).hexdigest()[:24]
    return cache_root() / "tables" / key


def load(path: str | Path, target: str | list[str]) -> tuple[Table, Table | None] | None:
    """The cached tables of ``path``, or None when there is no usable entry (then parse and :func:`store`)."""
    path = Path(path).expanduser().resolve()
    folder = _entry(path, target)
    try:
        st = path.stat()
        meta = json.loads((folder / "meta.json").read_text())
        fresh = meta["size"] == st.st_size and meta["mtime_ns"] == st.st_mtime_ns
        if fresh or (meta["size"] == st.st_size and sha256_file(path) == meta["sha256"]):
            log.info("data file %s: read from its cache %s", path, folder)
            return _load(folder, meta, path)
    except (OSError, ValueError, KeyError):
        pass  # no entry yet, or one that cannot be used
    return None


def store(path: str | Path, target: str | list[str], tables: tuple[Table, Table | None]) -> None:
    """Keep ``tables`` (parsed from ``path`` and checked) for the next run; a failure only warns."""
    path = Path(path).expanduser().resolve()
    folder = _entry(path, target)
    try:
        _store(folder, tables, path)
    except OSError as exc:
        log.warning("could not cache the parsed data file %s in %s (%s)", path, folder, exc)


def read_cached(path: str | Path, target: str | list[str], *, reader: str = "auto") -> tuple[Table, Table | None]:
    """:func:`mlptrain.data.files.read_table` through the cache (stored at once: for files known to be good)."""
    tables = load(path, target)
    if tables is None:
        tables = read_table(path, target, reader=reader)
        store(path, target, tables)
    return tables


def _store(folder: Path, tables: tuple[Table, Table | None], path: Path) -> None:
    st = path.stat()
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    parts = {}
    for split, table in zip(("train", "test"), tables, strict=True):
        if table is None:
            continue
        np.save(tmp / f"{split}_x.npy", np.ascontiguousarray(table.x))
        np.save(tmp / f"{split}_y.npy", table.y)
        parts[split] = {"features": table.feature_names, "targets": table.target_names, "text": table.text}
    meta = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path), "parts": parts}
    (tmp / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)  # a whole entry or none
    fsync_dir(folder.parent)


def _load(folder: Path, meta: dict, path: Path) -> tuple[Table, Table | None]:
    out: list[Table | None] = []
    for split in ("train", "test"):
        part = meta["parts"].get(split)
        if part is None:
            out.append(None)
            continue
        x = np.load(folder / f"{split}_x.npy", mmap_mode="r", allow_pickle=False)
        y = np.load(folder / f"{split}_y.npy", allow_pickle=False)
        out.append(Table(path, x, y, part["features"], part["targets"], text=part["text"]))
    if out[0] is None:
        raise ValueError("no training rows in the cache entry")
    return out[0], out[1]
