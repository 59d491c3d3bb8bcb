"""The data path in chunks (#31): statistics against a float64 two-pass reference, chunk boundaries,
the splits equal to the straightforward formula, the cache's checksum and version."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from mlptrain.base.errors import DatasetError
from mlptrain.config.schema import DataConfig, DatasetName
from mlptrain.data import load_dataset
from mlptrain.data.dataset import Normalization
from mlptrain.data.files import cache, chunks
from mlptrain.data.files.column_stats import column_stats
from mlptrain.data.prepare import normalization, stratified_split


def reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and population std in float64, two passes over the whole table, each sum exact (math.fsum)."""
    x64 = np.asarray(x, np.float64)
    mean = np.array([math.fsum(c) for c in x64.T]) / len(x64)
    return mean, np.sqrt(np.array([math.fsum(c) for c in ((x64 - mean) ** 2).T]) / len(x64))


def table(n: int = 1000, f: int = 5, dtype=np.float32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, f)) * rng.uniform(0.01, 10, f) + rng.uniform(-5, 5, f)  # (n, F)
    return x.astype(dtype)


@pytest.mark.parametrize("chunk", [1, 7, 64, 999, 1000, 5000])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_statistics_equal_a_float64_two_pass_reference_for_any_chunk(chunk: int, dtype) -> None:
    x = table(dtype=dtype)
    before = x.copy()
    st = column_stats(x, chunk=chunk, extremes=True)
    mean, std = reference(x)
    assert st.count == 1000 and st.nonfinite is None
    assert_allclose(st.mean, mean, rtol=1e-13, atol=1e-13)
    assert_allclose(st.std, std, rtol=1e-12)
    assert_array_equal(st.low, x.min(axis=0).astype(np.float64))
    assert_array_equal(st.high, x.max(axis=0).astype(np.float64))
    assert_array_equal(x, before)  # the table is read, never written (a float64 chunk is not a view of it)


def test_one_chunk_is_numpys_mean_and_std_bit_for_bit() -> None:
    x = table(300, 8, np.float32)
    st = column_stats(x)
    assert_array_equal(st.mean, x.mean(axis=0, dtype=np.float64))
    assert_array_equal(st.std, x.std(axis=0, dtype=np.float64))


def test_large_offsets_and_constant_columns() -> None:
    rng = np.random.default_rng(3)
    x = np.empty((10_001, 3))
    x[:, 0] = 1e6 + 1e-3 * rng.standard_normal(len(x))  # cancellation: sum(x**2) - n mean**2 would lose it
    x[:, 1] = 7.25  # constant: std exactly 0
    x[:, 2] = 1e9 + rng.integers(0, 2, len(x))
    st = column_stats(x, chunk=97)
    mean, std = reference(x)
    assert_allclose(st.mean, mean, rtol=1e-15)
    # column 0's condition number is mean / std = 1e9: float64 leaves ~1e-7 of its std's digits (eps * 1e9)
    assert_allclose(st.std[[0, 2]], std[[0, 2]], rtol=1e-8)
    naive = np.sqrt(np.maximum((x**2).mean(axis=0) - x.mean(axis=0) ** 2, 0))  # one pass of raw sums: ruined
    assert not np.allclose(naive[0], std[0], rtol=1e-2)
    assert st.std[1] == 0.0 and st.mean[1] == 7.25
    norm = normalization("standard", x)  # a constant column is centred, not scaled (as before)
    assert norm.scale[1] == 1.0 and norm.shift[1] == 7.25


