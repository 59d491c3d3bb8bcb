"""A split that is not copied: its rows read from the table and normalised as a batch needs them.

``data.residency=stream`` (or ``auto``/``host`` where the normalised splits would not fit host memory):
:func:`mlptrain.data.prepare.load_dataset` keeps each split as a :class:`NormalisedRows` over the table
it read (a cache entry or an uncompressed NPZ, memory-mapped), so a table larger than host memory
trains: the host-resident loader (:mod:`mlptrain.data.host_loader`) gathers each batch's rows through the
memory map (the page cache, or the disk where the table is larger than memory) and normalises them
into its pinned slot::

    batch rows idx (B,) of the split    ->  table rows  rows[idx]            (B,) int64
    raw = table[rows[idx]]              ->  (raw - shift) * inv_scale in float64, rounded once  (B, F)
    -> cast to the compute dtype, into the slot

which is the arithmetic of :func:`mlptrain.data.files.chunks.gather_normalised` row for row, so a streamed
run's batches, and its losses, are those of a run whose splits were materialised
(``tests/test_stream.py``).

A table that is a file's memory map (C order) is read with ``os.preadv`` into the batch, row by row
(consecutive rows in one call), not through the map: a file truncated under the run then reads
short, which is an error naming the file, where a memory map's missing page is a SIGBUS that kills
the process without a word. The file's identity (size, mtime_ns, inode) is taken when the split is
made and checked before each batch (``fstat``, about a microsecond) and at each epoch's start
(:meth:`NormalisedRows.check_source`, also the path's ``stat``: a file replaced by another): a
table that changed under a run stops it (:class:`~mlptrain.base.errors.DatasetError`) instead of
training on other rows than its statistics were taken from.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np

from mlptrain.base.errors import DatasetError
from mlptrain.data.files import chunks


def memory_mapped(a: Any) -> bool:
    """Whether ``a``'s memory is a file's memory map (``np.memmap``, or a view of an ``mmap``)."""
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = getattr(a, "base", None) if isinstance(a, np.ndarray) else getattr(a, "obj", None)
    return False


def host_memory_available() -> int:
    """Bytes the host could still give a process (``MemAvailable``; free pages where there is no /proc)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class StreamSource:
    """The file behind a memory-mapped C-order table, read with ``os.preadv``; its identity checked.

    Args:
        table: ``np.memmap`` made over a file (its own ``offset``: not a view of another map).
    """

    def __init__(self, table: np.memmap) -> None:
        self.path = str(table.filename)
        self.offset = int(table.offset)  # the table's first byte in the file
        self.row_bytes = table.dtype.itemsize * int(table.shape[1])
        self.fd = os.open(self.path, os.O_RDONLY)
        self.identity = self._identity(os.fstat(self.fd))

    @staticmethod
    def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
        return st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev

    @classmethod
    def of(cls, table: Any) -> StreamSource | None:
        """The source of ``table`` where it is a file's own memory map in C order, else None."""
        ok = isinstance(table, np.memmap) and isinstance(table.base, mmap.mmap) and table.filename is not None
        return cls(table) if ok and table.ndim == 2 and table.flags.c_contiguous else None

    def _changed(self, st: os.stat_result, what: str) -> str | None:
        """How ``st`` differs from the identity taken when the split was made, or None."""
        size, mtime, ino, _ = now = self._identity(st)
        was = self.identity
        if now == was:
            return None
        if size != was[0]:
            return f"{what} is {size} bytes (was {was[0]})"
        if mtime != was[1]:
            return f"{what} was modified (mtime_ns {mtime}, was {was[1]})"
        return f"{what} is another file (inode {ino}, was {was[2]})"

    def check(self, full: bool = False) -> None:
        """Raise :class:`DatasetError` if the file changed since the split was made (``full``: the path too,
        a file renamed over it)."""
        how = self._changed(os.fstat(self.fd), "it")
        if how is None and full:
            try:
                how = self._changed(os.stat(self.path), "the path")
            except OSError as exc:
                how = f"the path is gone ({exc.strerror})"
        if how is not None:
            raise DatasetError(self._message(how))

    def _message(self, how: str) -> str:
        return (
            f"data file {self.path} changed while the run streamed it (data.residency=stream): {how}; its "
            "normalisation was taken from the file as it was, so the run stops; restart it once the file stays put"
        )

    def read(self, at: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out[:] = table[at]`` (``out (B, F)`` of the table's dtype, C order) read with ``os.preadv``; runs of
        consecutive rows in one call each."""
        self.check()
        rb, buf = self.row_bytes, out.data.cast("B")  # out is C-contiguous: its bytes, row after row
        cuts = np.flatnonzero(np.diff(at) != 1) + 1  # where a run of consecutive rows ends
        starts = np.concatenate(([0], cuts)).tolist()
        stops = np.concatenate((cuts, [len(at)])).tolist()
        first = at[starts].tolist() if len(at) else []
        for a, b, row in zip(starts, stops, first, strict=True):
            want, pos, done = (b - a) * rb, self.offset + row * rb, 0
            while done < want:  # a read may return less than asked: read on until the file ends
                got = os.preadv(self.fd, [buf[a * rb + done : b * rb]], pos + done)
                if got <= 0:
                    raise DatasetError(
                        self._message(
                            f"a read at byte {pos + done} found the end of the file (it was "
                            f"{self.identity[0]} bytes): the file was truncated"
                        )
                    )
                done += got
        return out

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            os.close(fd)


class NormalisedRows:
    """``(n, F)`` rows ``(mapped(table[rows]) - shift) / scale`` of ``dtype``, computed when they are taken.

    Args:
        table: ``(N, F)`` features, any real dtype (usually memory-mapped); not copied.
        rows: ``(n,)`` int64 rows of ``table`` in this split, or None for all of them.
        shift, scale: ``(F,)`` the normalisation (:class:`~mlptrain.data.dataset.Normalization`'s).
        mapped: ``data.normalize=quantile``'s map of raw columns, applied before the shift (or None).
        dtype: the dtype of the rows handed out (float32, or a compute dtype: the float32 result cast).

    Attributes:
        shape, dtype, ndim, size, nbytes: those of the array it stands for (``nbytes``: were it made).
    """

    ndim = 2
    checked_finite = True  # the table was checked when it was read (mlptrain.data.prepare)

    def __init__(
        self,
        table: np.ndarray,
        rows: np.ndarray | None,
        shift: np.ndarray,
        scale: np.ndarray,
        dtype: Any = np.float32,
        source: StreamSource | None = None,
        mapped: chunks.Mapping | None = None,
    ) -> None:
        if table.ndim != 2:
            raise ValueError(f"NormalisedRows: table of shape {table.shape}; expected (N, F)")
        self.table, self.rows = table, (None if rows is None else np.asarray(rows, np.int64))
        self.shift, self.scale = np.asarray(shift), np.asarray(scale)
        self.shift64 = self.shift.astype(np.float64)  # (F,) as gather_normalised takes them
        self.inv64 = 1.0 / self.scale.astype(np.float64)  # (F,)
        self.mapped = mapped
        self.dtype = np.dtype(dtype)
        self.source = source if source is not None else StreamSource.of(table)  # None: not a file (read in memory)
        n = len(table) if self.rows is None else len(self.rows)
        self.shape = (n, int(table.shape[1]))

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def as_dtype(self, dtype: Any) -> NormalisedRows:
        """The same rows handed out as ``dtype`` (no data is touched)."""
        return NormalisedRows(self.table, self.rows, self.shift, self.scale, dtype, self.source, self.mapped)

    def subset(self, key: slice) -> NormalisedRows:
        """Rows ``key`` of this split, still streamed (a data-parallel rank's share of an evaluation split)."""
        rows = np.arange(len(self), dtype=np.int64)[key] if self.rows is None else self.rows[key]
        return NormalisedRows(self.table, rows, self.shift, self.scale, self.dtype, self.source, self.mapped)

    def take(self, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out[:] = self[idx]``: the table's rows gathered, normalised in float64, rounded to float32 and cast to
        ``out``'s dtype."""
        if out.shape != (len(idx), self.shape[1]):
            raise ValueError(f"NormalisedRows.take: out {out.shape} for {len(idx)} rows of {self.shape[1]} features")
        at = idx if self.rows is None else self.rows[idx]  # (B,) rows of the table
        if self.source is not None:  # a file: read, so that a short file is an error, not a SIGBUS
            raw = self.source.read(at, np.empty(out.shape, self.table.dtype))
        elif self.table.dtype == np.float32 and self.table.flags.aligned:
            raw = chunks.take_into(self.table, at, np.empty(out.shape, np.float32))
        else:
            raw = self.table[at]  # (B, F) the rows as stored
        x32 = out if out.dtype == np.float32 else np.empty(out.shape, np.float32)  # (B, F)
        chunks.normalise_into(raw, self.shift64, self.inv64, x32, self.mapped)
        if x32 is not out:
            np.copyto(out, x32, casting="unsafe")
        return out

    def check_source(self) -> None:
        """Raise :class:`~mlptrain.base.errors.DatasetError` if the file streamed from changed since the split was made
        (its size, mtime or inode; the path's too). Nothing to check for a table in memory."""
        if self.source is not None:
            self.source.check(full=True)

    def __getitem__(self, key: slice) -> np.ndarray:
        """Rows ``key`` (a slice) as a new array of ``dtype``."""
        if not isinstance(key, slice):
            raise TypeError(f"NormalisedRows[{key!r}]: only a slice of rows; take(idx, out) gathers rows")
        idx = np.arange(*key.indices(len(self)), dtype=np.int64)
        return self.take(idx, np.empty((len(idx), self.shape[1]), self.dtype))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The whole split, made (the materialised split: for small data and tests, not for a large table)."""
        out = chunks.gather_normalised(
            self.table, self.rows, self.shift, self.scale, mapped=self.mapped
        )  # (n, F) float32
        return out.astype(dtype or self.dtype, copy=False)

    def __repr__(self) -> str:
        return f"NormalisedRows({self.shape[0]} x {self.shape[1]} {self.dtype.name} of a {self.table.dtype.name} table)"
