"""The run's log around its training: what is said before ``mlptrain.log`` exists, and console lines that a
signal must not cut.

A run reads and checks its data before it is accepted, and only an accepted run writes into its folder:
the warnings of that time (``data.missing=drop``'s dropped rows) are kept by :class:`EarlyWarnings` and
written into ``mlptrain.log`` first when it is opened. tqdm's logging handler swallows an exception raised
inside it, so a Ctrl-C that lands while it writes a line would be lost (printed as "--- Logging error ---"):
:func:`hold_signals_in_log_lines` makes the stop wait until the line is written.
"""

from __future__ import annotations

import logging
from typing import Any


class EarlyWarnings(logging.Handler):
    """The warnings logged before the run is accepted (the data's, read before anything is written: ``data.missing=
    drop``'s rows), kept until ``mlptrain.log`` is opened and then written into it (:meth:`replay`)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] | None = []  # None: replayed, nothing more is kept

    def emit(self, record: logging.LogRecord) -> None:
        if self.records is not None:
            self.records.append(record)

    def replay(self, handler: logging.Handler) -> None:
        for record in self.records or []:
            handler.handle(record)
        self.records = None


def hold_signals_in_log_lines() -> None:
    """Ctrl-C or SIGTERM during a console log line reaches the run once the line is written
    (:func:`mlptrain.base.stopping.after_the_block`: tqdm's handler would swallow the stop, with a traceback)."""
    from mlptrain.base.stopping import after_the_block

    for handler in logging.getLogger().handlers:
        if type(handler).__module__ == "tqdm.contrib.logging":

            def held(record: logging.LogRecord, emit: Any = handler.emit) -> None:
                with after_the_block():
                    emit(record)

            handler.emit = held  # type: ignore[method-assign]
