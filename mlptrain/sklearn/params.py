"""The estimators' parameters: scikit-learn's MLP names checked, then turned into a :class:`TrainConfig`.

scikit-learn validates parameters in ``fit``, never in ``__init__`` (``clone`` and ``set_params``
must be able to store anything), so :func:`train_config` is called by ``fit``. Each parameter maps
to one setting of the CLI; where scikit-learn's meaning cannot be kept exactly the value is
refused, or the difference is written here and in docs/sklearn.md:

==================== ====================================== ==========================================
scikit-learn         mlptrain (``python -m mlptrain ...``)  note
==================== ====================================== ==========================================
hidden_layer_sizes   ``model.hidden``
activation           ``model.activation``                   ``identity`` is ``none``; ``gelu`` is
                                                            mlptrain's own; ``tanh``, ``logistic``
                                                            refused (no cuBLASLt epilog)
solver               ``optimizer=sgd|adam``                 ``lbfgs`` refused (not stochastic)
alpha                ``optimizer.weight_decay``             ``alpha / batch_size`` on every parameter
                                                            (scikit-learn: weights only); with
                                                            ``sample_weight``, over ``mean(w)`` too
batch_size           ``data.batch_size``                    ``auto``: ``min(200, n_samples)``
learning_rate        ``optimizer.schedule``                 ``constant``, or mlptrain's ``cosine``
learning_rate_init   ``optimizer.lr``
max_iter             ``epochs``
momentum, nesterovs  ``optimizer.momentum``, ``.nesterov``  exact (PyTorch's form, the same steps)
beta_1, beta_2       ``optimizer.beta1``, ``.beta2``
epsilon              ``optimizer.eps``                      PyTorch's Adam: ``eps`` after the bias
                                                            correction of ``sqrt(v)``
validation_fraction  ``data.val_fraction``                  only with ``early_stopping=True``
random_state         ``seed`` and ``data.split_seed``
categorical_features ``data.categorical``                   HistGradientBoosting's ``from_dtype``:
                                                            ``category``, text columns; plus a list
min_frequency        ``data.min_frequency``                 OneHotEncoder's, a count of rows
ensemble_size        ``ensemble.size``                      mlptrain's own: K networks trained as one
                                                            (seeds ``seed..seed+K-1``), their mean
                                                            predicts (docs/ensembles.md)
==================== ====================================== ==========================================
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from mlptrain.base.errors import ConfigError
from mlptrain.config.schema import NORMALIZATIONS, SCHEDULES, Device, Mode, Schedule, TrainConfig, values
from mlptrain.sklearn import frames
from mlptrain.step.memory import member_bytes
from mlptrain.step.precision import PRECISIONS

ACTIVATIONS = {"relu": "relu", "identity": "none", "gelu": "gelu"}
SOLVERS = ("sgd", "adam")
# Why scikit-learn values that mlptrain refuses are refused (said in the error).
WHY_NOT = {
    ("activation", "tanh"): " (mlptrain's cuBLASLt epilogs have relu and gelu, and identity without one)",
    ("activation", "logistic"): " (mlptrain's cuBLASLt epilogs have relu and gelu, and identity without one)",
    ("solver", "lbfgs"): " (L-BFGS is a full-batch solver; mlptrain trains in minibatches)",
    ("learning_rate", "invscaling"): " (scikit-learn's schedule of that name has no exact mlptrain equivalent)",
    ("learning_rate", "adaptive"): " (scikit-learn's schedule of that name has no exact mlptrain equivalent)",
}
# batch_size="auto" as scikit-learn's MLP: at most this many rows per step
AUTO_BATCH = 200


def hidden_sizes(owner: str, value: Any) -> list[int]:
    """``hidden_layer_sizes`` as a list of positive widths (an int is one layer, as in scikit-learn)."""
    sizes = [value] if isinstance(value, numbers.Integral) else value
    try:
        widths = [int(w) for w in sizes if isinstance(w, numbers.Integral)]
    except TypeError:
        widths = []
    if len(widths) != len(sizes) or not widths or min(widths) < 1:
        raise ConfigError(
            f"{owner} hidden_layer_sizes={value!r}; expected a positive integer or a non-empty tuple of them"
        )
    return widths


def batch_rows(owner: str, value: Any, rows: int) -> int:
    """Rows per step: ``auto`` is ``min(200, rows)``; an integer is clipped to ``[1, rows]`` as scikit-learn does."""
    if value == "auto":
        return min(AUTO_BATCH, rows)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{owner} batch_size={value!r}; expected 'auto' or a positive integer")
    return min(int(value), rows)


def _choice(owner: str, name: str, value: Any, allowed: Any, why: str = "") -> str:
    if value not in allowed:
        raise ConfigError(f"{owner} {name}={value!r}{why}; expected one of {', '.join(map(repr, allowed))}")
    return str(value)


def _number(owner: str, name: str, value: Any, low: float, high: float = np.inf, *, closed: bool = True) -> float:
    """A real ``value`` in ``[low, high)`` (``closed``) or ``(low, high)``."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and np.isfinite(float(value))
    ok = ok and (low <= value if closed else low < value) and value < high
    if not ok:
        where = f"{'[' if closed else '('}{low}, {high})"
        raise ConfigError(f"{owner} {name}={value!r}; expected a number in {where}")
    return float(value)


