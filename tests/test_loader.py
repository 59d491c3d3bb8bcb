"""Tests of mlptrain.loader.DataLoader: coverage, order, resume, layout and validation."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from mlptrain.errors import ConfigError
from mlptrain.loader import DataLoader


def _data(n: int = 103, f: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """Row i of x is i + 0.01 * column, its label is i: every batch row names its sample."""
    x = np.arange(n, dtype=np.float64)[:, None] + 0.01 * np.arange(f)  # (N, F)
    return x, np.arange(n, dtype=np.int64)


def _loader(n: int = 103, batch_size: int = 10, **kw) -> DataLoader:
    x, y = _data(n)
    opts = {"xp": np, "dtype": np.float32, "shuffle": True, "drop_last": False, "seed": 7} | kw
    return DataLoader(x, y, batch_size, **opts)


def _check_rows(xb: np.ndarray, yb: np.ndarray) -> None:
    assert_array_equal(np.round(xb[:, 0]).astype(np.int64), yb)  # features travel with their label


def test_every_sample_exactly_once_per_epoch() -> None:
    loader = _loader()
    assert len(loader) == 11 and loader.num_samples == 103
    for epoch in range(3):
        batches = list(loader.epoch(epoch))
        assert [len(yb) for _, yb in batches] == [10] * 10 + [3]
        for xb, yb in batches:
            _check_rows(xb, yb)
        assert_array_equal(np.sort(np.concatenate([yb for _, yb in batches])), np.arange(103))


def test_drop_last_drops_the_tail() -> None:
    loader = _loader(drop_last=True)
    assert len(loader) == 10
    batches = list(loader.epoch(0))
    assert [len(yb) for _, yb in batches] == [10] * 10
    seen = np.concatenate([yb for _, yb in batches])
    assert len(np.unique(seen)) == 100
    assert_array_equal(seen, loader.permutation(0)[:100])
    assert len(_loader(n=100, drop_last=True)) == len(_loader(n=100)) == 10


@pytest.mark.parametrize(
    ("n", "batch_size", "drop_last", "expected"),
    [(1, 1, False, 1), (9, 10, False, 1), (10, 10, True, 1), (21, 10, True, 2), (21, 10, False, 3), (0, 4, False, 0)],
)
def test_batch_counts(n: int, batch_size: int, drop_last: bool, expected: int) -> None:
    loader = _loader(n=n, batch_size=batch_size, drop_last=drop_last)
    assert len(loader) == expected == len(list(loader))


def test_order_depends_only_on_seed_and_epoch() -> None:
    a, b = _loader(), _loader()
    assert_array_equal(a.permutation(2), b.permutation(2))
    assert_array_equal(a.permutation(2), np.random.default_rng([7, 2]).permutation(103))
    for (xa, ya), (xb, yb) in zip(a.epoch(2), b.epoch(2), strict=True):
        assert_array_equal(ya, yb)
        assert_array_equal(xa, xb)
    assert not np.array_equal(a.permutation(0), a.permutation(1))
    assert not np.array_equal(a.permutation(0), _loader(seed=8).permutation(0))
    assert_array_equal(np.concatenate([yb for _, yb in a]), a.permutation(0))  # __iter__ is epoch 0


def test_no_shuffle_keeps_the_order() -> None:
    loader = _loader(shuffle=False)
    assert_array_equal(loader.permutation(5), np.arange(103))
    assert_array_equal(np.concatenate([yb for _, yb in loader.epoch(5)]), np.arange(103))


def test_start_batch_resumes_the_same_sequence() -> None:
    loader = _loader()
    full = list(loader.epoch(3))
    resumed = list(_loader().epoch(3, start_batch=4))
    assert len(resumed) == len(full) - 4
    for (x0, y0), (x1, y1) in zip(full[4:], resumed, strict=True):
        assert_array_equal(y0, y1)
        assert_array_equal(x0, x1)
    assert list(loader.epoch(3, start_batch=len(loader))) == []


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_batches_are_c_contiguous_with_the_right_dtype(dtype: type) -> None:
    x, y = _data()
    loader = DataLoader(
        np.asfortranarray(x), y.astype(np.int32), 8, xp=np, dtype=dtype, shuffle=True, drop_last=False, seed=0
    )
    assert loader.x.dtype == dtype and loader.x.flags.c_contiguous and loader.y.dtype == np.int64
    for xb, yb in loader.epoch(1):
        assert xb.dtype == dtype and xb.flags.c_contiguous and xb.shape[1] == 5
        assert yb.dtype == np.int64 and yb.flags.c_contiguous and yb.shape == (len(xb),)
        assert not np.shares_memory(xb, loader.x)


@pytest.mark.parametrize("xp_name", ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def test_fortran_ordered_regression_targets_are_stored_in_c_order(xp_name: str) -> None:
    xp = pytest.importorskip(xp_name)
    x, y = _data()
    targets = np.asfortranarray(np.stack([y, 2 * y, 3 * y], axis=1).astype(np.float32))  # (N, 3) as pandas gives
    loader = DataLoader(x, targets, 8, xp=xp, dtype=np.float32, shuffle=True, drop_last=False, seed=0)
    assert loader.y.flags.c_contiguous  # the GPU gathers whole rows of y
    for xb, yb in loader.epoch(2):
        yb = yb if xp is np else xp.asnumpy(yb)
        xb = xb if xp is np else xp.asnumpy(xb)
        _check_rows(xb, yb[:, 0].astype(np.int64))
        assert_array_equal(yb[:, 1:], np.stack([2 * yb[:, 0], 3 * yb[:, 0]], axis=1))


def test_host_arrays_are_copied_once() -> None:
    x, y = _data()
    loader = DataLoader(x, y, 10, xp=np, dtype=np.float64, shuffle=False, drop_last=False, seed=0)
    x[:] = -1.0  # the loader holds its own copy
    _check_rows(*next(iter(loader)))


@pytest.mark.parametrize("batch_size", [0, -3, 2.5, True])
def test_bad_batch_size_is_a_config_error(batch_size: object) -> None:
    with pytest.raises(ConfigError, match=f"batch_size={batch_size!r}"):
        _loader(batch_size=batch_size)


def test_batch_larger_than_dataset_with_drop_last_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="batch_size=64.*no batch for 50 samples"):
        _loader(n=50, batch_size=64, drop_last=True)
    assert len(_loader(n=50, batch_size=64)) == 1  # without drop_last it is one short batch


def test_bad_shapes_and_arguments_are_config_errors() -> None:
    x, y = _data()
    opts = {"xp": np, "dtype": np.float32, "shuffle": True, "drop_last": False}
    with pytest.raises(ConfigError, match=r"x has shape \(103,\)"):
        DataLoader(x[:, 0], y, 4, seed=0, **opts)
    with pytest.raises(ConfigError, match=r"y has shape \(102,\)"):
        DataLoader(x, y[:-1], 4, seed=0, **opts)
    with pytest.raises(ConfigError, match="float"):
        DataLoader(x, y.astype(np.float32), 4, seed=0, **opts)
    with pytest.raises(ConfigError, match="seed=-1"):
        DataLoader(x, y, 4, seed=-1, **opts)
    loader = DataLoader(x, y, 4, seed=0, **opts)
    with pytest.raises(ConfigError, match="start_batch=27"):
        loader.epoch(0, start_batch=27)
    with pytest.raises(ConfigError, match="epoch=-1"):
        loader.epoch(-1)


@pytest.mark.gpu  # skipped without a GPU by tests/conftest.py
def test_cupy_loader_matches_numpy() -> None:
    import cupy

    x, y = _data()
    opts = {"dtype": np.float32, "shuffle": True, "drop_last": False, "seed": 3}
    ref, dev = DataLoader(x, y, 16, xp=np, **opts), DataLoader(x, y, 16, xp=cupy, **opts)
    for (x0, y0), (x1, y1) in zip(ref.epoch(1, 2), dev.epoch(1, 2), strict=True):
        assert isinstance(x1, cupy.ndarray) and x1.flags.c_contiguous and x1.dtype == np.float32
        assert_array_equal(cupy.asnumpy(x1), x0)
        assert_array_equal(cupy.asnumpy(y1), y0)


def test_gathering_into_given_buffers_yields_the_same_batches() -> None:
    """``out``: each batch lands in the arrays the callback hands out (a CUDA graph's inputs)."""
    loader = _loader(shuffle=True)
    bufs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def out(rows: int) -> tuple[np.ndarray, np.ndarray]:
        if rows not in bufs:
            bufs[rows] = (np.full((rows, 5), np.nan, np.float32), np.full(rows, -1, np.int64))
        return bufs[rows]

    fresh = list(loader.epoch(3))
    for (xb, yb), (xf, yf) in zip(loader.epoch(3, out=out), fresh, strict=True):
        assert xb is bufs[len(yb)][0] and yb is bufs[len(yb)][1]
        assert_array_equal(xb, xf)
        assert_array_equal(yb, yf)
    assert sorted(bufs) == [3, 10]  # 103 rows: ten full batches and one of 3
    # a callback returning None means fresh arrays
    for (xb, yb), (xf, yf) in zip(loader.epoch(3, out=lambda rows: None), fresh, strict=True):
        assert not any(xb is b[0] for b in bufs.values())
        assert_array_equal(xb, xf)
        assert_array_equal(yb, yf)


def test_buffers_of_the_wrong_shape_or_dtype_are_refused() -> None:
    loader = _loader()
    for x_buf in (np.zeros((10, 4), np.float32), np.zeros((10, 5), np.float64), np.zeros((9, 5), np.float32)):
        with pytest.raises(ValueError, match=r"do not fit a batch of \(10, 5\) float32 / \(10,\) int64"):
            next(loader.epoch(0, out=lambda rows, x_buf=x_buf: (x_buf, np.zeros(rows, np.int64))))
    with pytest.raises(ValueError, match=r"\(10,\) int32 do not fit"):  # labels of the wrong dtype
        next(loader.epoch(0, out=lambda rows: (np.zeros((rows, 5), np.float32), np.zeros(rows, np.int32))))
