"""Per-column statistics of a table, as normalisation takes them from the training split: the moments in one
chunked pass (``standard``, ``minmax``), and the percentiles and quantiles of ``robust`` and ``quantile``.

**Moments.** Each chunk of rows is cast to float64 and reduced on its own, two-pass within the chunk (its mean,
then the sum of squared deviations from it, ``M2``), so a column of ``1e6 + noise`` loses nothing
to cancellation; the chunks are then merged in order by Chan, Golub and LeVeque's rule
(for chunks ``a`` and ``b``, ``n = n_a + n_b``, ``d = mean_b - mean_a``):

    mean = mean_a + d * n_b / n
    M2   = M2_a + M2_b + d**2 * n_a * n_b / n

A table of one chunk gets NumPy's own ``x.mean(axis=0, dtype=float64)`` and ``x.std(...)``, bit for
bit (the same sums in the same order). A NaN or inf anywhere makes its chunk's sums non-finite: only
then is that chunk searched for the first such cell, so the check costs nothing on good data.

**Percentiles and quantiles.** Both modes take their statistics from the training split only, as
scikit-learn's scalers fitted on it:

* ``robust``: ``(x - median) / IQR``, the 25th to 75th percentile (``RobustScaler()``, ``np.percentile``'s
  linear interpolation) over every training row, or a seeded sample of :data:`ROBUST_ROWS` of them where
  the split has more. A column whose IQR is 0 but that varies (a rare spike, a one-hot column of a rare
  level) is divided by its standard deviation instead (scikit-learn divides by 1, leaving it in its own
  units); a constant column becomes exactly 0.
* ``quantile``: each column through its empirical training quantiles to a standard normal, as
  ``QuantileTransformer(output_distribution="normal", n_quantiles=min(1000, rows), subsample=10_000,
  random_state=data.split_seed)``: ``Q = min(1000, rows)`` quantiles at ``linspace(0, 1, Q)`` of a sample
  of :data:`SUBSAMPLE` training rows (all of them where there are fewer: the same rows scikit-learn takes,
  :func:`sample`); the map is :class:`QuantileMap`.

A streamed or host-resident table (``data.residency``) is never held whole for these: the sample's rows
are gathered a block of columns at a time (at most :data:`BLOCK_BYTES` of float64). Nothing here reads a
file; :mod:`mlptrain.data.prepare` decides which columns each mode scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlptrain.base.normal import ndtri
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

    def shift_scale(self, method: str, binary: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(shift, scale)`` ``(F,)`` float64 of ``standard`` (mean, std) or ``minmax`` (min, max - min): every
        column that varies is scaled, whatever its spread (no floor, none relative to the other columns); a
        constant column (min == max) is shifted by its value and not scaled, so it becomes exactly 0. A
        ``binary`` column (``(F,)`` bool: the column plan's 0/1 columns) that varies stays 0/1 (shift 0, scale
        1), as scikit-learn's ``ColumnTransformer`` leaves a one-hot column: standardised, a 1% level's column
        would be about 10 where it is set."""
        assert self.low is not None and self.high is not None  # asked for: extremes=True
        constant = self.low == self.high  # (F,)
        if method == "standard":
            shift, scale = np.where(constant, self.low, self.mean), self.std
        else:
            shift, scale = self.low, self.high - self.low
        scale = np.where(constant | ~(scale > 0), 1.0, scale)
        if binary is None:
            return shift, scale
        kept = binary & ~constant  # (F,)
        return np.where(kept, 0.0, shift), np.where(kept, 1.0, scale)

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


SUBSAMPLE = 10_000  # QuantileTransformer's subsample: rows whose quantiles make the table
N_QUANTILES = 1000  # QuantileTransformer's n_quantiles (at most the rows there are)
ROBUST_ROWS = 1_000_000  # robust: medians and quartiles of every training row up to this many, else of a sample
BOUNDS_THRESHOLD = 1e-7  # scikit-learn's: a value this close to the first (last) quantile maps to 0 (1), then clipped
# The map's outputs lie in [LOW, HIGH], about -5.1993 and 5.1993 (scikit-learn's clip: the normal's quantiles
# of 1e-7 - eps and of 1 - (1e-7 - eps), the latter rounded in float64, so not exactly -LOW).
LOW, HIGH = (
    float(ndtri(np.float64(p))) for p in (BOUNDS_THRESHOLD - np.spacing(1), 1 - (BOUNDS_THRESHOLD - np.spacing(1)))
)
BLOCK_BYTES = 64 << 20  # a block of the sample's columns, as float64, while its percentiles are taken


