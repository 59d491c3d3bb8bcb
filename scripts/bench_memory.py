"""One trial of ``scripts/bench.py`` section l (the widest model that trains), run by hand.

``python scripts/bench_memory.py --trial mlptrain --width 40960 --compute-copy cast`` is
``python -m mlptrain.tools.bench.largest_model ...`` (:mod:`mlptrain.tools.bench.largest_model`; section m is
:mod:`mlptrain.tools.bench.memory_vs_torch`). Run with mlptrain installed (``make install``) or with
``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import sys

from mlptrain.tools.bench.largest_model import main

if __name__ == "__main__":
    sys.exit(main())
