"""mlptrain: MLP training on cuBLASLt fused matmul epilogs (nvmath-python), with a NumPy CPU engine.

``mlptrain.train(cfg, out_dir)`` runs a training run (:mod:`mlptrain.run.run`); ``mlptrain.Trainer``
is its step (:mod:`mlptrain.step.trainer`). ``mlptrain.predict(ckpt, x)`` scores raw inputs with a
checkpoint and ``mlptrain.Predictor`` keeps one loaded (:mod:`mlptrain.inference.predictor`).

Importing mlptrain never needs a GPU: CuPy and nvmath are imported only when a GPU is used
(:mod:`mlptrain.base.backend` and the ``cuda/`` folders).
"""

import importlib.abc
import importlib.util
import inspect
import sys
from typing import Any

__version__ = "0.1.0"


def predict(ckpt: Any, x: Any, **options: Any) -> Any:
    """Score raw rows ``x (N, F)`` with checkpoint ``ckpt``: :func:`mlptrain.inference.predictor.predict`
    (class ids ``(N,)``; ``probabilities=True``: ``(N, C)``; a regression's outputs ``(N, T)``)."""
    from mlptrain.inference.predictor import predict as score

    return score(ckpt, x, **options)


def __getattr__(name: str) -> Any:
    """``train``, ``Trainer``, ``Predictor``: imported on first use (the CLI's --help needs none)."""
    if name == "train":
        from mlptrain.run.run import train

        return train
    if name == "Trainer":
        from mlptrain.step.trainer import Trainer

        return Trainer
    if name == "Predictor":
        from mlptrain.inference.predictor import Predictor

        return Predictor
    raise AttributeError(f"module 'mlptrain' has no attribute {name!r}")


# ``python -m mlptrain.predict``: the commands live under cli/ and tools/; these names are aliases of those
# modules (the same module objects, a submodule's name included). ``mlptrain.predict`` is the function above,
# so its name is an alias only for ``python -m`` (runpy): importing it as a module would replace the function.
_RUN_ONLY = {"mlptrain.predict"}
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
        if name in _RUN_ONLY and not _asked_by_runpy():
            return None
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


def _asked_by_runpy() -> bool:
    """Whether the module being looked for is ``python -m``'s: runpy's ``_get_module_details`` asks for its spec
    (through ``importlib.util.find_spec``) a few frames up, not an import statement (``python -m pytest``, for
    one, has runpy further down the stack of every import)."""
    frame = inspect.currentframe()
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code.co_name == "_get_module_details" and frame.f_globals.get("__name__") == "runpy":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


sys.meta_path.insert(0, _Alias(""))
