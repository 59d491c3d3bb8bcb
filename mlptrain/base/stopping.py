"""The stop a run can be asked for between two steps: :class:`Stop`, what the loop asks of it, and
:class:`StopRequest`, SIGINT and SIGTERM in one process.

The first SIGINT or SIGTERM asks the run to stop after the current step (it saves ``last`` and raises
:class:`~mlptrain.base.errors.TrainingInterrupted`); a second one raises :class:`~mlptrain.base.errors.Interrupted`
at once. Data parallel, :class:`mlptrain.distributed.control.AgreedStop` is the :class:`Stop` of a rank:
every rank stops after the same step, and a watchdog hears of the progress the loop makes.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from mlptrain.base.errors import Interrupted


@runtime_checkable
class Stop(Protocol):
    """What the run and the loop ask of a stop request (:class:`StopRequest`; data parallel,
    :class:`~mlptrain.distributed.control.AgreedStop`)."""

    @property
    def requested(self) -> bool:
        """Whether to stop after this step (saving ``last`` first)."""
        ...

    @property
    def signum(self) -> int:
        """The signal that asked, for the exit status and the message."""
        ...

    def defer(self) -> None:
        """The run is accepted: from now on a first signal asks for a stop instead of raising at once."""
        ...

    def beat(self) -> None:
        """Progress that is not a log interval (building the trainer, evaluating, saving)."""
        ...

    def agree(self) -> bool:
        """At a log interval's host sync: settle ``requested`` (data parallel: with every rank); returns it."""
        ...


class StopRequest:
    """SIGINT and SIGTERM during a run. SIGTERM is what job schedulers and ``docker stop`` send
    before they kill. Installed in the main thread only; restored on exit.

    Until :meth:`defer` (before the run is accepted, when nothing has been written) a signal raises
    :class:`Interrupted` at once (and :meth:`defer` raises it again, should it have been swallowed).
    From then on the first one only sets ``requested``: the loop saves ``last`` and stops after the
    current step; a second raises :class:`Interrupted` at once. The handler itself only sets a flag
    or raises: printing from a signal handler can re-enter a stream.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self.deferred = False
        self.signum = int(signal.SIGINT)  # the signal that asked to stop
        self.early: int | None = None  # a signal before defer(): raised at once, and again at defer()
        self._previous: dict[int, Any] = {}

    def defer(self) -> None:
        """From now on a first signal asks the run to stop at the next step, after saving ``last``.

        A signal that came before and whose :class:`Interrupted` was swallowed on its way (it can land inside a
        log call, whose handler catches what a ``finally`` raised after it: tqdm's logging redirect does) stops
        the run here, still before anything was written."""
        if self.early is not None:
            raise Interrupted(
                f"stopped by {signal.Signals(self.early).name} before training started; nothing was written", self.early
            )
        self.deferred = True

    def beat(self) -> None:
        """Progress outside a log interval: nothing to tell in one process (no watchdog waits on it)."""

    def agree(self) -> bool:
        """One process agrees with itself: ``requested`` as it stands."""
        return self.requested

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, previous in self._previous.items():
            if previous is None:  # installed from outside Python
                previous = signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL
            signal.signal(s, previous)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if not self.deferred:
            self.early = signum  # the exception below may be swallowed (a log handler): defer() raises it again
            raise Interrupted(f"stopped by {name} before training started; nothing was written", signum)
        if self.requested:
            raise Interrupted(f"stopped at once by a second {name}", signum)
        self.requested = True
        self.signum = signum


@contextlib.contextmanager
def after_the_block() -> Iterator[None]:
    """SIGINT and SIGTERM that come during the block reach their handlers after it, each one (a second
    Ctrl-C stays a second). For code that would swallow what a handler raises in it: tqdm's console log
    handler catches what its lock's ``finally`` raises after an interrupt, and logging prints
    "--- Logging error ---" with a traceback instead of stopping. The main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in StopRequest.SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for signum in caught:
            signal.raise_signal(signum)
