"""``python -m mlptrain.bench``: the benchmark of :mod:`mlptrain.bench.cli` (what ``scripts/bench.py`` runs)."""

import sys

from mlptrain.bench.cli import main

sys.exit(main())
