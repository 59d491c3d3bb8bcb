"""Tests of mlptrain.data.loader.DataLoader: coverage, order, resume, layout and validation."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from mlptrain.base.errors import ConfigError
from mlptrain.data.loader import DataLoader


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


# --- the copy to the device in chunks through two staging buffers (mlptrain.data.cuda.upload, host half) ----


def _staged_copy(x: np.ndarray, dtype: object, chunk_bytes: int, buffers: int = 2) -> tuple[np.ndarray, list]:
    """copy_in_chunks against a stand-in device whose copies read their buffer only later (a DMA): a
    buffer refilled before its copy was waited for would deliver the next chunk's rows."""
    from mlptrain.data.cuda.upload import copy_in_chunks, plan

    dtype = np.dtype(dtype)
    out = np.full(x.shape, 99, dtype)
    parts = plan(len(x), int(np.prod(x.shape[1:])) * dtype.itemsize, chunk_bytes)
    rows = max(b - a for a, b in parts)
    bufs = [np.empty((rows, *x.shape[1:]), dtype) for _ in range(min(buffers, len(parts)))]
    queued: dict[int, tuple[np.ndarray, int, int]] = {}
    events: list = []

    def land(k: int) -> None:  # the copy queued from buffer k reads it now
        if k in queued:
            staged, a, b = queued.pop(k)
            out[a:b] = staged

    def wait(k: int) -> None:
        events.append(("wait", k))
        land(k)

    def send(k: int, staged: np.ndarray, a: int, b: int) -> None:
        assert staged.base is bufs[k] or staged is bufs[k] or np.shares_memory(staged, bufs[k])
        events.append(("send", k, a, b))
        queued[k] = (staged, a, b)

    copy_in_chunks(x, parts, bufs, wait, send)
    for k in list(queued):  # the final synchronize
        land(k)
    return out, events


def _bfloat16() -> object:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return ml_dtypes.bfloat16


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16", np.int64])
@pytest.mark.parametrize("layout", ["C", "F", "strided", "3-D"])
@pytest.mark.parametrize("chunk_bytes", [1, 100, 4096, 1 << 20])
def test_the_staged_copy_equals_a_whole_cast(dtype: object, layout: str, chunk_bytes: int) -> None:
    dtype = _bfloat16() if dtype == "bfloat16" else dtype
    rng = np.random.default_rng(3)
    base = rng.standard_normal((203, 14)) * 50
    x = {"C": base, "F": np.asfortranarray(base), "strided": base[::2, 1::3], "3-D": base.reshape(203, 7, 2)}[layout]
    got, events = _staged_copy(x, dtype, chunk_bytes)
    want = np.array(x, dtype=dtype, order="C")
    assert got.tobytes() == want.tobytes()  # byte for byte: the cast is x.astype's
    sends = [e for e in events if e[0] == "send"]
    assert [e[2] for e in sends] == sorted(e[2] for e in sends) and sends[-1][3] == len(x)
    assert {e[1] for e in sends} == ({0} if len(sends) == 1 else {0, 1}), "two buffers in turn"


def test_the_plan_covers_every_row_in_chunks_of_at_most_the_buffer() -> None:
    from mlptrain.data.cuda.upload import plan

    assert plan(10, 4, 12) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert plan(3, 100, 10) == [(0, 1), (1, 2), (2, 3)]  # a row larger than the buffer: one per chunk
    assert plan(0, 8, 64) == [] and plan(5, 0, 64) == [(0, 5)]
    for rows, row_bytes, chunk in [(1, 1, 1), (1000, 1024, 64 << 20), (600_000, 1024, 64 << 20), (7, 3, 8)]:
        parts = plan(rows, row_bytes, chunk)
        assert parts[0][0] == 0 and parts[-1][1] == rows
        assert all(a == b_prev for (a, _), (_, b_prev) in zip(parts[1:], parts[:-1], strict=True))
        assert all(0 < (b - a) * row_bytes <= max(chunk, row_bytes) for a, b in parts)
    with pytest.raises(ValueError, match="expected sizes"):
        plan(-1, 4, 8)
