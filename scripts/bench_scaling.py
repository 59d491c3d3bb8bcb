"""What each ``data.normalize`` mode costs on the CPU (#49): statistics, a normalising pass, a streamed batch.

``python scripts/bench_scaling.py [--rows N] [--cols F] [--batch B] [--repeats R]`` is
:mod:`mlptrain.tools.bench.scaling_timing` (its docstring says what is timed). Run with ``PYTHONPATH=.`` at the
repository's root, or with mlptrain installed.
"""

from __future__ import annotations

import sys

from mlptrain.tools.bench.scaling_timing import main

if __name__ == "__main__":
    sys.exit(main())