@pytest.mark.parametrize("n, chunk", [(1, 1), (1, 4), (2, 1), (17, 4), (40, 64)])
def test_chunk_boundaries_and_a_subset_of_rows(n: int, chunk: int) -> None:
    x = table(40, 3, np.float64)
    rows = np.random.default_rng(n).permutation(40)[:n]
    st = column_stats(x, rows, chunk=chunk)
    mean, std = reference(x[rows])
    assert st.count == n
    assert_allclose(st.mean, mean, rtol=1e-14, atol=1e-15)
    assert_allclose(st.std, std, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("chunk", [13, None])
def test_narrow_floats_with_large_offsets_and_constant_columns(dtype, chunk: int | None) -> None:
    """float16 and float32 tables as saved (an NPZ keeps them): each value widened exactly to float64,
    so the statistics equal the float64 reference of the same values, offsets and all."""
    rng = np.random.default_rng(11)
    n = 5003
    x = np.empty((n, 4), dtype)
    big = 1e6 if dtype == np.float32 else 2048.0  # float16: ulp 2 at 2048 (its largest exact integers: 2**11)
    x[:, 0] = big + rng.integers(-3, 4, n) * (0.0625 if dtype == np.float32 else 2.0)  # exact in dtype
    x[:, 1] = dtype(-3.5)  # constant
    x[:, 2] = rng.standard_normal(n) * 1e-3  # tiny spread near zero
    x[:, 3] = np.finfo(dtype).max / 2 * np.sign(rng.standard_normal(n))  # large magnitudes: float64 sums hold them
    st = column_stats(x, chunk=chunk, extremes=True)
    mean, std = reference(x)
    assert_allclose(st.mean, mean, rtol=1e-14, atol=1e-18)
    assert_allclose(st.std[[0, 2, 3]], std[[0, 2, 3]], rtol=1e-10)
    assert st.std[1] == 0.0 and st.mean[1] == -3.5 and st.low[1] == st.high[1] == -3.5
    norm = normalization("standard", x)
    assert norm.scale[1] == 1.0 and norm.shift[1] == -3.5  # constant: centred only
    assert_allclose(norm.shift[0], mean[0], rtol=1e-14)


def test_an_unaligned_memory_mapped_table_is_checked_as_an_aligned_one(tmp_path: Path) -> None:
    """An NPZ member starts wherever the zip puts it: float32 items off their 4-byte boundary."""
    x = table(300, 7, np.float32)
    raw = np.zeros(x.nbytes + 1, np.uint8)
    raw[1:] = x.view(np.uint8).reshape(-1)
    mapped = raw[1:].view(np.float32).reshape(x.shape)  # the same values, unaligned
    assert not mapped.flags.aligned
    assert chunks.first_nonfinite(mapped, chunk=7) is None and chunks.max_abs(mapped, chunk=7) == np.abs(x).max()
    raw[1 + 4 * (7 * 123 + 5) : 1 + 4 * (7 * 123 + 6)] = np.array([np.nan], np.float32).view(np.uint8)
    assert chunks.first_nonfinite(mapped, chunk=7) == (123, 5)
    norm = normalization("standard", x)
    assert_array_equal(
        chunks.gather_normalised(mapped, None, norm.shift, norm.scale, chunk=7)[:123], norm.apply(x)[:123]
    )


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_the_first_nonfinite_cell_is_named_in_the_rows_order(bad: float, chunk: int) -> None:
    x = table(20, 4, np.float16)
    x[13, 2] = bad
    x[15, 0] = np.nan
    assert column_stats(x, chunk=chunk).nonfinite == (13, 2)
    rows = np.array([15, 2, 13])
    assert column_stats(x, rows, chunk=chunk).nonfinite == (0, 0)
    assert chunks.first_nonfinite(x, chunk=chunk) == (13, 2)
    with pytest.raises(DatasetError, match=r"split train: row 2, column 2 holds (nan|-?inf)"):
        normalization("standard", x, np.array([1, 2, 13]), "dataset 'd' split train")


@pytest.mark.parametrize("method", ["standard", "minmax", "none"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.uint8])
def test_the_split_normalised_in_chunks_is_the_straightforward_formula(method: str, dtype) -> None:
    x = (table(501, 6, np.float64) * 20 + 100).astype(dtype)
    rows = np.random.default_rng(1).permutation(501)[:333]
    norm = normalization(method, x, rows)
    want = Normalization(method, norm.shift, norm.scale).apply(x[rows])  # gather, then normalise whole
    for chunk in (1, 10, 333, None):
        got = chunks.gather_normalised(x, rows, norm.shift, norm.scale, chunk=chunk)
        assert got.dtype == np.float32 and got.flags.c_contiguous
        assert_array_equal(got, want)
    assert_array_equal(chunks.gather_normalised(x, None, norm.shift, norm.scale, chunk=7), norm.apply(x))


def test_chunked_max_abs_and_first_nonfinite_of_good_data() -> None:
    x = table(100, 3, np.float64)
    x[57, 1] = -1e300
    assert chunks.max_abs(x, chunk=8) == 1e300
    assert chunks.first_nonfinite(x, chunk=8) is None
    assert chunks.run(lambda p: p[1] - p[0], chunks.ranges(10, 3)) == [3, 3, 3, 1]


def sequential_checksum(a: np.ndarray) -> str:
    """The checksum's definition, one block after another (the cache's first implementation)."""
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    whole = len(raw) // 8 * 8
    words = raw[:whole].view(np.uint64)
    s1, s2 = np.uint64(len(raw)), np.uint64(int.from_bytes(bytes(raw[whole:]), "little"))
    with np.errstate(over="ignore"):
        for start in range(0, len(words), cache._BLOCK):
            block = words[start : start + cache._BLOCK]
            s1 = s1 * np.uint64(0x9E3779B97F4A7C15) + np.add.reduce(block, dtype=np.uint64)
            s2 = s2 * np.uint64(0xC2B2AE3D27D4EB4F) + np.add.reduce(block * cache._WEIGHTS[: len(block)])
    return f"{int(s1):016x}{int(s2):016x}"


def test_the_parallel_checksum_is_the_sequential_one() -> None:
    a = np.random.default_rng(2).standard_normal(3 * cache._BLOCK + 5).astype(np.float32)  # blocks and a tail
    assert cache.checksum(a) == sequential_checksum(a)
    assert cache.checksum(a[:-1]) == sequential_checksum(a[:-1]) != cache.checksum(a)


def write_npz(path: Path, n: int = 300, dtype=np.float32, compressed: bool = False) -> np.ndarray:
    rng = np.random.default_rng(5)
    y = rng.integers(0, 3, n)
    x = (rng.standard_normal((n, 4)) + y[:, None]).astype(dtype)
    (np.savez_compressed if compressed else np.savez)(path, x=x, y=y)
    return x


def test_an_npz_table_is_cached_in_its_dtype_and_an_older_entry_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "cache"))
    x = write_npz(tmp_path / "d.npz", compressed=True)  # a stored one is memory-mapped in place, not cached
    cfg = DataConfig(name=DatasetName.file, path=str(tmp_path / "d.npz"), target="y")
    first = load_dataset(cfg)
    (folder,) = (tmp_path / "cache" / "tables").iterdir()
    assert np.load(folder / "train_x.npy").dtype == np.float32
    assert_array_equal(np.load(folder / "train_x.npy"), x)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "version": 2}))  # an entry of the previous layout
    with caplog.at_level(logging.INFO, logger="mlptrain.data"):
        again = load_dataset(cfg)
    assert "older mlptrain" in caplog.text and "rebuilt" in caplog.text, caplog.text
    for phase in ("data read:", "data statistics:", "data split:", "data normalise:", "data cache write:"):
        assert phase in caplog.text, phase
    assert json.loads((folder / "meta.json").read_text())["version"] == cache.VERSION
    assert_array_equal(again.x_train, first.x_train)
    assert_array_equal(again.normalization.shift, first.normalization.shift)


