"""``python -m mlptrain.compare SWEEP_DIR [--out DIR]`` or ``--index DIR``: see :mod:`mlptrain.compare`."""

import sys

from mlptrain.tools.compare.cli import main

sys.exit(main())
