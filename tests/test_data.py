"""Tests of mlptrain.data: bundled digits, mnist1d, synthetic (IDX I/O and the downloader: tests/test_idx.py)."""

from __future__ import annotations

import hashlib
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from mlptrain import data
from mlptrain.base.errors import ConfigError, DatasetError
from mlptrain.base.fs import cache_root
from mlptrain.config.schema import DataConfig, DatasetName, Normalize
from mlptrain.data import Dataset, load_dataset, sources, stratified_split

# ------------------------------------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset(DataConfig(), seed=0)


@pytest.fixture(scope="module")
def digits_raw() -> Dataset:
    return load_dataset(DataConfig(normalize=Normalize.none), seed=0)


def _splits(ds: Dataset):
    return [("train", ds.x_train, ds.y_train), ("val", ds.x_val, ds.y_val), ("test", ds.x_test, ds.y_test)]


def test_digits_sizes_and_dtypes(digits: Dataset) -> None:
    assert digits.name == "digits"
    assert len(digits.x_train) + len(digits.x_val) + len(digits.x_test) == 1797
    assert len(digits.x_test) == round(1797 * 0.2)
    assert len(digits.x_val) == round((1797 - len(digits.x_test)) * 0.1)
    assert digits.num_features == 64 and digits.num_classes == 10
    assert digits.class_names == [str(i) for i in range(10)]
    for _, x, y in _splits(digits):
        assert x.dtype == np.float32 and x.flags.c_contiguous and x.shape[1] == 64
        assert y.dtype == np.int64 and y.shape == (len(x),)
    all_y = np.concatenate([digits.y_train, digits.y_val, digits.y_test])
    assert_array_equal(np.bincount(all_y), [178, 182, 177, 183, 181, 182, 181, 179, 174, 180])


def test_digits_splits_are_stratified(digits: Dataset) -> None:
    all_y = np.concatenate([digits.y_train, digits.y_val, digits.y_test])
    overall = np.bincount(all_y, minlength=10) / len(all_y)
    for split, _, y in _splits(digits):
        share = np.bincount(y, minlength=10) / len(y)
        # Two stratified roundings, each off by under one sample per class; a random split of 144
        # val samples is off by ~3.6 samples per class.
        assert np.abs(share - overall).max() < 2 / len(y), split


def test_digits_raw_pixels_are_integers_0_to_16(digits_raw: Dataset) -> None:
    x = np.concatenate([digits_raw.x_train, digits_raw.x_val, digits_raw.x_test])
    assert x.min() == 0 and x.max() == 16
    assert_array_equal(x, np.round(x))


def test_standard_normalisation_uses_train_statistics_only(digits: Dataset, digits_raw: Dataset) -> None:
    raw_train = digits_raw.x_train.astype(np.float64)
    mean, std = raw_train.mean(0), raw_train.std(0)
    scaled = std > 0  # every pixel that varies is scaled, whatever its spread (#47: no floor); constant ones are 0
    assert 55 < scaled.sum() < 64
    assert_allclose(digits.x_train.mean(0), 0, atol=1e-5)
    assert_allclose(digits.x_train[:, scaled].std(0), 1, rtol=1e-4)
    assert_array_equal(digits.x_train[:, ~scaled], 0.0)
    scale = np.where(scaled, std, 1.0)
    for _, x_raw, x in [("val", digits_raw.x_val, digits.x_val), ("test", digits_raw.x_test, digits.x_test)]:
        assert_allclose(x, (x_raw - mean) / scale, rtol=1e-4, atol=1e-4)
    assert np.abs(digits.x_test.mean(0)).max() > 1e-3  # test statistics were not used
    norm = digits.normalization  # kept with the dataset (and the checkpoint): raw inputs can be scored
    assert norm is not None and norm.method == "standard"
    assert_array_equal(norm.apply(digits_raw.x_test), digits.x_test)


