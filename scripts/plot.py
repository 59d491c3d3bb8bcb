"""Curves of a run or a sweep: ``python scripts/plot.py RUN_OR_SWEEP [--out FILE]`` (see :mod:`mlptrain.plot`).

From a wheel: ``python -m mlptrain.scripts.plot`` (scripts/ ships in it) or ``python -m mlptrain.plot``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

from mlptrain.plot import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
