"""Per-column statistics of a table (or of some of its rows) in one chunked pass, on every core.

Each chunk of rows is cast to float64 and reduced on its own, two-pass within the chunk (its mean,
then the sum of squared deviations from it, ``M2``), so a column of ``1e6 + noise`` loses nothing
to cancellation; the chunks are then merged in order by Chan, Golub and LeVeque's rule
(for chunks ``a`` and ``b``, ``n = n_a + n_b``, ``d = mean_b - mean_a``):

    mean = mean_a + d * n_b / n
    M2   = M2_a + M2_b + d**2 * n_a * n_b / n

A table of one chunk gets NumPy's own ``x.mean(axis=0, dtype=float64)`` and ``x.std(...)``, bit for
bit (the same sums in the same order). A NaN or inf anywhere makes its chunk's sums non-finite: only
then is that chunk searched for the first such cell, so the check costs nothing on good data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlptrain.data.files import chunks


@dataclass
class ColumnStats:
    """Statistics of ``count`` rows of a table, per column ``(F,)`` float64.

    ``nonfinite`` is ``(row, column)`` of the first inf or NaN (``row`` counts the rows passed in, in
    their order), and then the statistics mean nothing. ``low``/``high`` are None unless asked for.
    """

    count: int
    mean: np.ndarray  # (F,)
    m2: np.ndarray  # (F,) sum of squared deviations from the mean
    low: np.ndarray | None = None  # (F,) min
    high: np.ndarray | None = None  # (F,) max
    nonfinite: tuple[int, int] | None = None

    @property
    def std(self) -> np.ndarray:
        """``(F,)`` the population standard deviation, ``sqrt(M2 / count)`` (NumPy's ``std``, ``ddof=0``)."""
        return np.sqrt(self.m2 / self.count)

    def merge(self, other: ColumnStats) -> ColumnStats:
        """The statistics of both sets of rows (``self``'s first): Chan et al.'s pairwise update."""
        n = self.count + other.count
        d = other.mean - self.mean  # (F,)
        mean = self.mean + d * (other.count / n)
        m2 = self.m2 + other.m2 + d * d * (self.count * other.count / n)
        low = None if self.low is None or other.low is None else np.minimum(self.low, other.low)
        high = None if self.high is None or other.high is None else np.maximum(self.high, other.high)
        nonfinite: tuple[int, int] | None
        if self.nonfinite is None and other.nonfinite is not None:
            nonfinite = (self.count + other.nonfinite[0], other.nonfinite[1])
        else:
            nonfinite = self.nonfinite
        return ColumnStats(n, mean, m2, low, high, nonfinite)


def column_stats(
    x: np.ndarray, rows: np.ndarray | None = None, *, extremes: bool = False, chunk: int | None = None
) -> ColumnStats:
    """The :class:`ColumnStats` of ``x[rows]`` (``x (N, F)``, any real dtype; ``rows`` None: every row).

    Args:
        x: The table; a memory map is read chunk by chunk, never whole.
        rows: ``(M,)`` row indices (a split), gathered a chunk at a time.
        extremes: Also the columns' min and max (``minmax`` normalisation).
        chunk: Rows per chunk (default: :data:`mlptrain.data.files.chunks.CHUNK_BYTES` of float64).
    """
    n, f = (len(x) if rows is None else len(rows)), x.shape[1]
    if n == 0:
        raise ValueError("column statistics of no rows")

    def one(part: tuple[int, int]) -> ColumnStats:
        with np.errstate(invalid="ignore", over="ignore"):  # (per thread) an inf or NaN is reported, not warned of
            return _chunk_stats(part)

    def _chunk_stats(part: tuple[int, int]) -> ColumnStats:
        a, b = part
        block = np.array(x[a:b], np.float64) if rows is None else x[rows[a:b]].astype(np.float64, copy=False)
        # (m, F) float64: a copy of the chunk, ours to overwrite (never a view of x)
        total = np.add.reduce(block, axis=0)  # (F,) as NumPy's mean sums: row after row
        bad = None
        if not np.isfinite(total).all():  # an inf or NaN in this chunk, or a float64 sum beyond its range
            cells = np.argwhere(~np.isfinite(block))  # (k, 2) row within the chunk, column
            bad = (int(cells[0, 0]), int(cells[0, 1])) if len(cells) else None
        mean = total / (b - a)
        low, high = (block.min(axis=0), block.max(axis=0)) if extremes else (None, None)
        np.subtract(block, mean, out=block)
        np.multiply(block, block, out=block)
        return ColumnStats(b - a, mean, np.add.reduce(block, axis=0), low, high, bad)

    with np.errstate(invalid="ignore", over="ignore"):  # the merge of NaN statistics
        parts = chunks.run(one, chunks.ranges(n, chunks.chunk_rows(f, chunk)))
        out = parts[0]
        for p in parts[1:]:
            out = out.merge(p)
    return out
