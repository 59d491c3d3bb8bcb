"""Checkpoints written on a thread of their own while training goes on (:class:`Writer`).

Writing a checkpoint (:func:`mlptrain.checkpoint.save`: SHA-256, zip, fsync, rename) took 48 ms a
save for a 1.3 M-parameter model on the H200 host, twice an epoch (``best`` and ``last``), in a run
whose epochs took 0.1 s of steps; the steps need not wait for it.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain import checkpoint


class Writer:
    """Checkpoints written by :func:`mlptrain.checkpoint.save` on a thread, in order, while training goes on.

    A checkpoint's host copies are taken before :meth:`submit` (the caller's ``state_dict()``: the
    state at that moment, which later steps do not touch); the SHA-256, the zip and the fsync happen
    on the thread (hashlib, zlib and file writes release the GIL). A write that failed raises its
    :class:`~mlptrain.errors.CheckpointError` at the next :meth:`submit` or :meth:`wait`, before
    anything else is written, so the checkpoint before it stays the last one on disk. :meth:`wait`
    before reading a checkpoint back, before reporting one as saved, and at the end of the run.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._failed: BaseException | None = None  # the first write that failed; nothing is written after it

    def submit(self, path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Queue ``save(path, arrays, meta)`` (``meta`` copied now); raise an earlier write's error first."""
        self._raise_failed()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mlptrain-checkpoint")
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._pool.submit(self._write, Path(path), arrays, copy.deepcopy(meta)))

    def wait(self) -> None:
        """Wait for every queued write; raise the first failed one's error."""
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