def _count(owner: str, name: str, value: Any) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{owner} {name}={value!r}; expected a positive integer")
    return int(value)


def check(owner: str, p: dict[str, Any]) -> None:
    """Raise ConfigError (a ValueError) for the first parameter of ``p`` (``get_params()``) out of range."""
    hidden_sizes(owner, p["hidden_layer_sizes"])
    for name, allowed in (("activation", tuple(ACTIVATIONS)), ("solver", SOLVERS), ("learning_rate", SCHEDULES)):
        _choice(owner, name, p[name], allowed, WHY_NOT.get((name, p[name]), ""))
    _choice(owner, "normalize", p["normalize"], NORMALIZATIONS)
    _choice(owner, "execution", p["execution"], values(Mode))
    _choice(owner, "precision", p["precision"], PRECISIONS.names())
    _choice(owner, "device", p["device"], values(Device))
    if p["graph"] not in (None, True, False):
        raise ConfigError(f"{owner} graph={p['graph']!r}; expected None (on, on a GPU), True or False")
    _number(owner, "alpha", p["alpha"], 0.0)
    _number(owner, "learning_rate_init", p["learning_rate_init"], 0.0, closed=False)
    _number(owner, "momentum", p["momentum"], 0.0, 1.0)
    _number(owner, "beta_1", p["beta_1"], 0.0, 1.0)
    _number(owner, "beta_2", p["beta_2"], 0.0, 1.0)
    _number(owner, "epsilon", p["epsilon"], 0.0, closed=False)
    _number(owner, "validation_fraction", p["validation_fraction"], 0.0, 1.0, closed=False)
    _number(owner, "tol", p["tol"], -np.inf)
    _count(owner, "max_iter", p["max_iter"])
    _count(owner, "n_iter_no_change", p["n_iter_no_change"])
    _count(owner, "ensemble_size", p["ensemble_size"])
    if p["batch_size"] != "auto":
        batch_rows(owner, p["batch_size"], 1)
    frames.check_params(owner, p)