def test_minmax_normalisation() -> None:
    ds = load_dataset(DataConfig(normalize="minmax"), seed=0)
    varying = ds.x_train.max(0) > ds.x_train.min(0)
    assert_allclose(ds.x_train[:, varying].min(0), 0, atol=1e-6)
    assert_allclose(ds.x_train[:, varying].max(0), 1, atol=1e-6)
    assert ds.x_train.dtype == np.float32 and ds.x_train.flags.c_contiguous


def test_same_split_seed_same_arrays_other_split_seed_other_split(digits: Dataset) -> None:
    again = load_dataset(DataConfig(name=DatasetName.digits))
    for (_, x0, y0), (_, x1, y1) in zip(_splits(digits), _splits(again), strict=True):
        assert_array_equal(x0, x1)
        assert_array_equal(y0, y1)
    other = load_dataset(DataConfig(normalize="none", split_seed=1))
    raw = load_dataset(DataConfig(normalize="none"))
    assert other.x_test.shape == raw.x_test.shape
    rows = [{r.tobytes() for r in ds.x_test} for ds in (raw, other)]  # which samples, not their order
    assert len(rows[0] ^ rows[1]) > 100


def test_val_fraction_zero_gives_empty_val_split() -> None:
    ds = load_dataset(DataConfig(val_fraction=0.0), seed=0)
    assert ds.x_val.shape == (0, 64) and ds.y_val.shape == (0,)
    assert ds.x_val.dtype == np.float32 and ds.y_val.dtype == np.int64
    assert len(ds.x_train) + len(ds.x_test) == 1797


def test_corrupted_digits_file_fails_its_checksum(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blob = bytearray(sources.DIGITS_PATH.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    bad = tmp_path / "digits.csv.gz"
    bad.write_bytes(bytes(blob))
    monkeypatch.setattr(sources, "DIGITS_PATH", bad)
    with pytest.raises(DatasetError, match="checksum") as err:
        load_dataset(DataConfig(), seed=0)
    msg = str(err.value)
    assert str(bad) in msg and sources.DIGITS_SHA256 in msg and hashlib.sha256(bytes(blob)).hexdigest() in msg


def test_unknown_dataset_name_lists_the_available_ones() -> None:
    with pytest.raises(DatasetError, match="cifar") as err:
        load_dataset(DataConfig(name="cifar"), seed=0)  # type: ignore[arg-type]
    for name in data.DATASETS:
        assert name in str(err.value)
    assert set(data.DATASETS) == {d.value for d in DatasetName}


def test_bad_fraction_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="val_fraction=1.5"):
        load_dataset(DataConfig(val_fraction=1.5), seed=0)


def test_stratified_split_partitions_and_balances() -> None:
    y = np.repeat(np.arange(3), [50, 30, 20])
    keep, taken = stratified_split(y, 0.22, np.random.default_rng(0))
    assert_array_equal(np.sort(np.concatenate([keep, taken])), np.arange(100))
    assert len(taken) == 22
    assert_array_equal(np.bincount(y[taken]), [11, 7, 4])  # quotas 11, 6.6, 4.4: the largest remainder gets 1
    assert not np.array_equal(taken, np.sort(taken))  # shuffled, not grouped by class
    with pytest.raises(ConfigError, match="leaves none"):
        stratified_split(y, 0.999, np.random.default_rng(0))


def test_default_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("MLPTRAIN_DATA")
    assert cache_root() == tmp_path / "b" / "mlptrain"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "mlptrain"


# ------------------------------------------------------------------------------------------ mnist1d


@pytest.fixture(scope="module")
def mnist1d_run() -> dict:
    pytest.importorskip("mnist1d")
    sources._MNIST1D_CACHE.clear()  # generate for real, even if another test module loaded it first
    np.random.seed(1234)
    random.seed(5678)
    before = (np.random.get_state(), random.getstate())
    ds = load_dataset(DataConfig(name="mnist1d"), seed=0)
    after = (np.random.get_state(), random.getstate())
    return {"ds": ds, "before": before, "after": after}


def test_mnist1d_shapes(mnist1d_run: dict) -> None:
    ds = mnist1d_run["ds"]
    assert len(ds.x_train) + len(ds.x_val) == 4000 and len(ds.x_val) == 400
    assert ds.x_test.shape == (1000, 40) and ds.num_features == 40 and ds.num_classes == 10
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert_allclose(ds.x_train.mean(0), 0, atol=1e-5)


def test_mnist1d_leaves_global_random_state_alone(mnist1d_run: dict) -> None:
    (np_before, py_before), (np_after, py_after) = mnist1d_run["before"], mnist1d_run["after"]
    assert_array_equal(np_before[1], np_after[1])
    assert np_before[2:] == np_after[2:]
    assert py_before == py_after


def test_mnist1d_missing_package_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "_MNIST1D_CACHE", {})
    monkeypatch.setitem(sys.modules, "mnist1d", None)
    monkeypatch.setitem(sys.modules, "mnist1d.data", None)
    with pytest.raises(DatasetError, match=r"pip install mnist1d.*pip install -e '\.\[datasets\]'"):
        load_dataset(DataConfig(name="mnist1d"), seed=0)


