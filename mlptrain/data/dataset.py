"""The :class:`Dataset`: one dataset's splits as host arrays, and what a trained model needs of it.

Besides the splits, a dataset carries what scoring raw inputs later needs (it goes into every
checkpoint, :meth:`Dataset.preprocessing`): the names of the features, classes and targets, the
normalisation (:class:`Normalization`: ``x_normalised = (x_raw - shift) / scale``, from the
train split's statistics) and, for a regression, the scaling of the targets (the same form:
``y_scaled = (y - shift) / scale``; the model's outputs are ``y = output * scale + shift``).

A dataset whose ``normalization`` (``target_scaling``) is None holds raw features (targets):
:func:`mlptrain.data.prepare.preprocess` computes them from its train split, the one path that
``data=<name>`` and a dataset built in Python both take.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlptrain.base.errors import DatasetError
from mlptrain.config.schema import TASKS
from mlptrain.data.files.chunks import first_nonfinite, normalise_into
from mlptrain.data.files.column_stats import QuantileMap

__all__ = ["TASKS", "Dataset", "Normalization", "Raw", "check_real", "first_nonfinite"]


def check_real(a: Any, where: str, error: type[Exception] = DatasetError) -> None:
    """Raise ``error`` (one line naming ``where``) if ``a`` (an array, a DataFrame, a list) holds complex numbers:
    cast to float they would lose their imaginary parts with only NumPy's warning."""
    if hasattr(a, "columns") and hasattr(a, "dtypes"):  # a DataFrame: each column's dtype (pandas' have a kind)
        dtypes = list(a.dtypes)
    else:  # an array or a Series (one dtype, which may be pandas' str); a list as scikit-learn's checks read it
        dtype = getattr(a, "dtype", None)
        dtypes = [np.asarray(a).dtype if dtype is None and isinstance(a, (list, tuple)) else dtype]
    dtype = next((d for d in dtypes if getattr(d, "kind", "") == "c"), None)
    if dtype is not None:
        raise error(
            f"{where} holds complex numbers ({np.dtype(dtype).name}); Complex data not supported: expected real "
            "numbers (pass .real, or abs(), if that is what is meant)"
        )


def weights_problem(w: np.ndarray, rows: int) -> str | None:
    """What is wrong with the row weights ``w`` of a split of ``rows`` rows, or None: they must be ``(rows,)``
    finite numbers >= 0 with a positive sum."""
    if w.shape != (rows,):
        return f"has shape {w.shape}; expected ({rows},), one weight per training row"
    bad = np.flatnonzero(~(np.isfinite(w) & (w >= 0)))
    if len(bad):
        return f"row {int(bad[0])} holds {w[bad[0]]}; row weights must be finite numbers >= 0"
    if not w.sum() > 0:
        return "sums to 0; at least one training row must weigh more than 0"
    return None


@dataclass
class Normalization:
    """``(x - shift) / scale`` per feature (or target); ``method`` says how the statistics were taken.

    ``origin``: ``train split`` (mlptrain took the statistics, :mod:`mlptrain.data.prepare`) or
    ``dataset`` (given with the :class:`Dataset`, kept as it is). ``quantile`` (``data.normalize=quantile``)
    maps some raw columns through their training quantiles to a standard normal first (those columns' shift
    is 0 and scale 1): ``(quantile(x) - shift) / scale``.
    """

    method: str
    shift: np.ndarray  # (F,) float64
    scale: np.ndarray  # (F,) float64, > 0
    origin: str = "dataset"
    quantile: QuantileMap | None = None  # quantiles (Q, K) float64 of columns (K,)

    @property
    def mapped(self) -> Any:
        """The map of raw columns applied before the shift (:meth:`QuantileMap.apply_`), or None."""
        return None if self.quantile is None else self.quantile.apply_

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays a checkpoint holds: ``data/shift``, ``data/scale`` ``(F,)`` and, with a quantile map,
        ``data/quantiles`` ``(Q, K)`` and ``data/quantile_columns`` ``(K,)`` int64."""
        out = {"data/shift": self.shift, "data/scale": self.scale}
        if self.quantile is not None:
            out.update({"data/quantiles": self.quantile.quantiles, "data/quantile_columns": self.quantile.columns})
        return out

    @classmethod
    def saved(cls, method: str, arrays: dict[str, np.ndarray], origin: str = "train split") -> Normalization:
        """The normalisation of a checkpoint's arrays (:meth:`arrays`), float64."""
        q = None
        if "data/quantiles" in arrays:
            q = QuantileMap(
                arrays["data/quantiles"].astype(np.float64), arrays["data/quantile_columns"].astype(np.int64)
            )
        shift, scale = (arrays[f"data/{k}"].astype(np.float64) for k in ("shift", "scale"))
        return cls(method, shift, scale, origin, q)

    @classmethod
    def identity(cls, features: int) -> Normalization:
        return cls("none", np.zeros(features), np.ones(features), "train split")

    def apply(self, x: np.ndarray) -> np.ndarray:
        """``x (N, F)`` raw -> float32 C-contiguous, normalised as the training data was (in float64, rounded once:
        :func:`mlptrain.data.files.chunks.normalise_into`)."""
        x = np.asarray(x)
        inv = 1.0 / np.asarray(self.scale, np.float64)
        return normalise_into(x, np.asarray(self.shift, np.float64), inv, np.empty(x.shape, np.float32), self.mapped)

    def undo(self, z: np.ndarray) -> np.ndarray:
        """``z (N, T)`` scaled -> ``z * scale + shift`` float32: a regression's outputs in the target's units.

        In float64, rounded once: a row's value then depends on its own output alone (float32 arithmetic with a
        large shift rounds at the shift's precision, so rows scored in other batches could differ by an ulp)."""
        return (np.asarray(z, dtype=np.float64) * self.scale + self.shift).astype(np.float32)