def check_continuation(owner: str, how: str, p: dict[str, Any], fitted: Any) -> None:
    """Raise ConfigError when parameters ``p`` cannot continue the ``fitted`` checkpoint (``warm_start=True``
    or ``partial_fit``, said by ``how``): another network, solver, precision, or momentum state than it holds.

    The trainer would refuse these too, in the CLI's words (``model.hidden``, ``optimizer=``); this names
    the estimator's parameters."""
    meta = fitted.meta
    had_momentum = any(k.startswith("optim/") and k.endswith("/momentum") for k in fitted.arrays)
    pairs = [
        ("hidden_layer_sizes", tuple(meta["widths"][1:-1]), tuple(hidden_sizes(owner, p["hidden_layer_sizes"]))),
        ("solver", meta["optimizer"], p["solver"]),
        ("precision", meta["precision"], p["precision"]),
        ("ensemble_size", meta.get("members", 1), p["ensemble_size"]),
    ]
    if p["solver"] == "sgd" and meta["optimizer"] == "sgd" and had_momentum != (p["momentum"] > 0):
        pairs.append(("momentum", "a positive value" if had_momentum else 0, p["momentum"]))
    for name, was, now in pairs:
        if was != now:
            raise ConfigError(
                f"{owner} {how} continues a fit made with {name}={was!r}, but {name}={now!r} now; set "
                f"{name} back, or call fit with warm_start=False to fit a new model"
            )


def train_config(
    p: dict[str, Any], *, task: str, batch: int, seed: int, epochs: int, val_fraction: float
) -> TrainConfig:
    """The :class:`TrainConfig` the CLI would train with for parameters ``p`` (checked by :func:`check`).

    ``batch``: rows per step (:func:`batch_rows`); ``seed``: the weights', data order's and split's
    seed; ``epochs``: the run's length (a cosine schedule spans it); ``val_fraction``: the share of
    rows held out for early stopping (0 without it).
    """
    cfg = TrainConfig()
    cfg.device = Device(p["device"])
    cfg.seed = seed
    cfg.epochs = epochs
    cfg.graph = p["graph"]
    cfg.progress = False
    cfg.model.hidden = hidden_sizes("", p["hidden_layer_sizes"])
    cfg.model.activation = ACTIVATIONS[p["activation"]]
    cfg.model.loss = "cross_entropy" if task == "classification" else "mse"
    d = cfg.data
    d.name, d.batch_size, d.split_seed, d.val_fraction = type(d.name)("file"), batch, seed, val_fraction
    d.normalize = type(d.normalize)(p["normalize"])
    d.task = type(d.task)(task)
    d.min_frequency = int(p["min_frequency"])
    asked = p["categorical_features"]
    d.categorical = [] if isinstance(asked, str) else [c for c in asked if isinstance(c, str)]  # names: the CLI's
    o = cfg.optimizer
    o.name = p["solver"]
    o.lr = float(p["learning_rate_init"])
    o.schedule = Schedule(p["learning_rate"])
    o.weight_decay = float(p["alpha"]) / batch  # scikit-learn's penalty alpha/2 ||W||^2 is summed, then / batch rows
    if p["solver"] == "sgd":  # Nesterov without momentum is plain SGD (mlptrain refuses the pair)
        o.momentum, o.nesterov = float(p["momentum"]), bool(p["nesterovs_momentum"]) and p["momentum"] > 0
    o.beta1, o.beta2, o.eps = float(p["beta_1"]), float(p["beta_2"]), float(p["epsilon"])
    cfg.execution.mode = Mode(p["execution"])
    cfg.precision.name = p["precision"]
    cfg.ensemble.size = int(p["ensemble_size"])
    return cfg


def member_host_bytes(p: dict[str, Any], widths: list[int], batch: int, rows: int = 0) -> int:
    """A lower bound on the memory one member of a batched fit takes, for parameters ``p`` (checked): its network's
    parameters, gradients and optimizer state and what its step keeps for the backward at ``batch`` rows
    (:func:`mlptrain.step.memory.member_bytes`), in the parameters' dtype, and (cross-validation: each member a fold)
    its ``rows`` training rows of ``widths[0]`` columns held twice in float32 (the fold's fit's split, and the batched
    run's stack of them all)."""
    dtype = np.float64 if p["precision"] == "fp64" else np.float32
    states = 2 if p["solver"] == "adam" else int(p["momentum"] > 0)
    net = member_bytes(widths, batch, dtype, dtype, states, ACTIVATIONS[p["activation"]], p["execution"])
    return sum(net.values()) + rows * widths[0] * (4 + 4)
