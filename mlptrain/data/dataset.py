"""The :class:`Dataset`: one dataset's splits as host arrays, ready for the loader."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlptrain.errors import DatasetError


@dataclass
class Dataset:
    """One dataset's splits as host arrays, normalised with statistics of the train split.

    Attributes:
        name: Dataset name, one of :data:`DATASETS`.
        x_train: ``(N, F)`` float32, C-contiguous.
        y_train: ``(N,)`` int64 labels in ``[0, num_classes)``.
        x_val: ``(V, F)`` float32; ``V == 0`` when ``val_fraction == 0``.
        y_val: ``(V,)`` int64.
        x_test: ``(T, F)`` float32.
        y_test: ``(T,)`` int64.
        num_classes: Number of classes ``C``.
        class_names: ``C`` readable names, or None.
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

    def __post_init__(self) -> None:
        for split in ("train", "val", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if x.ndim != 2 or y.ndim != 1 or len(x) != len(y) or x.shape[1] != self.x_train.shape[1]:
                raise DatasetError(
                    f"dataset {self.name!r} split {split}: x {x.shape} and y {y.shape} are not (N, F) and (N,) "
                    f"with F={self.x_train.shape[-1]} as in the train split"
                )
            bad = first_nonfinite(x)
            if bad is not None:
                raise DatasetError(
                    f"dataset {self.name!r} split {split}: row {bad[0]}, column {bad[1]} holds {x[bad]}; features "
                    "must be finite numbers (remove or fill the missing values)"
                )

    @property
    def num_features(self) -> int:
        """Number of input features ``F``."""
        return int(self.x_train.shape[1])


def first_nonfinite(x: np.ndarray) -> tuple[int, int] | None:
    """``(row, column)`` of the first inf or NaN in ``x (N, F)``, or None (one pass when there is none)."""
    if x.size == 0 or np.isfinite(x).all():
        return None
    row, col = np.argwhere(~np.isfinite(x))[0]
    return int(row), int(col)