@dataclass
class Dataset:
    """One dataset's splits as host arrays: raw, or normalised with statistics of the train split.

    Attributes:
        name: Dataset name (``digits``, ``file``, anything for a dataset built in Python).
        x_train: ``(N, F)`` features: raw (any real dtype) while ``normalization`` is None, else
            float32, C-contiguous, normalised by it.
        y_train: classification: ``(N,)`` int64 labels in ``[0, num_classes)``; regression:
            ``(N, T)`` float32 targets, scaled by ``target_scaling`` unless it is None (raw).
        x_val, y_val: the validation split (``V == 0`` rows when ``val_fraction == 0``).
        x_test, y_test: the test split.
        num_classes: classification: the number of classes ``C``; regression: the number of targets ``T``.
        class_names: ``C`` readable names, or None.
        task: ``classification`` or ``regression``.
        feature_names: ``F`` column names, or None.
        target_names: regression: ``T`` column names, or None.
        normalization: how the features were normalised; None: they are raw, and training normalises
            them from ``x_train`` (``data.normalize``). Give your own to keep it: the arrays are then
            taken as normalised by it, and every checkpoint scores raw rows with it.
        target_scaling: regression: how the targets were scaled; None: they are raw, and training
            standardises them from ``y_train`` (``data.target_scaling``).
        w_train: ``(N,)`` float64 weights of the training rows (``data.weight``: finite, >= 0, a positive
            sum), or None: every row weighs 1. They weigh the training loss only; the validation and test
            losses and scores are unweighted.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    class_names: list[str] | None = None
    task: str = "classification"
    feature_names: list[str] | None = None
    target_names: list[str] | None = None
    normalization: Normalization | None = field(default=None, repr=False)
    target_scaling: Normalization | None = field(default=None, repr=False)
    columns: dict[str, Any] | None = field(default=None, repr=False)  # the column plan (mlptrain.data.files.plan)
    w_train: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise DatasetError(f"dataset {self.name!r}: task={self.task!r}; expected one of {', '.join(TASKS)}")
        for split in ("train", "val", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            self._check_split(split, x, y)
        if self.w_train is not None:
            self.w_train = np.asarray(self.w_train, np.float64)
            problem = weights_problem(self.w_train, len(self.x_train))
            if problem is not None:
                raise DatasetError(f"dataset {self.name!r}: w_train {problem}")

    def _check_split(self, split: str, x: np.ndarray, y: np.ndarray) -> None:
        f, where = self.x_train.shape[-1], f"dataset {self.name!r} split {split}"
        y_ndim = 1 if self.task == "classification" else 2
        if x.ndim != 2 or y.ndim != y_ndim or len(x) != len(y) or x.shape[1] != f:
            shape = "(N,)" if y_ndim == 1 else f"(N, {self.num_classes})"
            raise DatasetError(
                f"{where}: x {x.shape} and y {y.shape} are not (N, F) and {shape} with F={f} as in the train split"
            )
        check_real(x, f"{where}: x")
        check_real(y, f"{where}: y")
        bad = None if getattr(x, "checked_finite", False) else first_nonfinite(x)  # streamed: its table was checked
        if bad is not None:
            raise DatasetError(
                f"{where}: row {bad[0]}, column {bad[1]} holds {x[bad]}; features must be finite numbers (remove "
                "or fill the missing values)"
            )
        if self.task == "regression":
            bad = first_nonfinite(y)
            if y.shape[1] != self.num_classes or bad is not None:
                raise DatasetError(f"{where}: targets {y.shape} must be finite, {self.num_classes} per row")
        elif len(y) and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= self.num_classes):
            raise DatasetError(
                f"{where} has labels of dtype {y.dtype} in [{y.min()}, {y.max()}]; expected integers in "
                f"[0, {self.num_classes})"
            )

    @property
    def num_features(self) -> int:
        """Number of input features ``F``."""
        return int(self.x_train.shape[1])

    @property
    def num_outputs(self) -> int:
        """The width of the model's output: the classes, or the targets of a regression."""
        return int(self.num_classes)

    def preprocessing(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """``(meta, arrays)`` that scoring raw inputs needs: names, task, the normalisation's arrays and
        (a regression) the target scaling's, ``data/target_shift`` and ``data/target_scale`` ``(T,)``.

        ``normalization_from`` says where the normalisation came from: ``train split``, ``dataset``
        (its own), or ``unknown`` (raw features never normalised: a checkpoint then cannot score raw rows).
        """
        norm = self.normalization or Normalization.identity(self.num_features)
        meta: dict[str, Any] = {
            "name": self.name,
            "task": self.task,
            "feature_names": self.feature_names,
            "class_names": self.class_names,
            "target_names": self.target_names,
            "normalize": norm.method,
            "normalization_from": norm.origin if self.normalization is not None else "unknown",
            "target_scaling": None,
        }
        if self.columns is not None:
            meta["columns"] = self.columns
        arrays = norm.arrays()
        if self.task == "regression":
            ts = self.target_scaling or Normalization.identity(self.num_outputs)
            meta["target_scaling"] = ts.method
            arrays.update({"data/target_shift": ts.shift, "data/target_scale": ts.scale})
        return meta, arrays

    def preprocessing_differs(self, arrays: dict[str, np.ndarray], where: str) -> bool:
        """Whether a checkpoint's ``data/`` arrays (``where`` names it) hold another preprocessing than this
        dataset's (a resume then warns).

        Raises:
            DatasetError: the checkpoint is a regression's trained on unscaled targets (saved before
                ``data.target_scaling``) and this dataset's targets are standardised: its outputs would be
                read in the wrong units.
        """
        _, now = self.preprocessing()
        if self.target_units() is not None and "data/target_scale" not in arrays:
            raise DatasetError(
                f"{where} was trained on the targets as they are (it holds no data/target_scale), but this run "
                "standardises them (data.target_scaling=standard); resume with data.target_scaling=none"
            )
        return any(k in arrays and not np.array_equal(arrays[k], v) for k, v in now.items())

    def target_units(self) -> np.ndarray | None:
        """``(T,)`` float32: what a standardised regression's residual is multiplied by to be in the targets'
        units (losses are reported in them); None: the targets are as given (or it is a classification)."""
        ts = self.target_scaling
        return None if ts is None or ts.method == "none" else ts.scale.astype(np.float32)


@dataclass
class Raw:
    """A source's data before splitting and normalisation (see :class:`mlptrain.data.Dataset`)."""

    x: np.ndarray
    y: np.ndarray
    x_test: np.ndarray | None
    y_test: np.ndarray | None
    num_classes: int
    class_names: list[str] | None = None
    task: str = "classification"
    feature_names: list[str] | None = None
    target_names: list[str] | None = None
    pending: list[Future] = field(default_factory=list, repr=False)  # cache writes under way: waited for at the end
    tables: tuple[Any, Any] | None = None  # (train, test) Tables of text cells, encoded by the column plan once split
    w: np.ndarray | None = None  # (N,) float64 row weights of the training file's rows (data.weight), or None


def saved_target_scaling(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> Normalization:
    """How a checkpoint's regression outputs become the targets' units (``data/target_shift``,
    ``data/target_scale`` ``(T,)`` of :meth:`Dataset.preprocessing`); without them (a classification,
    or a checkpoint saved before targets were scaled) the outputs are the targets as they are."""
    if "data/target_scale" not in arrays:
        return Normalization.identity(int(meta["widths"][-1]))
    shift, scale = (arrays[f"data/target_{k}"].astype(np.float64) for k in ("shift", "scale"))
    return Normalization(str((meta.get("data") or {}).get("target_scaling")), shift, scale, "train split")


def raw_rows_problem(meta: dict[str, Any], where: str) -> str | None:
    """Why a checkpoint (``meta``, named ``where``) cannot score raw rows, or None.

    Its normalisation is unknown where :meth:`Dataset.preprocessing` said so, and in checkpoints of
    a Dataset built in Python by mlptrain before the one preprocessing path, which saved identity
    preprocessing (``normalize: none``) while the config said ``data.normalize=standard``: their
    features may have been normalised by hand, in a way the checkpoint does not hold.
    """
    data = meta.get("data") or {}
    origin = data.get("normalization_from")
    config_says = ((meta.get("config") or {}).get("data") or {}).get("normalize", "standard")
    if origin == "unknown" or (origin is None and data.get("normalize") == "none" and config_says != "none"):
        return (
            f"{where} was trained on a Dataset built in Python whose normalisation it does not hold "
            f"(data.normalize={config_says}, its preprocessing 'none'), so it cannot score raw rows; pass rows "
            "normalised as its training data with Predictor.logits(x, normalised=True), or train it again with "
            "this mlptrain, which normalises a Dataset's raw features and keeps the normalisation"
        )
    return None
