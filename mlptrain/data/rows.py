"""A split that is not copied: its rows read from the table and normalised as a batch needs them.

``data.residency=stream`` (or ``auto``/``host`` where the normalised splits would not fit host memory):
:func:`mlptrain.data.prepare.load_dataset` keeps each split as a :class:`NormalisedRows` over the table
it read (a cache entry or an uncompressed NPZ, memory-mapped), so a table larger than host memory
trains: the host-resident loader (:mod:`mlptrain.host_loader`) gathers each batch's rows through the
memory map (the page cache, or the disk where the table is larger than memory) and normalises them
into its pinned slot::

    batch rows idx (B,) of the split    ->  table rows  rows[idx]            (B,) int64
    raw = table[rows[idx]]              ->  (raw - shift) * inv_scale in float64, rounded once  (B, F)
    -> cast to the compute dtype, into the slot

which is the arithmetic of :func:`mlptrain.data.chunks.gather_normalised` row for row, so a streamed
run's batches, and its losses, are those of a run whose splits were materialised
(``tests/test_stream.py``).
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np

from mlptrain.data import chunks


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


class NormalisedRows:
    """``(n, F)`` rows ``(table[rows] - shift) / scale`` of ``dtype``, computed when they are taken.

    Args:
        table: ``(N, F)`` features, any real dtype (usually memory-mapped); not copied.
        rows: ``(n,)`` int64 rows of ``table`` in this split, or None for all of them.
        shift, scale: ``(F,)`` the normalisation (:class:`~mlptrain.data.dataset.Normalization`'s).
        dtype: the dtype of the rows handed out (float32, or a compute dtype: the float32 result cast).

    Attributes:
        shape, dtype, ndim, size, nbytes: those of the array it stands for (``nbytes``: were it made).
    """

    ndim = 2
    checked_finite = True  # the table was checked when it was read (mlptrain.data.prepare)

    def __init__(
        self, table: np.ndarray, rows: np.ndarray | None, shift: np.ndarray, scale: np.ndarray, dtype: Any = np.float32
    ) -> None:
        if table.ndim != 2:
            raise ValueError(f"NormalisedRows: table of shape {table.shape}; expected (N, F)")
        self.table, self.rows = table, (None if rows is None else np.asarray(rows, np.int64))
        self.shift, self.scale = np.asarray(shift), np.asarray(scale)
        self.shift64 = self.shift.astype(np.float64)  # (F,) as gather_normalised takes them
        self.inv64 = 1.0 / self.scale.astype(np.float64)  # (F,)
        self.dtype = np.dtype(dtype)
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
        return NormalisedRows(self.table, self.rows, self.shift, self.scale, dtype)

    def subset(self, key: slice) -> NormalisedRows:
        """Rows ``key`` of this split, still streamed (a data-parallel rank's share of an evaluation split)."""
        rows = np.arange(len(self), dtype=np.int64)[key] if self.rows is None else self.rows[key]
        return NormalisedRows(self.table, rows, self.shift, self.scale, self.dtype)

    def take(self, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out[:] = self[idx]``: the table's rows gathered, normalised in float64, rounded to float32 and cast to
        ``out``'s dtype."""
        if out.shape != (len(idx), self.shape[1]):
            raise ValueError(f"NormalisedRows.take: out {out.shape} for {len(idx)} rows of {self.shape[1]} features")
        at = idx if self.rows is None else self.rows[idx]  # (B,) rows of the table
        if self.table.dtype == np.float32 and self.table.flags.aligned:
            raw = chunks.take_into(self.table, at, np.empty(out.shape, np.float32))
        else:
            raw = self.table[at]  # (B, F) the rows as stored
        x32 = out if out.dtype == np.float32 else np.empty(out.shape, np.float32)  # (B, F)
        chunks.normalise_into(raw, self.shift64, self.inv64, x32)
        if x32 is not out:
            np.copyto(out, x32, casting="unsafe")
        return out

    def __getitem__(self, key: slice) -> np.ndarray:
        """Rows ``key`` (a slice) as a new array of ``dtype``."""
        if not isinstance(key, slice):
            raise TypeError(f"NormalisedRows[{key!r}]: only a slice of rows; take(idx, out) gathers rows")
        idx = np.arange(*key.indices(len(self)), dtype=np.int64)
        return self.take(idx, np.empty((len(idx), self.shape[1]), self.dtype))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The whole split, made (the materialised split: for small data and tests, not for a large table)."""
        out = chunks.gather_normalised(self.table, self.rows, self.shift, self.scale)  # (n, F) float32
        return out.astype(dtype or self.dtype, copy=False)

    def __repr__(self) -> str:
        return f"NormalisedRows({self.shape[0]} x {self.shape[1]} {self.dtype.name} of a {self.table.dtype.name} table)"
