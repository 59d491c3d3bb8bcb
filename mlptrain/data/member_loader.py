"""An ensemble's training batches (``ensemble.size``, ``ensemble.folds``): every member's batch of a step, stacked.

Member ``k`` of an ensemble is the single run of seed ``seed + k``: it must see that run's batches in that
run's order. :class:`MemberLoader` draws each member's order as a :class:`~mlptrain.data.loader.DataLoader`
of that seed would and gathers all K batches of a step from one copy of the split, in one gather, as
``(K, B, F)``: the batched GEMMs' operand (:mod:`mlptrain.nn.batched`).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

from mlptrain.base.errors import ConfigError
from mlptrain.config.schema import DataConfig
from mlptrain.data.dataset import Dataset
from mlptrain.data.loader import DataLoader


class MemberLoader(DataLoader):
    """An ensemble's training batches, stacked: ``xb (K, B, F)``, ``yb (K, B)`` (or ``(K, B, T)``), member ``k``'s
    rows in slice ``k``, from one copy of the data and one gather per batch.

    Member ``k`` takes ``rows[k]`` of ``x`` (all of them by default; cross-validation's: every fold but ``k``) in
    the order a :class:`DataLoader` of those rows and seed ``seeds[k]`` draws: ``permutation(epoch)`` of
    ``default_rng([seeds[k], epoch])``. So each member's slice is exactly the batch the single run of that seed
    takes, and K members cost one copy of the split, not K. Every member has as many rows, so the batches line
    up. Under a CUDA graph the step gathers its own stacked batch, as a single model's does (:meth:`step_order`):
    one gather kernel for x and one for y inside the graph, so a replayed step is one launch from the host.
    """

    resident = True  # the split on the device, one copy for every member

    def __init__(
        self,
        x: Any,
        y: Any,
        batch_size: int,
        *,
        xp: ModuleType,
        dtype: Any,
        drop_last: bool,
        seeds: list[int],
        rows: list[np.ndarray] | None = None,
    ) -> None:
        super().__init__(x, y, batch_size, xp=xp, dtype=dtype, shuffle=True, drop_last=drop_last, seed=seeds[0])
        self.seeds = [int(s) for s in seeds]
        self.rows = rows if rows is not None else [np.arange(len(x), dtype=np.int64)] * len(seeds)
        if len(self.rows) != len(self.seeds) or len({len(r) for r in self.rows}) != 1:
            raise ValueError(f"one row set per member, all of one length; got {[len(r) for r in self.rows]}")
        if drop_last and 0 < (n := len(self.rows[0])) < batch_size:  # (the pool's count, len(x), was checked above)
            raise ConfigError(
                f"DataLoader batch_size={batch_size} with drop_last=true gives no batch for a member's {n} rows (of "
                f"the {len(x)} it draws from: a fold leaves the others out); lower the batch size to at most {n} or "
                "set drop_last=false"
            )

    @property
    def members(self) -> int:
        return len(self.seeds)

    @property
    def num_samples(self) -> int:
        """Rows per member (each member's epoch)."""
        return len(self.rows[0])

    def orders(self, epoch: int) -> np.ndarray:
        """``(K, n)`` int64 host rows of ``x``: member k's order of ``epoch``, as its own loader would draw it."""
        n = self.num_samples
        if not self.shuffle:
            return np.stack(self.rows)
        return np.stack(
            [
                r[np.random.default_rng([s, int(epoch)]).permutation(n)]
                for r, s in zip(self.rows, self.seeds, strict=True)
            ]
        )

    def permutation(self, epoch: int) -> np.ndarray:
        """Member 0's order (each member takes its own: :meth:`orders`)."""
        return self.orders(epoch)[0]

    def batch_spec(self, rows: int) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...], np.dtype]:
        """``(x shape, x dtype, y shape, y dtype)`` of a stacked batch of ``rows`` per member."""
        x_shape, x_dtype, y_shape, y_dtype = super().batch_spec(rows)
        return (self.members, *x_shape), x_dtype, (self.members, *y_shape), y_dtype

    def epoch(self, epoch: int, start_batch: int = 0, out: Any = None) -> Iterator[tuple[Any, Any]]:
        """The stacked batches of ``epoch`` from ``start_batch`` (into ``out(rows)``'s arrays where it gives them)."""
        if not 0 <= start_batch <= len(self):
            raise ConfigError(f"DataLoader start_batch={start_batch} must be in [0, {len(self)}] (batches per epoch)")
        order, b, k = self.xp.asarray(self.orders(epoch)), self.batch_size, self.members  # (K, n): one copy
        for i in range(start_batch, len(self)):
            idx = order[:, i * b : (i + 1) * b]  # (K, B) rows of x
            rows = idx.shape[1]
            self.global_rows = rows
            flat = self.xp.ascontiguousarray(idx).reshape(-1)  # (K * B,): one gather for every member
            bufs = out(rows) if out is not None else None
            if bufs is None:
                yield (
                    self._take(self.x, flat).reshape(k, rows, -1),
                    self._take(self.y, flat).reshape(k, rows, *self.y.shape[1:]),
                )
                continue
            xb, yb = bufs
            self._take(self.x, flat, xb.reshape(k * rows, -1))  # (the buffers are contiguous: views)
            self._take(self.y, flat, yb.reshape(k * rows, *self.y.shape[1:]))
            yield xb, yb

    def step_order(self, epoch: int) -> np.ndarray:
        """``(K n',)`` int64: every member's order of ``epoch`` (:meth:`orders`) laid out batch by batch, what
        :meth:`~mlptrain.data.loader.DataLoader.gather_in_step` reads: a step's stacked batch is one run of
        positions, batch ``i`` (``rows_i`` rows a member) starting at ``i K B`` with member 0's ``rows_i`` rows,
        then member 1's, ... (``n'``: the rows the epoch's batches take). One gather kernel for x and one for y
        then fill the step's ``(K, B, F)`` batch inside its CUDA graph, as a single model's step gathers its own."""
        order, b = self.orders(epoch), self.batch_size  # (K, n)
        return np.concatenate([order[:, i * b : (i + 1) * b].reshape(-1) for i in range(len(self))])

    @property
    def stacked(self) -> int:
        return self.members

    def sample_batch(self, xb: Any, yb: Any, step: Any) -> None:
        """A valid stacked batch in ``xb (K, B, F)``, ``yb``: the split's first rows for every member."""
        rows = xb.shape[1]
        xb[...] = self.x[:rows]  # (B, F) broadcast over the members, on the device
        yb[...] = self.y[:rows]

    @property
    def device_bytes(self) -> int:
        """Device memory the split holds (the memory account of :mod:`mlptrain.step.cuda.memory` reads it for a
        loader that is not ``resident``)."""
        return int(self.x.nbytes + self.y.nbytes) if self.xp is not np else 0


def same_rows(
    cfg: DataConfig, data: Dataset, xp: Any, dtype: Any, data_seeds: list[int], train: DataLoader, evaluation: dict
) -> tuple[DataLoader, dict]:
    """An ensemble's training batches: every member on the training split, member k's order from ``data_seeds[k]``
    (one copy of the split; ``train``, one model's loader, goes); the evaluation loaders stay."""
    x, y = data.x_train, data.y_train
    return MemberLoader(x, y, cfg.batch_size, xp=xp, dtype=dtype, drop_last=cfg.drop_last, seeds=data_seeds), evaluation
