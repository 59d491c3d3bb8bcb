"""Mini-batches on the device: one copy of a split in device memory, gathered into batches there.

:class:`DataLoader` copies a split's host arrays to the device once. Each epoch it draws a
permutation on the host from ``(seed, epoch)`` alone, copies it to the device (the only
host-to-device copy of an epoch) and gathers each batch's rows there (``numpy.take``; on the GPU one
kernel for every dtype, :mod:`mlptrain.data.cuda.gather`). Because the order
depends on nothing but ``(seed, epoch)``, a resumed run replays the same batches from any
``(epoch, start_batch)``. One code path serves NumPy and CuPy through ``xp``.

Row weights (``data.weight``) travel as the last column of the targets (:func:`with_weights`): a weighted
split's ``y`` is ``(N, 1 + T)`` float64, gathered, copied and staged with each batch exactly as ``y`` is, by
this loader, the host-resident one and the streamed one alike; the loss splits it again
(:func:`mlptrain.nn.losses.row_weighted`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

from mlptrain.base.errors import ConfigError
from mlptrain.data.files import chunks
from mlptrain.distributed.dp import shard_rows

log = logging.getLogger(__name__)


def with_weights(y: Any, w: Any) -> np.ndarray:
    """``(N, 1 + T)`` float64: the labels ``y (N,)`` (exact in float64 below 2**53) or targets ``y (N, T)``, then
    the rows' weights ``w (N,)`` as the last column."""
    y = np.asarray(y)
    return np.concatenate([y.reshape(len(y), -1).astype(np.float64), np.asarray(w, np.float64)[:, None]], axis=1)


def _owned_copy(xp: ModuleType, a: Any, dtype: Any) -> Any:
    """A C-contiguous copy of the host array ``a`` in ``dtype`` on ``xp``'s device: on the GPU through
    pinned staging buffers (:func:`mlptrain.data.cuda.upload.to_device`), never a whole host copy first."""
    if xp is np:
        return np.array(a, dtype=dtype, order="C")
    from mlptrain.data.cuda.upload import to_device

    return to_device(a, dtype)


