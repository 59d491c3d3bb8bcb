"""Work done ahead on a host thread, into a ring of slots: the host half of a host-resident loader.

A host-resident split (:class:`mlptrain.data.host_loader.HostLoader`, ``data.residency=host``) gives each
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

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

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
