"""Curves of a run or a sweep: ``python scripts/plot.py RUN_OR_SWEEP [--out FILE]`` (see :mod:`mlptrain.plot`).

From a wheel: ``python -m mlptrain.plot``. Run with mlptrain installed (``make install``) or with
``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import sys

from mlptrain.cli.plot import main

if __name__ == "__main__":
    sys.exit(main())
