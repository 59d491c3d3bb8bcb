"""``python -m mlptrain``: the Hydra command line of :mod:`mlptrain.cli`."""

import os
import signal

# Ctrl-C or SIGTERM while Python imports Hydra and mlptrain: nothing has been written, so stop at once
# with the status a shell expects (mlptrain.cli.main then says so in a line of its own).
for _sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_sig, lambda signum, frame: os._exit(128 + signum))

from mlptrain.cli import main  # noqa: E402

main()
