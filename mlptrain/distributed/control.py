"""Keeping the ranks of a data-parallel run in step outside the training step: stop requests and hangs.

Every collective (the step's all-reduce, evaluation's sums) must be entered by every rank, so every
decision that changes which collectives run next must be the same on every rank. Most already are:
step counts, epochs and evaluation results are the same numbers everywhere. A stop request is not: a
signal may reach one rank, or reach them at different steps. :class:`AgreedStop` therefore agrees on
it at the log interval's host sync (one all-reduce of one flag), so that every rank stops after the
same step, and rank 0 saves ``last`` there.

A rank that dies or hangs leaves the others waiting inside NCCL, where no Python runs. The
:class:`Watchdog` thread of each rank notices that the loop has made no progress for
``distributed.timeout_s``, aborts the rank's NCCL communicator (which ends the waiting kernels) and
exits the process with a clear error: never a silent hang. The launcher of ``distributed.gpus``
then stops the other ranks (:mod:`mlptrain.cli.launcher`); torchrun and mpirun do the same.
"""

from __future__ import annotations

import faulthandler
import hashlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

from mlptrain.base.stopping import Stop
from mlptrain.distributed.comm import Communicator

log = logging.getLogger(__name__)

EXIT_HUNG = 3  # the exit status of a rank that its watchdog stopped


class AgreedStop:
    """A rank's :class:`~mlptrain.base.stopping.Stop`: this process's stop request (``inner``,
    a :class:`~mlptrain.base.stopping.StopRequest`) whose ``requested`` changes only when every rank agrees.

    :meth:`agree` (at each log interval's sync) all-reduces this rank's flag: when any rank was asked
    to stop, every rank sees ``requested`` from then on. It also beats the watchdog's heart.
    """

    def __init__(self, inner: Stop, comm: Communicator, watchdog: Watchdog | None = None) -> None:
        self.inner, self.comm, self.watchdog = inner, comm, watchdog
        self._agreed = False
        # the launcher of distributed.gpus passes its Ctrl-C on as a shared integer (the signal's number)
        self.launcher = getattr(comm, "stop_signal", None)

    def _asked(self) -> bool:
        return bool(self.inner.requested or (self.launcher is not None and self.launcher.value))

    @property
    def requested(self) -> bool:
        return self._agreed

    @property
    def signum(self) -> int:
        """The signal this rank (or its launcher) got; SIGTERM for a rank that stops because another was asked to."""
        if self.inner.requested:
            return self.inner.signum
        return int(self.launcher.value) if self.launcher is not None and self.launcher.value else int(signal.SIGTERM)

    def defer(self) -> None:
        self.inner.defer()

    def beat(self) -> None:
        """Progress that is not a log interval (building the trainer, evaluating, saving)."""
        if self.watchdog is not None:
            self.watchdog.beat()

    def agree(self) -> bool:
        flag = np.array([1.0 if self._asked() else 0.0])
        self.comm.all_reduce([flag])  # a host array: synchronises, at a point that already does
        self._agreed = self._agreed or bool(flag[0] > 0)
        if self.watchdog is not None:
            self.watchdog.beat()
        return self._agreed


class Watchdog:
    """Exit the process when :meth:`beat` has not been called for ``timeout`` seconds.

    Args:
        timeout: seconds without progress before this rank gives up.
        rank: for the message.
        on_timeout: called first (abort NCCL: the waiting kernels end); errors in it are ignored.
        exit: how to leave (default ``os._exit``: the main thread may be stuck in a CUDA call
            that no exception can interrupt).
    """

    def __init__(self, timeout: float, rank: int, on_timeout: Any = None, exit: Any = os._exit) -> None:
        self.timeout, self.rank = timeout, rank
        self.on_timeout, self._exit = on_timeout, exit
        self._last = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"mlptrain-watchdog-{rank}", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def beat(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.timeout / 4)):
            idle = time.monotonic() - self._last
            if idle < self.timeout:
                continue
            message = (
                f"error: rank {self.rank}: no progress for {idle:.0f} s (distributed.timeout_s={self.timeout:g}); "
                "another rank died or hung; stopping this rank"
            )
            print(message, file=sys.stderr, flush=True)
            log.error(message)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)  # where it waited
            try:
                if self.on_timeout is not None:
                    self.on_timeout()
            except Exception as exc:  # the exit must happen whatever the abort does
                log.error("rank %d: NCCL abort failed (%s)", self.rank, exc)
            self._exit(EXIT_HUNG)
            return


def check_replicas(comm: Communicator, arrays: dict[str, np.ndarray], step: int) -> None:
    """Raise if the ranks' ``arrays`` (the parameters, as host arrays by name) differ in any bit.

    Each rank hashes its bytes; the 64-bit digest goes through the all-reduce as four 16-bit float64
    parts and their squares: every rank holds the same digest exactly when, for each part,
    ``world x sum(d^2) == sum(d)^2`` (the variance over the ranks is zero).
    """
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(arrays):
        h.update(np.ascontiguousarray(arrays[name]).tobytes())
    d = int.from_bytes(h.digest(), "little")
    parts = np.array([(d >> s) & 0xFFFF for s in (0, 16, 32, 48)], dtype=np.float64)  # exact in float64,
    sums = np.concatenate([parts, parts**2])  # and so are world x (2^16)^2 and (world x 2^16)^2 for any world < 2^10
    comm.all_reduce([sums])
    if any(sums[4 + i] * comm.world != sums[i] ** 2 for i in range(4)):
        from mlptrain.base.errors import MlptrainError

        raise MlptrainError(f"rank {comm.rank}: after step {step} the parameters differ between the ranks")
