"""``python -m mlptrain.bench``: the benchmark of :mod:`mlptrain.tools.bench.suite` (what ``scripts/bench.py`` runs)."""

import sys

from mlptrain.tools.bench.suite import main

sys.exit(main())
