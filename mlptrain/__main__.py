"""``python -m mlptrain``: the Hydra command line of :mod:`mlptrain.cli`."""

import os
import signal


def _stop(signum: int, frame: object) -> None:
    """Ctrl-C or SIGTERM while Python imports Hydra and mlptrain: nothing has been written, so stop at
    once, with one line and the status a shell expects (as :func:`mlptrain.cli._exit_now` later)."""
    os.write(2, f"error: stopped by {signal.Signals(signum).name} before training; nothing was written\n".encode())
    os._exit(128 + signum)


for _sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_sig, _stop)

from mlptrain.cli import main  # noqa: E402

main()
