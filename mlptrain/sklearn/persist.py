"""A fitted estimator's state: an mlptrain checkpoint, in memory until ``save`` writes it.

The state is what :meth:`mlptrain.run.loop.Loop.save` would write at the end of the same run (the
trainer's :meth:`~mlptrain.step.trainer.Trainer.state_dict`: parameters, optimizer state, the train
split's normalisation, names), plus, in ``meta["config"]["sklearn"]``, the estimator's parameters
and fitted attributes, so that :func:`load` gives back the estimator and the CLI's tools read the file
as any run's checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.base.errors import CheckpointError
from mlptrain.base.fs import remove_stale_temps
from mlptrain.config.schema import to_plain
from mlptrain.data.dataset import Normalization
from mlptrain.inference.outputs import is_checkpoint
from mlptrain.inference.predictor import Predictor
from mlptrain.run import checkpoint
from mlptrain.run.checkpoint import Checkpoint, Position
from mlptrain.step.trainer import Trainer

IN_MEMORY = Path("<in memory>")


def state(tr: Trainer, epochs: int, fitted: dict[str, Any]) -> Checkpoint:
    """The checkpoint of ``tr`` after ``epochs`` epochs (syncs the device), with the estimator's ``fitted``."""
    arrays, meta = tr.state_dict()
    return assemble(arrays, meta, tr.cfg, tr.step_count, tr.steps_per_epoch, fitted)


