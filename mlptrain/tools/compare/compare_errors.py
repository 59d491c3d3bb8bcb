"""The one error of ``python -m mlptrain.compare``."""


class CompareError(Exception):
    """A run is missing, incomplete or not comparable; the message names the run directory."""
