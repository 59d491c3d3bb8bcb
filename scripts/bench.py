"""Benchmark mlptrain's fused epilogs against the naive path, the GEMMs alone, and PyTorch.

The benchmark is :mod:`mlptrain.tools.bench.suite` (its docstring lists the sections); this file runs it:
``python scripts/bench.py [--out DIR] [--sections abcml] [--reps N] [--quick] ...``, the same as
``python -m mlptrain.bench``. Run with mlptrain installed (``make install``) or with
``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import sys

from mlptrain.tools.bench.suite import main

if __name__ == "__main__":
    sys.exit(main())