class DataLoader:
    """Shuffled (or ordered) mini-batches of one split, kept on the device.

    Args:
        x: ``(N, F)`` host features.
        y: ``(N,)`` host integer labels, or ``(N, T)`` regression targets.
        batch_size: Rows per batch ``B`` (the last batch may be shorter unless ``drop_last``).
        xp: ``numpy`` or ``cupy``; the arrays are stored and batches are yielded there.
        dtype: Feature dtype on the device, e.g. ``numpy.float32``.
        shuffle: Draw a new order each epoch; otherwise batches follow ``arange(N)``.
        drop_last: Skip the final short batch.
        seed: Non-negative seed of the epoch permutations.
        shard: ``(rank, world)``: yield only this rank's rows of every global batch
            (:func:`mlptrain.distributed.dp.shard_rows`); every rank draws the same global order.
        w: ``(N,)`` row weights, or None: carried as the last column of ``y`` (:func:`with_weights`).

    Attributes:
        x: ``(N, F)`` device array of ``dtype``, C-contiguous.
        y: ``(N,)`` int64 device labels, or ``(N, T)`` float32 targets; with ``w``, ``(N, 1 + T)`` float64.
        weighted: whether ``y`` carries row weights.

    Raises:
        ConfigError: ``batch_size < 1``, ``seed < 0``, ``x`` not 2-D, ``y`` not 1-D integers, length
            mismatch, or ``drop_last`` with fewer samples than one batch (zero batches per epoch).
    """

    def __init__(
        self,
        x: Any,
        y: Any,
        batch_size: int,
        *,
        xp: ModuleType,
        dtype: Any,
        shuffle: bool,
        drop_last: bool,
        seed: int,
        shard: tuple[int, int] | None = None,
        w: Any = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ConfigError(f"DataLoader batch_size={batch_size!r} must be a positive integer")
        if int(seed) < 0:
            raise ConfigError(f"DataLoader seed={seed} must be a non-negative integer")
        if x.ndim != 2:
            raise ConfigError(f"DataLoader x has shape {tuple(x.shape)}; expected (N, F)")
        if y.ndim not in (1, 2) or len(y) != len(x):
            raise ConfigError(
                f"DataLoader y has shape {tuple(y.shape)}; expected ({len(x)},) labels or ({len(x)}, T) targets to "
                f"match x {x.shape}"
            )
        if y.ndim == 1 and not np.issubdtype(np.dtype(y.dtype), np.integer):
            raise ConfigError(f"DataLoader y has dtype {y.dtype}; expected integer class labels (or (N, T) targets)")
        n = len(x)
        if drop_last and 0 < n < batch_size:
            raise ConfigError(
                f"DataLoader batch_size={batch_size} with drop_last=true gives no batch for {n} samples; "
                f"lower the batch size to at most {n} or set drop_last=false"
            )
        if shard is not None:
            rank, world = shard
            if not 0 <= rank < world or batch_size < world:
                raise ConfigError(
                    f"DataLoader shard {shard} of batch_size={batch_size}: expected 0 <= rank < world <= "
                    "batch_size (every rank takes at least one row of a batch)"
                )
            short = n % batch_size
            if not drop_last and 0 < short < world:
                raise ConfigError(
                    f"the last batch of {n} samples in batches of {batch_size} has {short} rows, fewer than the "
                    f"{world} ranks; set drop_last=true or choose another batch size"
                )
        self.shard = shard
        self.global_rows = 0  # of the batch last yielded
        self.xp = xp
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.seed = int(seed)
        # Always a copy, on the CPU too, so NumPy and CuPy runs share semantics: the loader owns its data.
        # The dtype is set on the host, chunk by chunk into pinned staging buffers on the GPU
        # (mlptrain.data.cuda.upload): a device-side cast would compile a CuPy kernel per dtype pair on a
        # fresh machine (the first run's start-up), and pageable memory copies at a fraction of the bus.
        # y: (N,) int64 class labels, or (N, T) float32 regression targets; C order like x (the GPU's
        # gather copies whole rows: a Fortran-ordered (N, T) from pandas' to_numpy() would have none)
        self.dtype = np.dtype(dtype)  # of the features in a batch
        self.weighted = w is not None
        if w is not None:
            if np.shape(w) != (n,):
                raise ConfigError(f"DataLoader w has shape {np.shape(w)}; expected ({n},) row weights")
            y = with_weights(y, w)  # (N, 1 + T) float64: the weight gathered with each batch's targets
        self._store(x, y, np.float64 if w is not None else np.int64 if y.ndim == 1 else np.float32)
        # Gathering inside the step (place_order, gather_in_step): the epoch's order and the step count at
        # its batch 0, in device buffers whose addresses never change (a captured step reads them).
        self._order: Any = None  # (N,) int64
        self._base: Any = None  # (1,) int64

    resident = True  # the split lives in device memory (mlptrain.data.host_loader.HostLoader: in host memory)

    def _store(self, x: Any, y: Any, y_dtype: Any) -> None:
        """Keep the split: here a copy of each array on the device (``self.x (N, F)``, ``self.y``)."""
        start = time.perf_counter()
        self.x = _owned_copy(self.xp, x, self.dtype)  # (N, F)
        self.y = _owned_copy(self.xp, y, y_dtype)  # (N,) or (N, T)
        if self.xp is not np:
            chunks.log_phase("copy to the device", start, int(self.x.nbytes + self.y.nbytes))

    def batch_spec(self, rows: int) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...], np.dtype]:
        """``(x shape, x dtype, y shape, y dtype)`` of a batch of ``rows`` on the device."""
        return (rows, self.x.shape[1]), self.dtype, (rows, *self.y.shape[1:]), np.dtype(self.y.dtype)

    def empty_batch(self, rows: int) -> tuple[Any, Any]:
        """Fresh ``(xb, yb)`` device arrays for a batch of ``rows`` (what :meth:`gather_in_step` fills where no
        CUDA graph holds buffers of its own: the CPU, in tests)."""
        x_shape, x_dtype, y_shape, y_dtype = self.batch_spec(rows)
        return self.xp.empty(x_shape, x_dtype), self.xp.empty(y_shape, y_dtype)

    @property
    def num_samples(self) -> int:
        """Number of rows ``N``."""
        return int(self.x.shape[0])

    def __len__(self) -> int:
        """Batches per epoch."""
        n, b = self.num_samples, self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def row_counts(self) -> list[int]:
        """The rows of this loader's batches, largest first: the batch size, and a short last batch (the kernels
        compiled ahead are planned for each, :meth:`mlptrain.step.trainer.Trainer.precompile_jobs`)."""
        n, b = self.num_samples, self.batch_size
        rows = {min(b, n)} if n else set()
        if n > b and n % b and not self.drop_last:
            rows.add(n % b)
        return sorted(rows, reverse=True)

    def permutation(self, epoch: int) -> np.ndarray:
        """The host order of ``epoch``: ``(N,)`` int64, a function of ``(seed, epoch)`` only."""
        if epoch < 0:
            raise ConfigError(f"DataLoader epoch={epoch} must be non-negative")
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_samples)

    def epoch(self, epoch: int, start_batch: int = 0, out: Any = None) -> Iterator[tuple[Any, Any]]:
        """Yield ``(xb, yb)`` device batches of ``epoch``, starting at batch ``start_batch``.

        ``xb`` is ``(B, F)`` of the loader's dtype and C-contiguous, ``yb`` is ``(B,)`` int64. Both
        are fresh arrays gathered on the device; ``B`` is ``batch_size`` except for a short last
        batch when ``drop_last`` is false.

        ``out``: optional ``rows -> (xb, yb) or None``. When it returns arrays, the batch is
        gathered into them instead of fresh ones (the training step's CUDA graph reads fixed
        input buffers: gathering straight into them saves a copy per step). The next batch of
        that size overwrites them, in stream order.

        Raises:
            ConfigError: ``start_batch`` outside ``[0, len(self)]``, or a negative ``epoch``.
        """
        if not 0 <= start_batch <= len(self):
            raise ConfigError(f"DataLoader start_batch={start_batch} must be in [0, {len(self)}] (batches per epoch)")
        perm = self.xp.asarray(self.permutation(epoch))  # (N,) the epoch's one host-to-device copy
        return self._batches(perm, start_batch, out)

    def _batches(self, perm: Any, start_batch: int, out: Any) -> Iterator[tuple[Any, Any]]:
        b = self.batch_size
        for i in range(start_batch, len(self)):
            idx = perm[i * b : (i + 1) * b]  # (B,) device indices
            self.global_rows = len(idx)  # the batch's rows on every rank together (Trainer.rows)
            if self.shard is not None:  # this rank's rows of the global batch
                idx = idx[shard_rows(len(idx), *self.shard)]
            bufs = out(len(idx)) if out is not None else None
            if bufs is None:
                yield self._take(self.x, idx), self._take(self.y, idx)  # (B, F), (B,) or (B, T)
                continue
            xb, yb = bufs
            self.check_buffers(xb, yb, len(idx))
            self._take(self.x, idx, xb)
            self._take(self.y, idx, yb)
            yield xb, yb

    def check_buffers(self, xb: Any, yb: Any, rows: int) -> None:
        """Raise ValueError unless ``xb``, ``yb`` have the shapes and dtypes of a batch of ``rows`` rows."""
        want = self.batch_spec(rows)
        if (tuple(xb.shape), xb.dtype, tuple(yb.shape), yb.dtype) != want:
            raise ValueError(
                f"batch buffers {xb.shape} {xb.dtype} / {yb.shape} {yb.dtype} do not fit a batch of "
                f"{want[0]} {want[1]} / {want[2]} {want[3]}"
            )

    # --- the batch gathered by the step itself (a CUDA graph replays it with the step) -------------

    def place_order(self, epoch: int, start_batch: int, step: int) -> None:
        """Put the order of ``epoch`` on the device, for :meth:`gather_in_step`: its batch ``start_batch``
        is the one of optimizer step ``step`` (the step count there), the next batch the next step's.

        Both go into buffers made once, by copies on the current stream: in order after the steps
        already queued, which may still read the last epoch's order.
        """
        if not 0 <= start_batch <= len(self):
            raise ConfigError(f"DataLoader start_batch={start_batch} must be in [0, {len(self)}] (batches per epoch)")
        perm = self.step_order(epoch)  # (N,) int64, host
        base = np.array([step - start_batch], dtype=np.int64)
        if self.xp is np:
            self._order, self._base = perm, base
            return
        if self._order is None or self._order.size != perm.size:
            self._order = self.xp.empty(perm.size, dtype=np.int64)
            self._base = self.xp.empty(1, dtype=np.int64)
        stream = self.xp.cuda.get_current_stream()
        self._order.set(perm, stream=stream)
        self._base.set(base, stream=stream)

    def batch_rows(self, start_batch: int) -> Iterator[int]:
        """The rows each batch from ``start_batch`` on has (this rank's share, data parallel)."""
        n, b = self.num_samples, self.batch_size
        for i in range(start_batch, len(self)):
            self.global_rows = min(b, n - i * b)
            yield self._shard(self.global_rows).stop - self._shard(self.global_rows).start

    def step_order(self, epoch: int) -> np.ndarray:
        """The order :meth:`gather_in_step` reads, ``(N,)`` int64 on the host: the epoch's permutation (an
        ensemble's: every member's, batch by batch, :meth:`mlptrain.data.member_loader.MemberLoader.step_order`)."""
        return self.permutation(epoch)

    @property
    def stacked(self) -> int:
        """Batches stacked in one step's batch: 1 here (an ensemble's loader: K, one per member)."""
        return 1

    def gather_in_step(self, xb: Any, yb: Any, step: Any) -> None:
        """Gather the batch of the step whose count is ``step`` (a 0-d int64 device array: steps done)
        into ``xb (B, F)`` and ``yb`` (an ensemble's ``(K, B, F)``, ``(K, B)``: the ``K B`` positions of its
        stacked batch), reading the count on the device (:func:`mlptrain.data.cuda.gather.take_rows_at`).

        The first kernels of a training step that gathers its own batch: captured with it, every replay
        takes the next batch of the order :meth:`place_order` placed, with no launch from the host.
        """
        offset = self._shard(self.global_rows).start
        stride = self.stacked * self.batch_size  # positions a full batch takes in the order
        flat_x, flat_y = xb.reshape(-1, *self.x.shape[1:]), yb.reshape(-1, *self.y.shape[1:])  # views
        if self.xp is np:
            first = (int(step) - int(self._base[0])) * stride + offset
            idx = self._order[first : first + len(flat_x)]
            chunks.take_into(self.x, idx, flat_x)
            chunks.take_into(self.y, idx, flat_y)
            return
        from mlptrain.data.cuda.gather import take_rows_at

        for src, out in ((self.x, flat_x), (self.y, flat_y)):
            take_rows_at(src, self._order, out, step, self._base, stride, offset)

    def sample_batch(self, xb: Any, yb: Any, step: Any) -> None:
        """A valid batch in ``xb``, ``yb`` (to plan and capture a step on, ahead of its shape's first batch):
        here the batch of step ``step``'s first rows (:meth:`gather_in_step`)."""
        self.gather_in_step(xb, yb, step)

    def _shard(self, rows: int) -> slice:
        """This rank's rows of a global batch of ``rows`` (all of them on one process)."""
        return slice(0, rows) if self.shard is None else shard_rows(rows, *self.shard)

    def _take(self, src: Any, idx: Any, out: Any = None) -> Any:
        """``src[idx]`` (whole rows) into ``out`` or a new array; on the GPU one header-free kernel for
        every dtype (:func:`mlptrain.data.cuda.gather.take_rows`), where ``xp.take`` compiles one per dtype."""
        if self.xp is np:
            return np.take(src, idx, axis=0) if out is None else chunks.take_into(src, idx, out)
        from mlptrain.data.cuda.gather import take_rows

        return take_rows(src, idx, out)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        """The batches of epoch 0."""
        return self.epoch(0)
