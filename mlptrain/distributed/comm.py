"""Communicators: what a data-parallel step needs from the transport between ranks.

:class:`Communicator` is the interface (NCCL's all-reduce has this shape). :class:`LocalGroup` runs
``world`` ranks as threads of one process: each rank calls :meth:`LocalComm.all_reduce` with its
arrays, and every rank gets the same sum, added in rank order, so every rank holds the same bytes.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np


class Communicator(Protocol):
    """A rank's view of its group."""

    rank: int
    world: int

    def all_reduce(self, arrays: list[Any], stream: Any = None) -> None:
        """Replace each array, in place, by its sum over the ranks; every rank gets the same bytes
        (``stream``: a GPU stream to run on, joined back; the CPU ignores it)."""
        ...


class LocalGroup:
    """``world`` in-process ranks (threads) that all-reduce NumPy arrays through shared memory.

    Args:
        world: number of ranks.
        timeout: seconds a rank waits for the others before :class:`threading.BrokenBarrierError`
            (a rank that died or hung makes the others fail, not hang).
    """

    def __init__(self, world: int, timeout: float = 60.0) -> None:
        if world < 1:
            raise ValueError(f"a group needs at least one rank; got world={world}")
        self.world = world
        self._barrier = threading.Barrier(world, timeout=timeout)
        self._slots: list[list[np.ndarray] | None] = [None] * world

    def communicator(self, rank: int) -> LocalComm:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not in a group of {self.world}")
        return LocalComm(self, rank)


class LocalComm:
    """Rank ``rank`` of a :class:`LocalGroup`."""

    def __init__(self, group: LocalGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world = group.world

    def all_reduce(self, arrays: list[Any], stream: Any = None) -> None:
        g = self.group
        g._slots[self.rank] = [np.array(a, copy=True) for a in arrays]  # this rank's contribution
        g._barrier.wait()  # every rank has deposited
        for j, a in enumerate(arrays):
            total = g._slots[0][j].copy()  # type: ignore[index]
            for r in range(1, self.world):
                total += g._slots[r][j]  # type: ignore[index]  # rank order: the same bytes everywhere
            a[...] = total
        g._barrier.wait()  # every rank has read: the slots may be reused