def test_a_load_equals_the_straightforward_split_then_normalise(tmp_path: Path, monkeypatch) -> None:
    """Today's load against the formula it replaced: gather each split whole, x.mean / x.std in float64, apply."""
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "cache"))
    x = write_npz(tmp_path / "d.npz", 2000, np.float16)
    y = np.load(tmp_path / "d.npz")["y"]
    ds = load_dataset(DataConfig(name=DatasetName.file, path=str(tmp_path / "d.npz"), target="y"))
    rng = np.random.default_rng([0, 0xDA7A])  # load_dataset's split stream (data.split_seed=0)
    keep, test = stratified_split(y, 0.2, rng)
    train, val = stratified_split(y[keep], 0.1, rng)
    x64 = x.astype(np.float64)
    x_train, x_val, x_test = x64[keep][train], x64[keep][val], x64[test]
    scale = x_train.std(axis=0, dtype=np.float64)
    floor = max(1e-6, 0.1 * float(np.median(scale)))
    old = Normalization("standard", x_train.mean(axis=0, dtype=np.float64), np.where(scale < floor, 1.0, scale))
    assert_array_equal(ds.normalization.shift, old.shift)  # one chunk: NumPy's sums, bit for bit
    assert_array_equal(ds.normalization.scale, old.scale)
    splits = [(ds.x_train, x_train, ds.y_train, keep[train]), (ds.x_val, x_val, ds.y_val, keep[val])]
    for got, want, labels, rows in [*splits, (ds.x_test, x_test, ds.y_test, test)]:
        assert_array_equal(got, old.apply(want))
        assert_array_equal(labels, y[rows])
