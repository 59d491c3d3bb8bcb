"""From a dataset name to a :class:`Dataset`: splits and normalisation, in NumPy only.

All randomness comes from a ``numpy.random.Generator`` seeded by the ``seed`` argument, so a
split depends on nothing else. This package never imports CuPy: :mod:`mlptrain.loader` moves the
arrays to the device.
"""

from __future__ import annotations

import logging

import numpy as np

from mlptrain.config import DataConfig
from mlptrain.data.dataset import Dataset
from mlptrain.data.sources import SOURCES
from mlptrain.errors import ConfigError, DatasetError

log = logging.getLogger(__name__)

STD_FLOOR = 1e-6  # a feature whose train std (or range) is below this is only centred, not scaled
DATASETS = tuple(SOURCES)


def stratified_split(y: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Split indices of ``y`` into ``(keep, taken)`` with each class's share kept in both parts.

    ``round(N * fraction)`` indices are taken (at least one when ``fraction > 0``), shared among the
    classes in proportion to their counts by the largest-remainder rule.

    Args:
        y: ``(N,)`` integer labels.
        fraction: Share of samples to take, in ``[0, 1)``.
        rng: Source of the shuffles.

    Returns:
        Two int64 index arrays, each in random order, together a permutation of ``arange(N)``.
    """
    n = len(y)
    k = 0 if fraction <= 0 else max(1, round(n * fraction))
    if k >= n:
        raise ConfigError(f"a split fraction of {fraction} takes {k} of {n} samples and leaves none to train on")
    classes, counts = np.unique(y, return_counts=True)
    quota = counts * (k / n)  # (K,) ideal share per class
    take = np.floor(quota).astype(np.int64)
    take[np.argsort(take - quota, kind="stable")[: k - int(take.sum())]] += 1  # largest remainders first
    keep, taken = [], []
    for cls, t in zip(classes, take, strict=True):
        idx = rng.permutation(np.flatnonzero(y == cls))
        taken.append(idx[:t])
        keep.append(idx[t:])
    return rng.permutation(np.concatenate(keep)), rng.permutation(np.concatenate(taken))


def _normalize(method: str, x_train: np.ndarray, *others: np.ndarray) -> list[np.ndarray]:
    """Scale every split with statistics of ``x_train`` only; return float32 C-contiguous arrays."""
    if method == "standard":
        shift = x_train.mean(axis=0, dtype=np.float64)  # (F,)
        scale = x_train.std(axis=0, dtype=np.float64)  # (F,)
    elif method == "minmax":
        shift = x_train.min(axis=0).astype(np.float64)
        scale = x_train.max(axis=0).astype(np.float64) - shift
    elif method == "none":
        return [np.ascontiguousarray(a, dtype=np.float32) for a in (x_train, *others)]
    else:
        raise ConfigError(f"data.normalize={method!r} is not a normalisation; expected standard, minmax or none")
    scale = np.where(scale < STD_FLOOR, 1.0, scale)  # constant features: centre only, never divide by ~0
    shift32, inv32 = shift.astype(np.float32), (1.0 / scale).astype(np.float32)
    return [np.ascontiguousarray((a.astype(np.float32) - shift32) * inv32) for a in (x_train, *others)]


def _check_labels(name: str, split: str, y: np.ndarray, num_classes: int) -> None:
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise DatasetError(
            f"dataset {name!r} split {split} has labels in [{y.min()}, {y.max()}]; expected [0, {num_classes})"
        )


def load_dataset(cfg: DataConfig, seed: int) -> Dataset:
    """Load ``cfg.name``, split it with a generator seeded by ``seed`` and normalise it.

    Datasets without an official test split (digits, synthetic) first lose a stratified
    ``test_fraction`` to the test split; then a stratified ``val_fraction`` of what remains for
    training becomes the validation split. Normalisation statistics come from the train split only.

    Args:
        cfg: The data config; ``name`` and ``normalize`` may be enum members or plain strings.
        seed: Seed of the splits (and of the synthetic data); same seed, same arrays.

    Returns:
        A :class:`Dataset` of float32 features and int64 labels.

    Raises:
        DatasetError: unknown name, missing optional package, missing/corrupt/undownloadable files.
        ConfigError: fractions or normalisation out of range.
    """
    name = str(getattr(cfg.name, "value", cfg.name))
    if name not in SOURCES:
        raise DatasetError(f"data.name={name!r} is not a dataset; expected one of {', '.join(DATASETS)}")
    if not (0.0 <= cfg.val_fraction < 1.0 and 0.0 < cfg.test_fraction < 1.0):
        raise ConfigError(
            f"data.val_fraction={cfg.val_fraction} and data.test_fraction={cfg.test_fraction}; "
            "expected [0, 1) and (0, 1)"
        )
    rng = np.random.default_rng([seed, 0xDA7A])  # a stream of its own, apart from init and data order
    x, y, x_test, y_test, num_classes, class_names = SOURCES[name](cfg, rng)
    n, official_test = len(y), x_test is not None
    try:
        if x_test is None:
            train, test = stratified_split(y, cfg.test_fraction, rng)
            x, y, x_test, y_test = x[train], y[train], x[test], y[test]
        train, val = stratified_split(y, cfg.val_fraction, rng)
    except ConfigError as exc:
        raise ConfigError(
            f"dataset {name!r} has {n} samples for training, too few to split off data.val_fraction="
            f"{cfg.val_fraction}{'' if official_test else f' and data.test_fraction={cfg.test_fraction}'} "
            f"({exc}); {'raise data.samples or ' if name == 'synthetic' else ''}lower the fractions"
        ) from exc
    x_train, y_train, x_val, y_val = x[train], y[train], x[val], y[val]
    for split, labels in (("train", y_train), ("val", y_val), ("test", y_test)):
        _check_labels(name, split, labels, num_classes)
    x_train, x_val, x_test = _normalize(str(getattr(cfg.normalize, "value", cfg.normalize)), x_train, x_val, x_test)
    ds = Dataset(name, x_train, y_train, x_val, y_val, x_test, np.asarray(y_test, np.int64), num_classes, class_names)
    log.info(
        "dataset %s: %d train, %d val, %d test, %d features, %d classes",
        name,
        len(ds.x_train),
        len(ds.x_val),
        len(ds.x_test),
        ds.num_features,
        num_classes,
    )
    return ds
