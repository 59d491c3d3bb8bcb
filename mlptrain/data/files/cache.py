"""A parsed data file kept as NumPy arrays, memory-mapped by the next run (``data.cache=true``).

Parsing a large CSV takes seconds to minutes; the second run of the same file reads
``<cache>/tables/<key>/`` instead: ``x.npy`` memory-mapped, the targets and the column names. The
entry is keyed by the file's path and the target columns, and trusts nothing it cannot check:

* the source by its content: the SHA-256 of the file's bytes, taken before it is parsed, is stored
  with the entry beside the file's identity when it was hashed (resolved path, size, ``mtime_ns``,
  ``ctime_ns``, inode and device: what ``make``, pip and git's index go by). A later look-up that
  finds the same identity trusts the stored hash (:func:`trusted`); any other identity (a file
  rewritten, touched, replaced, its time restored: that sets ``ctime``) hashes the file again and
  compares. A file whose time is within :data:`RACY_NS` of its hashing is hashed again all the same,
  as git treats a "racily clean" entry: a write in the same clock tick as the hash leaves the time
  unchanged. Hashing costs a fraction of a parse (docs/benchmarks.md, "The data cache's checks");
* every array by its shape, dtype and a checksum (:func:`checksum`, a vectorised position-weighted
  sum, linear in the size), on every read: an array overwritten, truncated or of another shape
  is found;
* the metadata by its own checksum (:func:`seal`: the SHA-256 of ``meta.json``'s record with the
  file's path and target columns), on every read: feature names swapped, another entry's
  ``meta.json`` (another file's, or another target's) or an edited identity is found.

An entry is written whole into a temporary folder of its writer's (``<key>.<pid>.<hex>.tmp``) and
renamed into place; every failure (a full disk, ``ulimit -f``'s ``EFBIG``, a failed rename) removes
the temporary folder, and those of writers that died (SIGKILL) are removed by the next look-up
(:func:`mlptrain.data.files.cache_entry.sweep`: only where the writer's process is gone, or after a day).
Removing an entry removes only the files an entry is made of: a folder that holds anything else (a
run directory put there) is never rebuilt or removed; its file is parsed each time instead.

A stale or damaged entry is logged and rebuilt from the file; which way a look-up went (identity
trusted, hashed and equal, hashed and changed) is logged too. The cache lives in
:func:`mlptrain.base.fs.cache_root`, never in a run directory, and a cache that cannot be read or
written is skipped with a warning: it never stops a run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.base.fs import atomic_write, cache_root, sha256_file
from mlptrain.data.files import cache_entry, chunks
from mlptrain.data.files.readers import Table, read_table

log = logging.getLogger(__name__)

VERSION = 4  # entries of another layout (4: meta.json under its own checksum, the seal) are rebuilt
_BLOCK = 1 << 17  # words per block of the checksum: the weights and a product stay in the CPU's cache
_WEIGHTS = np.random.default_rng(0x5EED).integers(1, 2**63, size=_BLOCK, dtype=np.uint64) | np.uint64(1)


def checksum(a: np.ndarray) -> str:
    """A checksum of ``a``'s bytes: ``sum(words)`` and ``sum(words * odd weights)`` block by block, mod 2**64.

    Any one changed word changes both sums (the weights are odd), and a swap of two words the
    second; it is not cryptographic (the cache guards against damage, not an adversary), and runs
    several times faster than SHA-256 (docs/benchmarks.md, "The data cache's checks"). The blocks'
    sums are taken on every core (:func:`mlptrain.data.files.chunks.run`), then folded in order.
    """
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)  # its bytes, no copy (a memmap stays one)
    whole = len(raw) // 8 * 8
    words, tail = raw[:whole].view(np.uint64), bytes(raw[whole:])
    s1, s2 = np.uint64(len(raw)), np.uint64(int.from_bytes(tail, "little"))

    def sums(part: tuple[int, int]) -> tuple[np.uint64, np.uint64]:
        block = words[part[0] : part[1]]
        with np.errstate(over="ignore"):
            product = np.multiply(block, _WEIGHTS[: len(block)])
            return np.add.reduce(block, dtype=np.uint64), np.add.reduce(product, dtype=np.uint64)

    with np.errstate(over="ignore"):
        for b1, b2 in chunks.run(sums, chunks.ranges(len(words), _BLOCK)):
            s1 = s1 * np.uint64(0x9E3779B97F4A7C15) + b1  # the block's place
            s2 = s2 * np.uint64(0xC2B2AE3D27D4EB4F) + b2
    return f"{int(s1):016x}{int(s2):016x}"


def seal(meta: dict[str, Any], path: Path, target: str | list[str]) -> str:
    """The checksum of an entry's metadata (all of ``meta`` but its ``seal``), bound to the file and target columns
    it was cached for: another entry's ``meta.json`` in its place fails it."""
    body = {k: v for k, v in meta.items() if k != "seal"}
    return hashlib.sha256(json.dumps([str(path), target, body], sort_keys=True).encode()).hexdigest()


