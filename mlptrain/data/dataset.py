"""The :class:`Dataset`: one dataset's splits as host arrays, and what a trained model needs of it.

Besides the splits, a dataset carries what scoring raw inputs later needs (it goes into every
checkpoint, :meth:`Dataset.preprocessing`): the names of the features, classes and targets, and
the normalisation (:class:`Normalization`: ``x_normalised = (x_raw - shift) / scale``, from the
train split's statistics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlptrain.errors import DatasetError

TASKS = ("classification", "regression")


@dataclass
class Normalization:
    """``(x - shift) / scale`` per feature; ``method`` says how the train split's statistics were taken."""

    method: str
    shift: np.ndarray  # (F,) float64
    scale: np.ndarray  # (F,) float64, > 0

    @classmethod
    def identity(cls, features: int) -> Normalization:
        return cls("none", np.zeros(features), np.ones(features))

    def apply(self, x: np.ndarray) -> np.ndarray:
        """``x (N, F)`` raw -> float32 C-contiguous, normalised as the training data was."""
        shift32, inv32 = self.shift.astype(np.float32), (1.0 / self.scale).astype(np.float32)
        return np.ascontiguousarray((np.asarray(x, dtype=np.float32) - shift32) * inv32)


@dataclass
class Dataset:
    """One dataset's splits as host arrays, normalised with statistics of the train split.

    Attributes:
        name: Dataset name (``digits``, ``file``, anything for a dataset built in Python).
        x_train: ``(N, F)`` float32, C-contiguous.
        y_train: classification: ``(N,)`` int64 labels in ``[0, num_classes)``; regression:
            ``(N, T)`` float32 targets.
        x_val, y_val: the validation split (``V == 0`` rows when ``val_fraction == 0``).
        x_test, y_test: the test split.
        num_classes: classification: the number of classes ``C``; regression: the number of targets ``T``.
        class_names: ``C`` readable names, or None.
        task: ``classification`` or ``regression``.
        feature_names: ``F`` column names, or None.
        target_names: regression: ``T`` column names, or None.
        normalization: how the raw features were normalised (None: not known, e.g. built by hand).
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

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise DatasetError(f"dataset {self.name!r}: task={self.task!r}; expected one of {', '.join(TASKS)}")
        for split in ("train", "val", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            self._check_split(split, x, y)

    def _check_split(self, split: str, x: np.ndarray, y: np.ndarray) -> None:
        f, where = self.x_train.shape[-1], f"dataset {self.name!r} split {split}"
        y_ndim = 1 if self.task == "classification" else 2
        if x.ndim != 2 or y.ndim != y_ndim or len(x) != len(y) or x.shape[1] != f:
            shape = "(N,)" if y_ndim == 1 else f"(N, {self.num_classes})"
            raise DatasetError(
                f"{where}: x {x.shape} and y {y.shape} are not (N, F) and {shape} with F={f} as in the train split"
            )
        bad = first_nonfinite(x)
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
        """``(meta, arrays)`` that scoring raw inputs needs: names, task, and the normalisation's arrays."""
        norm = self.normalization or Normalization.identity(self.num_features)
        meta = {
            "name": self.name,
            "task": self.task,
            "feature_names": self.feature_names,
            "class_names": self.class_names,
            "target_names": self.target_names,
            "normalize": norm.method,
        }
        return meta, {"data/shift": norm.shift, "data/scale": norm.scale}


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


def first_nonfinite(x: np.ndarray) -> tuple[int, int] | None:
    """``(row, column)`` of the first inf or NaN in ``x (N, F)``, or None (one pass when there is none)."""
    if x.size == 0 or np.isfinite(x).all():
        return None
    row, col = np.argwhere(~np.isfinite(x))[0]
    return int(row), int(col)