# ---------------------------------------------------------------------------------------- synthetic


def test_synthetic_sizes_and_balance() -> None:
    cfg = DataConfig(name="synthetic", samples=1000, features=8, classes=4, split_seed=3)
    ds = load_dataset(cfg)
    assert ds.x_train.shape == (720, 8) and ds.x_val.shape == (80, 8) and ds.x_test.shape == (200, 8)
    assert ds.num_classes == 4 and ds.class_names is None
    assert_array_equal(np.bincount(ds.y_test), [50, 50, 50, 50])
    assert not np.array_equal(
        load_dataset(DataConfig(name="synthetic", samples=1000, features=8, classes=4, split_seed=4)).x_test, ds.x_test
    )


def _two_means_per_class(x: np.ndarray, y: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's 2-means inside each class: (2C, F) centres and their (2C,) labels."""
    rng = np.random.default_rng(0)
    centres = []
    for c in range(num_classes):
        xc = x[y == c]  # (Nc, F)
        m = xc[rng.choice(len(xc), 2, replace=False)]  # (2, F)
        for _ in range(20):
            near = ((xc[:, None] - m[None]) ** 2).sum(-1).argmin(1)  # (Nc,)
            m = np.stack([xc[near == j].mean(0) if (near == j).any() else m[j] for j in range(2)])
        centres.append(m)
    return np.concatenate(centres), np.repeat(np.arange(num_classes), 2)


def test_synthetic_is_learnable_but_not_linearly_trivial() -> None:
    ds = load_dataset(DataConfig(name="synthetic", samples=4000, features=32, classes=10, val_fraction=0), seed=0)
    means = np.stack([ds.x_train[ds.y_train == c].mean(0) for c in range(10)])  # (C, F)
    ncm = (((ds.x_test[:, None] - means[None]) ** 2).sum(-1).argmin(1) == ds.y_test).mean()
    a = np.c_[ds.x_train, np.ones(len(ds.x_train))]  # least-squares linear classifier on one-hot targets
    w = np.linalg.lstsq(a, np.eye(10)[ds.y_train], rcond=None)[0]  # (F + 1, C)
    linear = ((np.c_[ds.x_test, np.ones(len(ds.x_test))] @ w).argmax(1) == ds.y_test).mean()
    centres, labels = _two_means_per_class(ds.x_train, ds.y_train, 10)
    blobs = (labels[((ds.x_test[:, None] - centres[None]) ** 2).sum(-1).argmin(1)] == ds.y_test).mean()
    assert ncm > 0.5  # chance is 0.1
    assert linear < 0.9  # two blobs per class: a linear rule cannot separate them all (~0.79 here)
    assert blobs > linear + 0.08  # a rule that knows about two blobs per class does (~0.94 here)