def assemble(
    arrays: dict[str, np.ndarray], meta: dict[str, Any], cfg: Any, step: int, spe: int, fitted: dict[str, Any]
) -> Checkpoint:
    """A trainer's state (``arrays``, ``meta``: one model's, of config ``cfg``) after ``step`` steps of ``spe`` per
    epoch, as a fitted estimator's checkpoint (cross-validation assembles each fold's from its member's slices)."""
    # a continued fit may have changed the batches per epoch: the position is the one these say
    meta.update(position=Position(step // spe, step % spe, step).__dict__, metrics_records=0, best=None)
    meta["config"] = {**to_plain(cfg), "sklearn": json.loads(json.dumps(fitted, default=_plain))}
    return Checkpoint(IN_MEMORY, arrays, meta)


def target_columns(y: Any) -> list[str] | None:
    """The names of ``y``'s target columns, as ``evaluate`` finds them in a file: a pandas Series' name, a
    DataFrame's columns; None for unnamed targets (an array, a Series without a name).

    The checkpoint keeps them where a CLI run's keeps its target columns: ``config.data.target`` (a name, or
    a list of them) and, for a regression, ``data.target_names``."""
    columns = getattr(y, "columns", None)
    if columns is not None:
        return [str(c) for c in columns]
    name = getattr(y, "name", None)
    return None if name is None or not hasattr(y, "index") else [str(name)]


def _plain(v: Any) -> Any:
    """JSON for what ``get_params`` and fitted attributes hold: NumPy scalars and arrays, tuples;
    anything else (a ``RandomState`` as ``random_state``) as None."""
    if isinstance(v, (np.generic, np.ndarray)):
        return v.tolist()
    return None


def predictor(ckpt: Checkpoint, device: str) -> Predictor:
    """The checkpoint scoring rows in float64 on ``device``, so that a row's output does not depend on the
    other rows scored with it (float32 GEMMs of other heights sum in other orders, on the CPU and the GPU:
    scikit-learn's ``check_methods_subset_invariance``); the outputs round once to float32."""
    return Predictor(ckpt, device=device, precision="fp64")


def normalization(ckpt: Checkpoint) -> Normalization:
    """The train split's normalisation the checkpoint holds (a continued fit keeps it)."""
    return Normalization.saved(ckpt.meta["data"]["normalize"], ckpt.arrays, "dataset")


def layers(ckpt: Checkpoint, kind: str) -> list[np.ndarray]:
    """``layer<i>.<kind>`` of every layer, in order (host arrays of the checkpoint)."""
    n = len(ckpt.meta["widths"]) - 1
    return [ckpt.arrays[f"param/layer{i}.{kind}"] for i in range(n)]


def save(ckpt: Checkpoint, path: Any) -> Path:
    """Write ``ckpt`` to ``path`` atomically; an existing file there is replaced only when it is an mlptrain
    checkpoint (or empty): never a data file or anything else (the path through a symlink is what counts).
    The temp files of earlier saves to ``path`` whose process is gone are removed first, and logged.

    Raises:
        CheckpointError: ``path`` is a folder or a file that is not a checkpoint (nothing is written).
    """
    path = Path(path).expanduser()
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder; save to a checkpoint file such as {path / 'model.npz'}")
    if path.exists() and path.stat().st_size and not is_checkpoint(path):
        raise CheckpointError(
            f"save path {path} exists and is not an mlptrain checkpoint; save replaces only a checkpoint: "
            "choose another path (nothing was written)"
        )
    remove_stale_temps(path)  # a save killed mid-write (SIGKILL, or SIGTERM without a handler) left its temp file
    checkpoint.save(path, ckpt.arrays, ckpt.meta)
    return path


def load(cls: Any, path: Any) -> Any:
    """An estimator of class ``cls`` (fitted) from the checkpoint at ``path``.

    Raises:
        CheckpointError: not a checkpoint, or one of the other task (a regression's for a classifier).
    """
    ckpt = checkpoint.load(Path(path).expanduser())
    data, config = ckpt.meta.get("data") or {}, ckpt.meta.get("config") or {}
    if data.get("task") != cls._task:
        raise CheckpointError(
            f"checkpoint {ckpt.path} holds a {data.get('task')} model; {cls.__name__} needs a {cls._task}"
        )
    saved = config.get("sklearn") or _from_cli(config, ckpt.meta)
    _check_keys(cls, saved, ckpt.path)
    est = cls(**{k: tuple(v) if k == "hidden_layer_sizes" else v for k, v in saved["params"].items()})
    for k, v in saved.items():
        if k != "params":
            setattr(est, k, np.asarray(v) if k == "classes_" else v)
    plan = data.get("columns")  # a DataFrame's (or a CLI table's) columns: the raw ones are the inputs
    inputs = [c["name"] for c in plan["columns"]] if plan else data.get("feature_names")
    est.n_features_in_ = len(plan["columns"]) if plan else int(ckpt.meta["widths"][0])
    if inputs:
        est.feature_names_in_ = np.asarray(inputs, dtype=object)
    est.seed_ = int(ckpt.meta["rng"]["seed"])
    est.state_ = Checkpoint(ckpt.path, ckpt.arrays, {k: v for k, v in ckpt.meta.items() if k != "sha256"})
    est.predictor_ = predictor(est.state_, est.device)
    return est


def _check_keys(cls: Any, saved: Any, path: Path) -> None:
    """Only the estimator's parameters (``params``) and fitted attributes (``cls.FITTED``) may be set from
    the checkpoint's ``config.sklearn``: a crafted file must not set any other attribute."""
    where = f"checkpoint {path}: config.sklearn"
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where} is {type(saved).__name__}; expected an object with a 'params' object")
    if not isinstance(saved.get("params"), dict):
        raise CheckpointError(f"{where}.params is {type(saved.get('params')).__name__}; expected an object")
    known = set(cls._get_param_names())
    for key in saved["params"]:
        if key not in known:
            raise CheckpointError(f"{where}.params has {key!r}, which is not a parameter of {cls.__name__}")
    for key in saved:
        if key != "params" and key not in cls.FITTED:
            raise CheckpointError(
                f"{where} has {key!r}, which is not a fitted attribute of {cls.__name__}; expected only 'params' "
                f"and {', '.join(map(repr, cls.FITTED))}"
            )


def _from_cli(config: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The estimator's parameters for a CLI run's checkpoint: those with a CLI setting, the rest default."""
    m, o = config.get("model", {}), config.get("optimizer", {})
    activation = {"none": "identity"}.get(m.get("activation", "relu"), m.get("activation", "relu"))
    params = {
        "hidden_layer_sizes": meta["widths"][1:-1],
        "activation": activation,
        "learning_rate_init": o.get("lr"),
        "solver": o.get("name") if o.get("name") in ("sgd", "adam") else "adam",
        "precision": meta["precision"],
        "execution": meta["execution"],
        "random_state": meta["rng"]["seed"],
        "categorical_features": config.get("data", {}).get("categorical") or None,  # None: from_dtype
        "min_frequency": config.get("data", {}).get("min_frequency"),
        "ensemble_size": meta.get("members"),  # an ensemble's (or a cross-validation's) K members, stacked
    }
    out: dict[str, Any] = {"params": {k: v for k, v in params.items() if v is not None}}
    n, batch = meta["position"]["epoch"], config.get("data", {}).get("batch_size") or 0
    out.update(n_iter_=n, loss_curve_=[], t_=meta["position"]["step"] * batch)  # t_: each step a full batch
    if meta["data"]["task"] == "classification":
        out["classes_"] = meta["data"].get("class_names") or list(range(meta["widths"][-1]))
    else:
        out["n_outputs_"] = meta["widths"][-1]
    return out
