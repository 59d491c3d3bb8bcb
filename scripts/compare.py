"""The fused vs naive report of a comparison sweep, kept for ``python scripts/compare.py SWEEP_DIR``.

The report is :mod:`mlptrain.compare`; what a wheel user runs is ``python -m mlptrain.compare``.
Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import sys

from mlptrain.tools.compare import main

if __name__ == "__main__":
    sys.exit(main())