def _sealed(meta: dict[str, Any], path: Path, target: str | list[str]) -> dict[str, Any]:
    return {**meta, "seal": seal(meta, path, target)}


def _entry(path: Path, target: str | list[str]) -> Path:
    key = hashlib.sha256(json.dumps([str(path), target]).encode()).hexdigest()[:24]
    return cache_root() / "tables" / key


IDENTITY = ("path", "size", "mtime_ns", "ctime_ns", "inode", "device")  # a file unchanged has all of these
RACY_NS = 2_000_000_000  # a file changed this close to its hashing may have kept its time: hashed again


def identity_of(path: str | Path) -> dict[str, Any] | None:
    """What the file is now, without reading it: :data:`IDENTITY` and ``stat_ns``, the clock just before
    the ``stat`` (None: it cannot be stat'ed)."""
    path = Path(path).expanduser().resolve()
    stat_ns = time.time_ns()
    try:
        st = path.stat()
    except OSError:
        return None
    return {
        "path": str(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,  # set by every write, chmod and utime: a restored mtime leaves a new ctime
        "inode": st.st_ino,
        "device": st.st_dev,
        "stat_ns": stat_ns,
    }


def source_of(path: str | Path) -> dict[str, Any] | None:
    """What the cache knows a file by: :func:`identity_of`, then the SHA-256 of its bytes (None: unreadable).

    The identity is taken before the bytes are read, so a write during the hash leaves another
    identity than the one stored, and the next look-up hashes again.
    """
    source = identity_of(path)
    if source is None:
        return None
    start = time.perf_counter()
    try:
        source["sha256"] = sha256_file(Path(source["path"]))
    except OSError:
        return None
    chunks.log_phase("hash (SHA-256)", start, source["size"])
    return source


def trusted(recorded: dict[str, Any], now: dict[str, Any]) -> str | None:
    """None if the SHA-256 ``recorded`` with an entry holds for the file whose :func:`identity_of` is ``now``;
    else why not (``size and mtime_ns differ``), and the file is hashed again."""
    changed = [k for k in IDENTITY if recorded.get(k) != now.get(k)]
    if changed:
        return f"{' and '.join(changed)} {'differs' if len(changed) == 1 else 'differ'}"
    if not isinstance(recorded.get("sha256"), str) or not isinstance(recorded.get("stat_ns"), int):
        return "no hash recorded"
    if max(recorded["mtime_ns"], recorded["ctime_ns"]) + RACY_NS > recorded["stat_ns"]:
        return f"it was changed within {RACY_NS / 1e9:g} s of being hashed"
    return None


class SourceHash:
    """:func:`source_of` a file, taken at most once: on ``executor`` (started by :meth:`start` or the
    first call) or, without one, inline at the first call. A look-up that trusts the entry's
    identity never calls it, so the file is never read."""

    def __init__(self, path: str | Path, executor: Executor | None = None) -> None:
        self.path, self.executor = path, executor
        self._future: Future | None = None

    def start(self) -> None:
        """Begin hashing (on the executor: the caller goes on, parsing the file meanwhile)."""
        if self._future is None and self.executor is not None:
            self._future = self.executor.submit(source_of, self.path)

    def __call__(self) -> dict[str, Any] | None:
        if self._future is None and self.executor is None:
            self._future = Future()
            self._future.set_result(source_of(self.path))
        self.start()
        assert self._future is not None
        return self._future.result()


def load(
    path: str | Path, target: str | list[str], source: dict[str, Any] | Callable[[], Any] | None = None
) -> tuple[Table, Table | None] | None:
    """The cached tables of ``path``, or None when there is no usable entry (then parse and :func:`store`).

    ``source`` is :func:`source_of` the file, or a function that returns it (a :class:`SourceHash`),
    called only when the entry's recorded identity does not hold (:func:`trusted`); None: taken here
    when needed. An entry found good by a new hash is given the file's new identity, so the next
    look-up trusts it.
    """
    path = Path(path).expanduser().resolve()
    folder = _entry(path, target)
    cache_entry.sweep(folder.parent)
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except FileNotFoundError:
        return None  # never cached
    except (OSError, ValueError) as exc:
        log.warning("data file %s: its cache entry %s is damaged (meta.json: %s); parsing the file", path, folder, exc)
        return None
    if not isinstance(meta, dict) or meta.get("version") != VERSION:
        log.info("data file %s: its cache entry %s is of an older mlptrain; parsing the file", path, folder)
        return None
    if meta.get("seal") != seal(meta, path, target):
        log.warning(
            "data file %s: its cache entry %s is damaged (meta.json fails its checksum: edited, or another entry's); "
            "parsing the file",
            path,
            folder,
        )
        return None
    now = identity_of(path)
    if now is None:
        return None  # gone meanwhile: the parse says so
    recorded: dict[str, Any] = meta["source"] if isinstance(meta.get("source"), dict) else {}
    why = trusted(recorded, now)
    if why is None:
        same = ", ".join(IDENTITY[1:])
        log.info(
            "data file %s: unchanged since it was hashed (%s as recorded); its SHA-256 is not taken again", path, same
        )
    else:
        source = source_of(path) if source is None else source() if callable(source) else source
        if source is None:
            return None
        if recorded.get("sha256") != source["sha256"]:
            log.info("data file %s changed since it was cached (%s; SHA-256 differs); parsing it again", path, why)
            return None
        log.info("data file %s: hashed again (%s): the bytes that were cached", path, why)
    try:
        start = time.perf_counter()
        tables = _load(folder, meta, path)
        chunks.log_phase("read from the cache", start, sum(t.x.nbytes for t in tables if t is not None))
    except Exception as exc:  # any damage (a .npy header garbled into a SyntaxError): parsed again, never a crash
        log.warning("data file %s: its cache entry %s is damaged (%s); parsing the file", path, folder, exc)
        return None
    if why is not None:
        _refresh(folder, _sealed({**meta, "source": source}, path, target), path)
    log.info("data file %s: read from its cache %s (content and arrays verified)", path, folder)
    return tables


def _refresh(folder: Path, meta: dict[str, Any], path: Path) -> None:
    """Rewrite the entry's ``meta.json`` with the file's new identity (atomically; a failure only warns)."""
    try:
        atomic_write(folder / "meta.json", json.dumps(meta))
    except OSError as exc:
        log.warning("could not record the new identity of %s in its cache entry %s (%s)", path, folder, exc)


def store(
    path: str | Path, target: str | list[str], tables: tuple[Table, Table | None], source: dict[str, Any] | None = None
) -> None:
    """Keep ``tables`` (parsed from ``path`` and checked) for the next run; a failure only warns.

    ``source`` is :func:`source_of` the file taken before it was parsed: a file changed meanwhile is
    then found changed by the next read (taken now when not given).
    """
    path = Path(path).expanduser().resolve()
    folder = _entry(path, target)
    source = source_of(path) if source is None else source
    if source is None:
        return
    try:
        cache_entry.sweep(folder.parent)
        foreign = cache_entry.foreign(folder)
        if foreign:
            log.warning(
                "data file %s: its cache entry %s holds %s, which the cache did not write; the entry is left as it is "
                "(and the file parsed each time): move them out of the cache",
                path,
                folder,
                ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else ""),
            )
            return
        rebuilt = folder.exists()
        with chunks.timed("cache write", sum(np.asarray(t.x).nbytes for t in tables if t is not None)):
            _store(folder, tables, {"version": VERSION, "source": source}, target)
        log.info("data file %s: cache entry %s %s", path, folder, "rebuilt" if rebuilt else "written")
    except OSError as exc:
        log.warning("could not cache the parsed data file %s in %s (%s)", path, folder, exc)


