"""Mini-batches of a split kept in host memory (``data.residency=host``): for data larger than the GPU.

:class:`~mlptrain.data.loader.DataLoader` copies a split to the device once and gathers its batches
there. :class:`HostLoader` keeps the split on the host, in the compute dtype (cast once, or the
dataset's own array when it is that dtype already), and moves each batch as the loop needs it::

    producer thread (mlptrain.data.host_loader.Pipe), batch i+1, i+2 while the device runs step i:
        rows = order[i*B : (i+1)*B]                      # the same order as a resident split
        slot k = i % 3:  x[rows] -> pinned (B, F)        # np.take on host threads (no GIL held)
                         pinned -> device stage (B, F)   # cudaMemcpyAsync on a copy stream
    the loop, batch i:
        stream waits for slot k's copy;  stage -> the step's input buffers (one D2D copy each), then the step

so the host's gather and the bus's copy overlap the steps before it (double buffering, one slot to
spare), and a step still replays one CUDA graph. The batches are the resident loader's bit for bit:
the same rows in the same order, cast to the same dtype once on the host, so the losses are too
(``tests/test_host_loader.py``, ``tests/gpu/test_host_loader_gpu.py``). On the CPU the same loader
gathers straight from the host array (no copy of the table is made), with the same pipe.

The GPU half (pinned buffers, the copy stream, the events that order the slots) is
:mod:`mlptrain.data.cuda.host_loader`; the order, the shards and the checks are the resident loader's.

**The ring** (:class:`Pipe`): work done ahead on a host thread, into a ring of slots. A host-resident
split (:class:`HostLoader`, ``data.residency=host``) gives each
step a batch gathered on the host and copied to the device while the step before it runs. The
producer and the consumer share a ring of ``slots`` buffers::

    producer thread:  for each item i:  wait for a free slot k = i % slots;  produce(k, item)  -> ready
    consumer (loop):  for k, value in pipe:  use slot k (queue the work that reads it);  the slot is
                      released when the consumer asks for the next one

so the producer runs at most ``slots`` items ahead, and slot ``k`` is written again only after the
consumer is done queueing work on it. What "done" means on the device (the copies and the step read
the slot in stream order) is the produce function's and the consumer's business
(:mod:`mlptrain.data.cuda.host_loader`, CUDA events); this module only orders the host's side, and is plain
Python, so the CPU tests run it with NumPy buffers.

An exception in ``produce`` is raised in the consumer, at the item it failed on; a consumer that
stops early (``break``, an exception of its own) closes the pipe, and the producer stops at its
next item.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import numpy as np

from mlptrain.base.errors import ConfigError, ResourceError
from mlptrain.base.registry import joined
from mlptrain.config.schema import DataConfig, Residency, values
from mlptrain.data.dataset import Dataset
from mlptrain.data.files import chunks
from mlptrain.data.loader import DataLoader
from mlptrain.data.rows import NormalisedRows

log = logging.getLogger(__name__)

SLOTS = 3  # batches in flight: one the step reads, one on the bus, one being gathered
TAKE_THREADS = 8  # host threads gathering a batch's rows (NumPy's take releases the GIL)
# A thread's share of a gather is at least this many bytes: below it the pool's hand-offs cost more than the
# copy (8192 int64 labels on 8 threads took 0.49 ms on the H200 host, on one thread a few microseconds).
MIN_BYTES_PER_THREAD = 1 << 20


def host_table(x: Any, dtype: np.dtype) -> np.ndarray | NormalisedRows:
    """``x (N, F)`` as a C-contiguous, aligned host array of ``dtype``: ``x`` itself when it is one,
    else a copy cast chunk by chunk on threads (the cast done once, not per batch); a streamed split
    (:class:`~mlptrain.data.rows.NormalisedRows`) stays one, handing out rows of ``dtype``."""
    if isinstance(x, NormalisedRows):  # streamed: its rows are read, normalised and cast as they are taken
        return x.as_dtype(dtype)
    a = np.asarray(x)
    if a.dtype == dtype and a.flags.c_contiguous and a.flags.aligned:
        return a
    start = time.perf_counter()
    out = np.empty(a.shape, dtype)

    def fill(part: tuple[int, int]) -> None:
        np.copyto(out[part[0] : part[1]], a[part[0] : part[1]], casting="unsafe")

    chunks.run(fill, chunks.ranges(len(a), chunks.chunk_rows(int(np.prod(a.shape[1:])))))
    chunks.log_phase(f"cast to {dtype.name} on the host", start, out.nbytes)
    return out


def take_rows(src: np.ndarray, idx: np.ndarray, out: np.ndarray, pool: ThreadPoolExecutor | None) -> None:
    """``out[:] = src[idx]`` (whole rows), split over ``pool``'s threads for a large batch."""
    n = len(idx)
    row_bytes = src.dtype.itemsize * int(np.prod(src.shape[1:]))
    parts = 1 if pool is None else min(TAKE_THREADS, max(1, n * row_bytes // MIN_BYTES_PER_THREAD))
    take = src.take if isinstance(src, NormalisedRows) else lambda i, o: chunks.take_into(src, i, o)
    if pool is None or parts <= 1:
        take(idx, out)
        return
    cuts = chunks.ranges(n, -(-n // parts))
    list(pool.map(lambda c: take(idx[c[0] : c[1]], out[c[0] : c[1]]), cuts))


class HostStaging:
    """The CPU's slots: each batch gathered by the producer into fresh arrays (the consumer keeps them)."""

    slots = SLOTS

    def __init__(self, x: np.ndarray, y: np.ndarray, pool: ThreadPoolExecutor | None) -> None:
        self.x, self.y, self.pool = x, y, pool

    def produce(self, k: int, item: tuple[np.ndarray, int]) -> tuple[Any, Any, int, int]:
        """Slot ``k``'s batch: ``(xb, yb, rows, global rows)`` gathered from ``item = (indices, global rows)``."""
        idx, global_rows = item
        xb = np.empty((len(idx), *self.x.shape[1:]), self.x.dtype)  # (B, F)
        take_rows(self.x, idx, xb, self.pool)
        return xb, np.take(self.y, idx, axis=0), len(idx), global_rows

    def deliver(self, k: int, made: tuple[Any, ...], bufs: tuple[Any, Any] | None) -> tuple[Any, Any]:
        """The batch ``produce`` made, in ``bufs`` (copied) or as it is."""
        xb, yb = made[:2]
        if bufs is None:
            return xb, yb
        np.copyto(bufs[0], xb)
        np.copyto(bufs[1], yb)
        return bufs


class HostLoader(DataLoader):
    """Shuffled (or ordered) mini-batches of one split kept in host memory, copied to ``xp``'s device
    a batch at a time, a few batches ahead of the loop. Same arguments, order, shards and batches as
    :class:`~mlptrain.data.loader.DataLoader`.

    Attributes:
        x: ``(N, F)`` host array of ``dtype`` (the dataset's own when it has that dtype: not copied).
        y: ``(N,)`` int64 host labels, or ``(N, T)`` float32 targets.
    """

    resident = False

    def _store(self, x: Any, y: Any, y_dtype: Any) -> None:
        self.x = host_table(x, self.dtype)  # (N, F)
        self.y = np.ascontiguousarray(y, dtype=y_dtype)  # (N,) or (N, T)
        self._pool: ThreadPoolExecutor | None = None
        self._staging: Any = None

    def epoch(self, epoch: int, start_batch: int = 0, out: Any = None) -> Iterator[tuple[Any, Any]]:
        """Yield ``(xb, yb)`` device batches of ``epoch`` from batch ``start_batch``, as
        :meth:`DataLoader.epoch` does (the same batches, ``out`` as there)."""
        if not 0 <= start_batch <= len(self):
            raise ConfigError(f"DataLoader start_batch={start_batch} must be in [0, {len(self)}] (batches per epoch)")
        return self._host_batches(self.permutation(epoch), start_batch, out)

    def _items(self, perm: np.ndarray, start_batch: int) -> Iterator[tuple[np.ndarray, int]]:
        """``(rows of this rank, rows of the global batch)`` of each batch from ``start_batch`` (producer thread)."""
        b = self.batch_size
        for i in range(start_batch, len(self)):
            idx = perm[i * b : (i + 1) * b]  # (B,) host indices
            yield idx[self._shard(len(idx))], len(idx)

    def _host_batches(self, perm: np.ndarray, start_batch: int, out: Any) -> Iterator[tuple[Any, Any]]:
        staging = self._stage()
        pipe = Pipe(self._items(perm, start_batch), staging.produce, staging.slots, name="batches")
        for k, made in pipe:
            rows, self.global_rows = made[-2:]  # this rank's rows, the global batch's
            bufs = out(rows) if out is not None else None
            if bufs is not None:
                xb, yb = bufs
                self.check_buffers(xb, yb, rows)
            yield staging.deliver(k, made, bufs)

    def _stage(self) -> Any:
        """The slots (made at the first epoch): pinned and device buffers on the GPU, none on the CPU."""
        if self._staging is None:
            if self.batch_size * self.x.dtype.itemsize * self.x.shape[1] >= 2 * MIN_BYTES_PER_THREAD:
                self._pool = ThreadPoolExecutor(min(TAKE_THREADS, chunks.threads()), thread_name_prefix="mlptrain-take")
            if self.xp is np:
                self._staging = HostStaging(self.x, self.y, self._pool)
            else:
                from mlptrain.data.cuda.host_loader import DeviceStaging

                rows = len(range(self.batch_size)[self._shard(self.batch_size)])  # this rank's share of a full batch
                self._staging = DeviceStaging(self.x, self.y, rows, SLOTS, self._pool, take_rows)
        return self._staging

    @property
    def device_bytes(self) -> int:
        """Device memory this split holds: its batch slots on the GPU (made at the first epoch), none on the CPU."""
        return int(getattr(self._staging, "nbytes", 0))

    def sample_batch(self, xb: Any, yb: Any, step: Any) -> None:
        """A valid batch in ``xb``, ``yb``: the split's first rows (copied on the current stream)."""
        n = len(xb)
        if self.xp is np:
            np.copyto(xb, self.x[:n])
            np.copyto(yb, self.y[:n])
            return
        stream = self.xp.cuda.get_current_stream()
        xb.set(self.x[:n], stream=stream)
        yb.set(self.y[:n], stream=stream)

    def place_order(self, epoch: int, start_batch: int, step: int) -> None:
        raise ConfigError("a host-resident split (data.residency=host) is gathered on the host, not by the step")

    def gather_in_step(self, xb: Any, yb: Any, step: Any) -> None:
        raise ConfigError("a host-resident split (data.residency=host) is gathered on the host, not by the step")


def residency(cfg: DataConfig, dataset: Dataset, xp: Any, dtype: np.dtype) -> str:
    """``"device"`` or ``"host"``: where the splits of ``dataset`` in ``dtype`` live (``data.residency``).

    Streamed splits (``stream``, or ``auto``/``host`` where :func:`mlptrain.data.prepare.load_dataset` found
    the normalised splits too large for host memory) are host-resident: read from the table batch by batch.

    ``auto`` keeps them on the device where they take at most 90% of its free memory, else in host memory
    (logged); ``device`` raises :class:`ResourceError` where they do not fit. On the CPU both are host memory:
    ``host`` then gathers each batch from the dataset's array instead of a copy of the split.
    """
    asked = str(getattr(cfg.residency, "value", cfg.residency))
    if asked not in values(Residency):
        raise ConfigError(f"data.residency={asked!r}; expected {joined(values(Residency), 'or')}")
    if isinstance(dataset.x_train, NormalisedRows):  # streamed (mlptrain.data.rows): read as the batches need it
        if asked == "device":
            raise ConfigError(
                f"data.residency=device, but dataset {dataset.name}'s splits are streamed from its table "
                "(mlptrain.data.rows.NormalisedRows); use data.residency=host, stream or auto"
            )
        return "host"
    if asked in ("host", "stream"):
        return "host"
    if xp is np:
        return "device"
    free, total = xp.cuda.runtime.memGetInfo()
    try:
        check_device_memory(dataset, dtype, free, total)
    except ResourceError:
        if asked == "device":
            raise
        log.info(
            "dataset %s: the splits do not fit the GPU's free memory (%s free): kept in host memory, each batch "
            "copied ahead of its step (data.residency=host)",
            dataset.name,
            _size(free),
        )
        return "host"
    return "device"


def check_device_memory(dataset: Dataset, dtype: np.dtype, free: int, total: int) -> None:
    """Raise ResourceError if the splits of ``dataset`` in ``dtype`` take more than 90% of ``free`` bytes."""
    rows = len(dataset.x_train) + len(dataset.x_val) + len(dataset.x_test)
    y_bytes = 8 if dataset.task == "classification" else 4 * dataset.num_outputs
    need = rows * (dataset.num_features * dtype.itemsize + y_bytes)
    if dataset.w_train is not None:  # the training targets and weights as (N, 1 + T) float64 (data.weight)
        need += len(dataset.x_train) * (
            8 * (1 + (dataset.num_outputs if dataset.task == "regression" else 1)) - y_bytes
        )
    if need > 0.9 * free:
        raise ResourceError(
            f"dataset {dataset.name!r} ({rows:,} rows x {dataset.num_features} features in {dtype.name}) needs "
            f"{_size(need)} on the GPU, more than the {_size(free)} free of {_size(total)}; "
            "keep the splits in host memory (data.residency=host or auto), use fewer rows, or a half-precision "
            "run (precision=bf16 or fp16) to halve it"
        )


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


T = TypeVar("T")
R = TypeVar("R")

_END = object()  # the producer ran out of items


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Pipe(Generic[T, R]):
    """``produce(k, item)`` for each of ``items`` on a thread of its own, into slot ``k = i % slots``.

    Iterate it for ``(k, value)`` in the items' order, ``value`` what ``produce`` returned. Slot ``k``
    is handed back to the producer when the next ``(k', value')`` is asked for, or when the pipe is closed.

    Args:
        items: what to produce, in order (read on the producer thread).
        produce: ``produce(k, item) -> value``: fill slot ``k`` from ``item``.
        slots: the ring's size (at least 1): how many items may be produced and not yet released.
        name: the thread's name.
    """

    def __init__(self, items: Iterable[T], produce: Callable[[int, T], R], slots: int, name: str = "prefetch") -> None:
        if slots < 1:
            raise ValueError(f"Pipe slots={slots}: expected at least 1")
        self.slots = slots
        self._items, self._produce = items, produce
        self._free = threading.Semaphore(slots)
        self._ready: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._held = False  # the consumer holds the slot it was handed last
        self._done = False
        self._thread = threading.Thread(target=self._run, name=f"mlptrain-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for i, item in enumerate(self._items):
                while not self._free.acquire(timeout=0.05):  # a free slot, or a consumer that went away
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                k = i % self.slots
                self._ready.put((k, self._produce(k, item)))
            self._ready.put(_END)
        except BaseException as exc:  # noqa: BLE001 (raised again in the consumer)
            self._ready.put(_Failed(exc))

    def __iter__(self) -> Iterator[tuple[int, R]]:
        try:
            while True:
                self._release()
                got = self._ready.get()
                if got is _END:
                    return
                if isinstance(got, _Failed):
                    raise got.exc
                self._held = True
                yield got
        finally:
            self.close()

    def _release(self) -> None:
        if self._held:
            self._held = False
            self._free.release()

    def close(self) -> None:
        """Stop the producer (after the item it is producing) and wait for its thread."""
        if self._done:
            return
        self._done = True
        self._stop.set()
        self._release()
        self._thread.join()
