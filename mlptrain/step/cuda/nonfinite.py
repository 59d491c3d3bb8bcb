"""Which of many tensors hold an inf or NaN: one launch, one program compiled once per machine.

The training loop checks the parameters (and gradients) every log interval
(:func:`mlptrain.run.faults.nonfinite_tensors`). A CuPy reduction per tensor compiles a kernel per
dtype, shape and block size the first time it runs: the default digits run compiled 20 of them,
most of its time from a cold cache. This kernel reads a table of pointers and sizes instead, so one
program serves every model, and it needs no headers: a value is inf or NaN
exactly when its exponent bits are all ones, which it tests on the raw bits of each dtype
(float16 ``0x7C00``, bfloat16 ``0x7F80``, float32 ``0x7F800000``, float64 ``0x7FF0...``). The four
variants are compiled in one NVRTC call with mlptrain's other header-free kernels
(:mod:`mlptrain.base.cuda.plain_kernels`) and cached on disk by CuPy.

Launch: ``grid = (blocks, tensors)``; block ``y`` scans tensor ``y`` with a grid-stride loop and
sets ``flags[y]`` if any element is non-finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cupy as cp
import numpy as np

from mlptrain.base.cuda.plain_kernels import function

_THREADS = 256


def nonfinite_flags(arrays: Sequence[Any]) -> list[bool]:
    """For each CuPy array (float16, bfloat16, float32 or float64), whether it holds inf or NaN.

    One launch per dtype present, and a wait for the device per dtype as its flags come back
    (no CuPy indexing or concatenation, which would compile kernels of their own).
    """
    flags = [False] * len(arrays)
    groups: dict[str, list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(np.dtype(a.dtype).name, []).append(i)
    for dtype, index in groups.items():
        kernel = function(f"mlptrain_nonfinite_{dtype}")
        # the scan reads a.size elements from the first: any one-piece layout (C or F order) will do
        tensors = [
            a if a.flags.c_contiguous or a.flags.f_contiguous else cp.ascontiguousarray(a)
            for a in (arrays[i] for i in index)
        ]
        ptrs = cp.asarray(np.array([a.data.ptr for a in tensors], dtype=np.uint64))
        sizes = cp.asarray(np.array([a.size for a in tensors], dtype=np.int64))
        out = cp.zeros(len(tensors), dtype=cp.int32)
        blocks = max(1, min(-(-max(a.size for a in tensors) // _THREADS), 1024))
        kernel((blocks, len(tensors)), (_THREADS,), (ptrs, sizes, out))
        for i, f in zip(index, out.get().tolist(), strict=True):
            flags[i] = bool(f)
    return flags


class NonfiniteWatch:
    """:func:`nonfinite_flags` without the waits: the flags queued on the current stream, read later.

    The training loop checks the parameters once per log interval; waiting for the flags there would
    leave the device idle until the host queued the next steps. :meth:`queue` launches the same
    kernels into a device buffer and copies it into page-locked host memory on the stream, after the
    steps queued before it; :meth:`PendingFlags.result` waits for that copy alone. The pointer tables
    are made once per set of arrays (parameters, and a graph's gradients, keep their addresses from
    step to step), so a queue copies nothing from pageable memory, which would wait for the stream.
    """

    def __init__(self) -> None:
        # (addresses, sizes, dtypes) -> the launches, the device flags, two host buffers taking turns
        self._sets: dict[tuple, _FlagSet] = {}

    def queue(self, arrays: Sequence[Any]) -> PendingFlags:
        """Queue the check of ``arrays`` (contiguous CuPy arrays); the result comes in their order."""
        key = tuple((a.data.ptr, a.size, np.dtype(a.dtype).name) for a in arrays)
        fs = self._sets.get(key)
        if fs is None:
            fs = self._sets[key] = _FlagSet(arrays)
        return fs.queue()


class _FlagSet:
    """The kernels of one set of arrays, grouped by dtype: group ``g`` writes ``flags[offset_g : offset_g + n_g]``."""

    def __init__(self, arrays: Sequence[Any]) -> None:
        for a in arrays:
            if not (a.flags.c_contiguous or a.flags.f_contiguous):
                raise ValueError(f"NonfiniteWatch needs one-piece arrays; got shape {a.shape} strides {a.strides}")
        groups: dict[str, list[int]] = {}
        for i, a in enumerate(arrays):
            groups.setdefault(np.dtype(a.dtype).name, []).append(i)
        self.order = [i for index in groups.values() for i in index]  # flags position -> array position
        self.flags = cp.empty(len(arrays), dtype=cp.int32)
        self.launches = []
        offset = 0
        for dtype, index in groups.items():
            group = [arrays[i] for i in index]
            ptrs = cp.asarray(np.array([a.data.ptr for a in group], dtype=np.uint64))
            sizes = cp.asarray(np.array([a.size for a in group], dtype=np.int64))
            blocks = max(1, min(-(-max(a.size for a in group) // _THREADS), 1024))
            out = self.flags[offset : offset + len(group)]
            self.launches.append((function(f"mlptrain_nonfinite_{dtype}"), (blocks, len(group)), (ptrs, sizes, out)))
            offset += len(group)
        self.host = [_pinned_int32(len(arrays)) for _ in range(2)]
        self.turn = 0

    def queue(self) -> PendingFlags:
        stream = cp.cuda.get_current_stream()
        self.flags.data.memset_async(0, self.flags.nbytes, stream)  # (no fill kernel to compile)
        for kernel, grid, args in self.launches:
            kernel(grid, (_THREADS,), args)  # on the current stream
        host = self.host[self.turn]
        self.turn ^= 1
        self.flags.get(stream=stream, out=host, blocking=False)
        done = cp.cuda.Event(disable_timing=True)
        done.record(stream)
        return PendingFlags(host, self.order, done)


class PendingFlags:
    """The flags of one :meth:`NonfiniteWatch.queue`, on their way to the host."""

    def __init__(self, host: np.ndarray, order: list[int], done: Any) -> None:
        self._host, self._order, self._done = host, order, done
        self._flags: list[bool] | None = None

    def result(self) -> list[bool]:
        """For each array, in the order queued, whether it held inf or NaN (waits for this copy only)."""
        if self._flags is None:
            self._done.synchronize()
            flags = [False] * len(self._order)
            for pos, i in enumerate(self._order):
                flags[i] = bool(self._host[pos])
            self._flags = flags
        return self._flags


def _pinned_int32(n: int) -> np.ndarray:
    mem = cp.cuda.alloc_pinned_memory(max(n, 1) * 4)
    return np.frombuffer(mem, np.int32, n)


def copy_to_pinned(a: Any) -> np.ndarray:
    """``a`` copied into new page-locked host memory on the current stream, without waiting (read it after an
    event recorded later on the stream has completed)."""
    mem = cp.cuda.alloc_pinned_memory(max(a.nbytes, 1))
    host = np.frombuffer(mem, a.dtype, a.size).reshape(a.shape)
    a.get(out=host, blocking=False)
    return host
