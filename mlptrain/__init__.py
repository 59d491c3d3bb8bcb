"""mlptrain: MLP training on cuBLASLt fused matmul epilogs (nvmath-python), with a NumPy CPU engine.

``mlptrain.train(cfg, out_dir)`` runs a training run (:mod:`mlptrain.run`); ``mlptrain.Trainer``
is its step (:mod:`mlptrain.trainer`). ``mlptrain.predict(ckpt, x)`` scores raw inputs with a
checkpoint and ``mlptrain.Predictor`` keeps one loaded (:mod:`mlptrain.inference`).

Importing mlptrain never needs a GPU: CuPy and nvmath are imported only when a GPU is used
(:mod:`mlptrain.backend`, :mod:`mlptrain.gpu`).
"""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``train``, ``Trainer``, ``predict``, ``Predictor``: imported on first use (the CLI's --help needs none)."""
    if name == "train":
        from mlptrain.run import train

        return train
    if name == "Trainer":
        from mlptrain.trainer import Trainer

        return Trainer
    if name == "predict":  # the module mlptrain.predict, which is callable: mlptrain.predict(ckpt, x)
        import importlib

        return importlib.import_module("mlptrain.predict")
    if name == "Predictor":
        from mlptrain.inference import Predictor

        return Predictor
    raise AttributeError(f"module 'mlptrain' has no attribute {name!r}")
