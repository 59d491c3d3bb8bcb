"""The GPU half of a host-resident loader: batches gathered into pinned slots, copied on a stream of their own.

:class:`mlptrain.data.host_loader.HostLoader` runs :meth:`DeviceStaging.produce` on its producer thread
and :meth:`DeviceStaging.deliver` in the loop. Each of ``slots`` slots is a pinned host buffer and a
device buffer of one full batch (``(B, F)`` features of the compute dtype, ``(B,)`` or ``(B, T)``
targets). Two events per slot order it on the device without the loop ever waiting on the host::

    produce (producer thread), slot k:
        copied[k].synchronize()          # the last copy out of pinned[k] has finished (host waits, not the loop)
        pinned[k] <- x[rows]             # host gather (np.take on threads)
        copy stream waits consumed[k]    # the loop's last copy out of stage[k] has run
        stage[k] <- pinned[k]            # cudaMemcpyAsync, host to device
        copied[k] recorded
    deliver (the loop, its current stream), slot k:
        stream waits copied[k]
        out <- stage[k]                  # cudaMemcpyAsync, device to device: the step's input buffers
        consumed[k] recorded

A slot is handed back to the producer only after ``deliver`` recorded ``consumed[k]``
(:class:`mlptrain.data.host_loader.Pipe`), so the events are always recorded before they are waited on.
No kernel is launched: every copy is a ``cudaMemcpyAsync``, which compiles nothing on a fresh
machine and is captured by nothing (the step's graph starts at its input buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cupy as cp
import numpy as np


def pinned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A host array in page-locked memory (the DMA engine reads it while the host goes on)."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    mem = cp.cuda.alloc_pinned_memory(max(1, nbytes))
    return np.frombuffer(mem, dtype, int(np.prod(shape))).reshape(shape)


def copy_device(dst: Any, src: Any, stream: Any) -> None:
    """``dst[...] = src`` for C-contiguous device arrays of the same shape and dtype: one ``cudaMemcpyAsync``."""
    if dst.shape != src.shape or dst.dtype != src.dtype or not (dst.flags.c_contiguous and src.flags.c_contiguous):
        raise ValueError(
            f"copy_device: {src.shape} {src.dtype} into {dst.shape} {dst.dtype}; expected C-contiguous twins"
        )
    if dst.nbytes:
        kind = cp.cuda.runtime.memcpyDeviceToDevice
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, dst.nbytes, kind, stream.ptr)


class DeviceStaging:
    """``slots`` pinned and device buffers of ``rows`` rows of ``x``'s and ``y``'s row shapes and dtypes.

    Args:
        x: ``(N, F)`` host features in the compute dtype (C order).
        y: ``(N,)`` or ``(N, T)`` host targets.
        rows: the most rows a batch has (this rank's share of a full batch).
        slots: the ring's size.
        pool: host threads for the gather (or None).
        take: ``take(src, idx, out, pool)``: ``out[:] = src[idx]`` on the host.
    """

    def __init__(
        self,
        x: np.ndarray,
        y: np.ndarray,
        rows: int,
        slots: int,
        pool: ThreadPoolExecutor | None,
        take: Callable[[np.ndarray, np.ndarray, np.ndarray, Any], None],
    ) -> None:
        self.x, self.y, self.slots, self.pool, self.take = x, y, slots, pool, take
        self.device = cp.cuda.Device().id  # the producer thread runs its copies on the loop's device
        self.stream = cp.cuda.Stream(non_blocking=True)
        shapes = [(rows, *a.shape[1:]) for a in (x, y)]
        self.pinned = [[pinned_empty(s, a.dtype) for s, a in zip(shapes, (x, y), strict=True)] for _ in range(slots)]
        self.stage = [[cp.empty(s, a.dtype) for s, a in zip(shapes, (x, y), strict=True)] for _ in range(slots)]
        self.copied = [cp.cuda.Event(disable_timing=True) for _ in range(slots)]
        self.consumed = [cp.cuda.Event(disable_timing=True) for _ in range(slots)]
        self._copied_once = [False] * slots
        self._consumed_once = [False] * slots
        # The buffers are made on the current stream's pool: the copy stream must not write them first.
        self.stream.wait_event(cp.cuda.get_current_stream().record())

    @property
    def nbytes(self) -> int:
        """Device bytes of the slots."""
        return sum(a.nbytes for slot in self.stage for a in slot)

    def produce(self, k: int, item: tuple[np.ndarray, int]) -> tuple[int, int]:
        """Gather ``item = (indices, global rows)`` into slot ``k`` and queue its copy to the device;
        returns ``(rows, global rows)`` (producer thread)."""
        idx, global_rows = item
        n = len(idx)
        with cp.cuda.Device(self.device):
            if self._copied_once[k]:
                self.copied[k].synchronize()  # pinned[k] is read by no copy any more
            for src, pinned in zip((self.x, self.y), self.pinned[k], strict=True):
                self.take(src, idx, pinned[:n], self.pool)  # (n, ...) rows into the pinned slot
            if self._consumed_once[k]:
                self.stream.wait_event(self.consumed[k])  # the loop's copy out of stage[k] has run
            for stage, pinned in zip(self.stage[k], self.pinned[k], strict=True):
                stage[:n].set(pinned[:n], stream=self.stream)  # from pinned memory: asynchronous
            self.copied[k].record(self.stream)
            self._copied_once[k] = True
        return n, global_rows

    def deliver(self, k: int, made: tuple[int, int], bufs: tuple[Any, Any] | None) -> tuple[Any, Any]:
        """Slot ``k``'s batch in ``bufs`` (the step's input buffers) or in fresh arrays, queued on the current
        stream after the slot's copy (the loop's thread)."""
        n = made[0]
        stream = cp.cuda.get_current_stream()
        stream.wait_event(self.copied[k])
        xs, ys = self.stage[k]
        if bufs is None:
            bufs = (cp.empty((n, *xs.shape[1:]), xs.dtype), cp.empty((n, *ys.shape[1:]), ys.dtype))
        for dst, src in zip(bufs, (xs[:n], ys[:n]), strict=True):
            copy_device(dst, src, stream)
        self.consumed[k].record(stream)
        self._consumed_once[k] = True
        return bufs
