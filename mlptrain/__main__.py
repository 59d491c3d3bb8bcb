"""``python -m mlptrain``: the Hydra command line of :mod:`mlptrain.cli`."""

from mlptrain.cli import main

main()