def sample(n: int, size: int, seed: int) -> np.ndarray | None:
    """``size`` of ``range(n)`` without replacement, sorted (None: ``n <= size``, every row): the rows scikit-learn's
    ``resample(replace=False, random_state=seed)`` takes (``arange(n)`` shuffled by ``RandomState(seed)``, the
    first ``size``), so a quantile table of more than :data:`SUBSAMPLE` rows is scikit-learn's too."""
    if n <= size:
        return None
    order = np.arange(n)
    np.random.RandomState(seed).shuffle(order)
    return np.sort(order[:size])  # percentiles do not depend on the order; a sorted gather reads the table in order


def percentiles(x: np.ndarray, rows: np.ndarray | None, q: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """``np.percentile(x[rows][:, columns], q, axis=0)`` ``(len(q), K)`` float64, ``x (N, F)``, ``rows`` None: all,
    ``columns (K,)``; a block of columns at a time, so the rows are never held whole in float64."""
    n = len(x) if rows is None else len(rows)
    width = max(1, BLOCK_BYTES // (8 * max(1, n)))
    out = np.empty((len(q), len(columns)))
    for a in range(0, len(columns), width):
        cols = columns[a : a + width]
        block = x[:, cols] if rows is None else x[np.ix_(rows, cols)]  # (n, k): only these cells are read
        out[:, a : a + len(cols)] = np.percentile(np.asarray(block, np.float64), q, axis=0)
    return out


def robust(
    x: np.ndarray, rows: np.ndarray | None, columns: np.ndarray, std: np.ndarray, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(median, scale)`` ``(K,)`` of ``columns (K,)`` over the training ``rows`` (a sample beyond
    :data:`ROBUST_ROWS`): the scale is the IQR, or ``std (K,)`` where the IQR is 0 (1 where that is 0 too)."""
    n = len(x) if rows is None else len(rows)
    picked = sample(n, ROBUST_ROWS, seed)
    if picked is not None:
        rows = picked if rows is None else np.sort(rows[picked])  # the table read in order
    q25, median, q75 = percentiles(x, rows, np.array([25.0, 50.0, 75.0]), columns)
    iqr = q75 - q25
    return median, np.where(iqr > 0, iqr, np.where(std > 0, std, 1.0))


@dataclass
class QuantileMap:
    """Columns ``columns (K,)`` of a table mapped through their training quantiles ``quantiles (Q, K)`` float64
    (each column's ascending) to a standard normal, as ``QuantileTransformer(output_distribution="normal")``:

        u = (interp(x, q, r) - interp(-x, -q[::-1], -r[::-1])) / 2    r = linspace(0, 1, Q)
        u = 0 where x - 1e-7 < q[0], 1 where x + 1e-7 > q[-1]  (the lower bound wins)
        z = clip(ndtri(u), ndtri(1e-7 - eps), ndtri(1 - (1e-7 - eps)))    (about -5.1993 and 5.1993)

    The two interpolations, forward and backward, are averaged so that a value repeated in the quantiles (ties)
    maps to the middle of its run, not to one end of it.
    """

    quantiles: np.ndarray  # (Q, K) float64
    columns: np.ndarray  # (K,) int64

    @classmethod
    def fit(cls, x: np.ndarray, rows: np.ndarray | None, columns: np.ndarray, seed: int) -> QuantileMap:
        """The quantile table of ``columns`` of ``x[rows]`` (a seeded sample of :data:`SUBSAMPLE` of the rows)."""
        n = len(x) if rows is None else len(rows)
        picked = sample(n, SUBSAMPLE, seed)
        if picked is not None:
            rows = picked if rows is None else np.sort(rows[picked])  # the table read in order
        references = np.linspace(0.0, 1.0, max(1, min(N_QUANTILES, n)))  # (Q,)
        return cls(percentiles(x, rows, references * 100, columns), np.asarray(columns, np.int64))

    def apply_(self, x64: np.ndarray) -> np.ndarray:
        """Map the columns of ``x64 (n, F)`` float64 in place (the others are left as they are); returns it."""
        refs = np.linspace(0.0, 1.0, len(self.quantiles))  # (Q,)
        u = np.empty((len(x64), len(self.columns)))  # (n, K) each value's place among its column's quantiles
        for k, j in enumerate(self.columns.tolist()):
            u[:, k] = self.uniform(x64[:, j], self.quantiles[:, k], refs)
        x64[:, self.columns] = np.clip(ndtri(u), LOW, HIGH)  # one call for every column: a batch of few rows
        return x64

    @staticmethod
    def uniform(x: np.ndarray, q: np.ndarray, refs: np.ndarray) -> np.ndarray:
        """``x (n,)`` float64 placed among one column's quantiles ``q (Q,)`` (at ``refs (Q,)``): ``u`` in ``[0, 1]``."""
        lower, upper = x - BOUNDS_THRESHOLD < q[0], x + BOUNDS_THRESHOLD > q[-1]  # (n,)
        u = 0.5 * (np.interp(x, q, refs) - np.interp(-x, -q[::-1], -refs[::-1]))  # (n,)
        u[upper] = 1.0
        u[lower] = 0.0
        return u
