"""``python -m mlptrain``: the Hydra command line of :mod:`mlptrain.cli.main`."""

import os
import signal
import sys

from mlptrain.base import timeline as _timeline

_timeline.PROCESS.mark("python")  # the interpreter's start-up, until this line (mlptrain.base.timeline)


# python -m mlptrain predict|evaluate|export|plot|compare|bench ...: as python -m mlptrain.<command> runs it
if len(sys.argv) > 1 and sys.argv[1] in ("predict", "evaluate", "export", "plot", "compare", "bench"):
    import runpy

    runpy.run_module(f"mlptrain.{sys.argv.pop(1)}", run_name="__main__", alter_sys=True)
    sys.exit(0)


def _stop(signum: int, frame: object) -> None:
    """Ctrl-C or SIGTERM while Python imports Hydra and mlptrain: nothing has been written, so stop at
    once, with one line and the status a shell expects (as :func:`mlptrain.cli.main._exit_now` later)."""
    os.write(2, f"error: stopped by {signal.Signals(signum).name} before training; nothing was written\n".encode())
    os._exit(128 + signum)


for _sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_sig, _stop)

# What each dependency of the command line is installed as.
_DISTRIBUTIONS = {"hydra": "hydra-core", "yaml": "pyyaml", "omegaconf": "omegaconf", "numpy": "numpy", "tqdm": "tqdm"}

try:
    from mlptrain.cli.main import main
except ModuleNotFoundError as exc:  # a Python without mlptrain's dependencies: the .venv was not activated
    missing = (exc.name or "").split(".")[0]
    if missing == "mlptrain" or not missing:
        raise
    print(
        f"error: mlptrain needs {_DISTRIBUTIONS.get(missing, missing)}, which {sys.executable} does not have "
        f"(No module named {missing!r}); activate the environment that make run created (source .venv/bin/activate) "
        "or install mlptrain into this one (pip install -e .)",
        file=sys.stderr,
    )
    sys.exit(2)

main()
