"""The CPU data path (#31): a 600,000 x 256 float32 NPZ loaded by mlptrain, first and cached, against NumPy.

``python scripts/bench_load.py [--rows N] [--cols F] [--repeats R] [--quick] [--file PATH] [--pythonpath DIR]``
is ``python -m mlptrain.tools.bench.data_load ...`` (:mod:`mlptrain.tools.bench.data_load`, whose docstring says
what is timed). Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the
repository's root.
"""

from __future__ import annotations

import sys

from mlptrain.tools.bench.data_load import main

if __name__ == "__main__":
    sys.exit(main())