def read_cached(path: str | Path, target: str | list[str], *, reader: str = "auto") -> tuple[Table, Table | None]:
    """:func:`mlptrain.data.files.readers.read_table` through the cache (stored at once: for files known to be good)."""
    source = SourceHash(path)  # hashed only if the entry's identity does not hold, or to store a new entry
    tables = load(path, target, source)
    if tables is None:
        taken = source()  # before the parse: a file changed meanwhile is found changed by the next read
        tables = read_table(path, target, reader=reader)
        store(path, target, tables, taken)
    return tables


def _arrays(table: Table) -> dict[str, np.ndarray]:
    out = {"x": np.ascontiguousarray(table.x), "y": np.asarray(table.y)}
    return out if table.missing is None else {**out, "missing": table.missing}


def _store(folder: Path, tables: tuple[Table, Table | None], head: dict[str, Any], target: str | list[str]) -> None:
    """Write the entry into a temporary folder of this writer's, then rename it into place; on any failure
    (a full disk, ``EFBIG`` under ``ulimit -f``, a failed rename) the temporary folder is removed."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    tmp.mkdir()
    try:
        _write_entry(tmp, tables, head, target)
        cache_entry.replace(folder, tmp)
    finally:
        cache_entry.remove(tmp)  # gone already when it was renamed into place


def _write_entry(tmp: Path, tables: tuple[Table, Table | None], head: dict[str, Any], target: str | list[str]) -> None:
    parts = {}
    for split, table in zip(("train", "test"), tables, strict=True):
        if table is None:
            continue
        arrays = {}
        for name, a in _arrays(table).items():
            np.save(tmp / f"{split}_{name}.npy", a, allow_pickle=False)
            arrays[name] = {"shape": list(a.shape), "dtype": a.dtype.str, "checksum": checksum(a)}
        names = {"features": table.feature_names, "targets": table.target_names}
        parts[split] = {**names, "text": table.text, "named": table.named, "arrays": arrays}
    path = Path(head["source"]["path"])
    (tmp / "meta.json").write_text(json.dumps(_sealed({**head, "parts": parts}, path, target)))


def _load(folder: Path, meta: dict, path: Path) -> tuple[Table, Table | None]:
    """The entry's tables, every array checked against its shape, dtype and checksum (ValueError if not)."""
    out: list[Table | None] = []
    for split in ("train", "test"):
        part = meta["parts"].get(split)
        if part is None:
            out.append(None)
            continue
        arrays = {}
        for name, want in part["arrays"].items():
            file = folder / f"{split}_{name}.npy"
            a = np.load(file, mmap_mode="r" if name == "x" else None, allow_pickle=False)
            got = {"shape": list(a.shape), "dtype": a.dtype.str}
            if got != {k: want[k] for k in got}:
                raise ValueError(f"{file.name} is {got}, the entry stored {want['dtype']} {want['shape']}")
            if checksum(a) != want["checksum"]:
                raise ValueError(f"{file.name} fails its checksum")
            arrays[name] = a
        x, y, missing = arrays["x"], arrays["y"], arrays.get("missing")
        out.append(Table(path, x, y, part["features"], part["targets"], part["text"], part["named"], missing))
    if out[0] is None:
        raise ValueError("no training rows in the cache entry")
    return out[0], out[1]
