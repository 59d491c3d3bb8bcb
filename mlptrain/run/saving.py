"""Checkpoints written on a thread of their own while training goes on (:class:`Writer`).

Writing a checkpoint (:func:`mlptrain.run.checkpoint.save`: SHA-256, zip, fsync, rename) took 48 ms a
save for a 1.3 M-parameter model on the H200 host, twice an epoch (``best`` and ``last``), in a run
whose epochs took 0.1 s of steps; the steps need not wait for it.

One write at a time: a save waits for the one before to be on disk. So the memory held is one
checkpoint's host copies at most (a queue of them grew to 797 MB for a 2048-2048 Adam model with
``checkpoint_steps=1``), and a run killed at any moment has on disk the checkpoint before the one
being written: it loses at most ``2 × checkpoint_steps`` steps (docs/reliability.md, promise 3).
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.run import checkpoint


class Writer:
    """Checkpoints written by :func:`mlptrain.run.checkpoint.save` on a thread, in order, while training goes on.

    A checkpoint's host copies are taken before :meth:`submit` (the caller's ``state_dict()``: the
    state at that moment, which later steps do not touch); :meth:`submit` first waits for the write
    before it (at most one write is pending); the SHA-256, the zip and the fsync happen on the thread
    (hashlib, zlib and file writes release the GIL). A write that failed raises its
    :class:`~mlptrain.base.errors.CheckpointError` at the next :meth:`submit` or :meth:`wait`, before
    anything else is written, so the checkpoint before it stays the last one on disk. :meth:`wait`
    before reading a checkpoint back, before reporting one as saved, and at the end of the run.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._failed: BaseException | None = None  # the first write that failed; nothing is written after it

    def submit(self, path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Write ``save(path, arrays, meta)`` on the thread (``meta`` copied now) once the write before it is
        done; raise an earlier write's error first."""
        self.wait()  # one write at a time: bounded memory, and the one before is on disk (or its error raised)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mlptrain-checkpoint")
        self._pending.append(self._pool.submit(self._write, Path(path), arrays, copy.deepcopy(meta)))

    @property
    def pending(self) -> int:
        """The writes submitted and not yet waited for (0 or 1)."""
        return len(self._pending)

    def wait(self) -> None:
        """Wait for the pending write; raise the first failed one's error."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.exception()  # waits (the error itself is kept in _failed)
        self._raise_failed()

    def _write(self, path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        if self._failed is not None:  # queued after a write that failed: the one before stays the last on disk
            return
        try:
            checkpoint.save(path, arrays, meta)
        except BaseException as exc:
            self._failed = exc
            raise

    def _raise_failed(self) -> None:
        if self._failed is not None:
            exc, self._failed = self._failed, None
            self._pending = []
            raise exc

    def close(self) -> None:
        """Wait for the writes (errors raised), then stop the thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
