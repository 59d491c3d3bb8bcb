"""mlptrain: MLP training on cuBLASLt fused matmul epilogs (nvmath-python), with a NumPy CPU engine.

``mlptrain.train(cfg, out_dir)`` runs a training run (:mod:`mlptrain.run.run`); ``mlptrain.Trainer``
is its step (:mod:`mlptrain.step.trainer`). ``mlptrain.predict(ckpt, x)`` scores raw inputs with a
checkpoint and ``mlptrain.Predictor`` keeps one loaded (:mod:`mlptrain.inference.predictor`).

Importing mlptrain never needs a GPU: CuPy and nvmath are imported only when a GPU is used
(:mod:`mlptrain.base.backend` and the ``cuda/`` folders).
"""

import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``train``, ``Trainer``, ``predict``, ``Predictor``: imported on first use (the CLI's --help needs none)."""
    if name == "train":
        from mlptrain.run.run import train

        return train
    if name == "Trainer":
        from mlptrain.step.trainer import Trainer

        return Trainer
    if name == "predict":  # the module mlptrain.predict, which is callable: mlptrain.predict(ckpt, x)
        import importlib

        return importlib.import_module("mlptrain.predict")
    if name == "Predictor":
        from mlptrain.inference.predictor import Predictor

        return Predictor
    raise AttributeError(f"module 'mlptrain' has no attribute {name!r}")


# ``python -m mlptrain.predict`` (and ``mlptrain.predict`` itself): the commands live under cli/ and tools/;
# these names are aliases of those modules (the same module objects, a submodule's name included).
_ALIASES = {
    "mlptrain.predict": "mlptrain.cli.predict",
    "mlptrain.evaluate": "mlptrain.cli.evaluate",
    "mlptrain.export": "mlptrain.cli.export",
    "mlptrain.plot": "mlptrain.cli.plot",
    "mlptrain.compare": "mlptrain.tools.compare",
    "mlptrain.bench": "mlptrain.tools.bench",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``mlptrain.<command>[.x]`` as the module it aliases; runpy runs the aliased module's code."""

    def __init__(self, target: str) -> None:
        self.target = target

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        for old, new in _ALIASES.items():
            if name == old or name.startswith(old + "."):
                real = importlib.util.find_spec(new + name[len(old) :])
                if real is None:
                    return None
                package = real.submodule_search_locations is not None
                return importlib.util.spec_from_loader(name, _Alias(real.name), origin=real.origin, is_package=package)
        return None

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self.spec  # the module keeps its own spec; the import system set the alias's

    def get_code(self, name: str) -> Any:  # python -m mlptrain.<command>: runpy runs this code as __main__
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)  # type: ignore[union-attr]


sys.meta_path.insert(0, _Alias(""))
