"""Streamed splits (#31, data.residency=stream): rows read from the table and normalised as batches need them.

mlptrain.data.rows.NormalisedRows stands for a split without making it; the host-resident loader gathers
each batch through it. Its rows must be the made split's bit for bit (gather_normalised's arithmetic), so a
streamed run takes the same steps as a resident one.
"""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import make_cfg, records
from numpy.testing import assert_array_equal

from mlptrain.base.errors import ConfigError
from mlptrain.config.schema import DataConfig, DatasetName
from mlptrain.data import load_dataset, prepare
from mlptrain.data.files import chunks
from mlptrain.data.host_loader import HostLoader, residency
from mlptrain.data.loader import DataLoader
from mlptrain.data.rows import NormalisedRows, memory_mapped
from mlptrain.run.run import train
from mlptrain.step import build
from mlptrain.step.trainer import Trainer


def _table(dtype: str, n: int = 3001, f: int = 13) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(n, f)) * 50 + 1e3).astype(dtype)  # (N, F) a large offset: the shift matters
    return x, x.astype(np.float64).mean(axis=0), x.astype(np.float64).std(axis=0) + 0.5


@pytest.mark.parametrize("table_dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("with_rows", [True, False])
def test_taken_rows_are_the_made_splits(table_dtype: str, with_rows: bool) -> None:
    x, shift, scale = _table(table_dtype)
    rows = np.random.default_rng(1).permutation(len(x))[:2000] if with_rows else None
    made = chunks.gather_normalised(x, rows, shift, scale)  # (n, F) float32, the resident path's split
    lazy = NormalisedRows(x, rows, shift, scale)
    assert lazy.shape == made.shape and len(lazy) == len(made) and lazy.dtype == np.float32
    idx = np.random.default_rng(2).permutation(len(made))[:777]
    for dtype in (np.float32, np.float64, np.dtype(ml_dtypes.bfloat16), np.float16):
        out = np.empty((777, x.shape[1]), dtype)
        lazy.as_dtype(dtype).take(idx, out)
        want = made[idx].astype(dtype)  # the made split cast to the compute dtype, as a loader does
        assert_array_equal(out.view(np.uint8), want.view(np.uint8))
    assert_array_equal(lazy[10:20], made[10:20])
    assert_array_equal(np.asarray(lazy.subset(slice(5, 900))), made[5:900])
    assert_array_equal(np.asarray(lazy), made)


def test_a_wrong_buffer_or_index_is_refused() -> None:
    x, shift, scale = _table("float32")
    lazy = NormalisedRows(x, None, shift, scale)
    with pytest.raises(ValueError, match=r"out \(5, 12\) for 5 rows of 13 features"):
        lazy.take(np.arange(5), np.empty((5, 12), np.float32))
    with pytest.raises(TypeError, match="only a slice"):
        lazy[3]


def _npz(tmp_path: Path, n: int = 4000) -> Path:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, n)
    x = (rng.normal(size=(n, 9)) + y[:, None] * 0.7 + 100.0).astype(np.float32)
    path = tmp_path / "table.npz"
    np.savez(path, x=x, y=y)  # stored uncompressed: its x is memory-mapped where it lies in the zip
    return path


def _file_cfg(path: Path, residency: str) -> DataConfig:
    cfg = DataConfig()
    cfg.name = DatasetName.file
    cfg.path = str(path)
    cfg.residency = residency
    return cfg


def test_a_streamed_load_has_the_made_loads_splits(tmp_path: Path) -> None:
    path = _npz(tmp_path)
    made, streamed = (load_dataset(_file_cfg(path, r)) for r in ("device", "stream"))
    for split in ("train", "val", "test"):
        lazy = getattr(streamed, f"x_{split}")
        assert isinstance(lazy, NormalisedRows) and memory_mapped(lazy.table)
        assert_array_equal(np.asarray(lazy), getattr(made, f"x_{split}"))
        assert_array_equal(getattr(streamed, f"y_{split}"), getattr(made, f"y_{split}"))
    assert not isinstance(made.x_train, NormalisedRows)


def test_auto_streams_a_memory_mapped_table_only_where_its_splits_do_not_fit_host_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = _npz(tmp_path)
    assert not isinstance(load_dataset(_file_cfg(path, "auto")).x_train, NormalisedRows)  # 144 kB: made
    monkeypatch.setattr(prepare, "host_memory_available", lambda: 100_000)  # 50 kB for the splits
    with caplog.at_level("INFO", logger="mlptrain.data.prepare"):
        ds = load_dataset(_file_cfg(path, "auto"))
    assert isinstance(ds.x_train, NormalisedRows)
    assert "would take more than 50% of the host memory available" in caplog.text
    assert not isinstance(load_dataset(_file_cfg(path, "device")).x_train, NormalisedRows)  # device: always made
    digits = DataConfig()  # a table in memory, not memory-mapped: made whatever the memory
    assert not isinstance(load_dataset(digits).x_train, NormalisedRows)


def test_streamed_splits_are_host_resident_and_refused_on_the_device(tmp_path: Path) -> None:
    ds = load_dataset(_file_cfg(_npz(tmp_path), "stream"))
    cfg = _file_cfg(tmp_path / "table.npz", "auto")
    assert residency(cfg, ds, np, np.dtype(np.float32)) == "host"
    train_loader, evaluation = build.loaders(cfg, ds, np, np.float32, seed=0)
    assert isinstance(train_loader, HostLoader) and all(isinstance(v, HostLoader) for v in evaluation.values())
    with pytest.raises(ConfigError, match="data.residency=device, but dataset file's splits are streamed"):
        residency(_file_cfg(tmp_path / "table.npz", "device"), ds, np, np.dtype(np.float32))


def test_a_streamed_loaders_batches_are_the_resident_loaders(tmp_path: Path) -> None:
    ds = load_dataset(_file_cfg(_npz(tmp_path), "stream"))
    made = np.asarray(ds.x_train)
    opts = dict(xp=np, dtype=np.float32, shuffle=True, drop_last=False, seed=3)
    resident, streamed = DataLoader(made, ds.y_train, 256, **opts), HostLoader(ds.x_train, ds.y_train, 256, **opts)
    assert isinstance(streamed.x, NormalisedRows)  # not made by the loader either
    for epoch in range(2):
        pairs = list(zip(resident.epoch(epoch), streamed.epoch(epoch), strict=True))
        assert len(pairs) == -(-len(made) // 256)
        for (xa, ya), (xb, yb) in pairs:
            assert_array_equal(xa, xb)
            assert_array_equal(ya, yb)


def test_a_streamed_run_writes_the_resident_runs_records(tmp_path: Path) -> None:
    train(make_cfg(epochs=2), tmp_path / "device")
    train(make_cfg(epochs=2, data__residency="stream"), tmp_path / "stream")
    got, want = records(tmp_path / "stream"), records(tmp_path / "device")
    assert [r for r in got if r["kind"] == "step"] == [r for r in want if r["kind"] == "step"]
    assert [r for r in got if r["kind"] == "epoch"] == [r for r in want if r["kind"] == "epoch"]
    assert isinstance(Trainer(make_cfg(data__residency="stream")).train_loader.x, NormalisedRows)


def test_a_streamed_runs_checkpoint_scores_its_own_split_as_the_run_did(tmp_path: Path) -> None:
    from mlptrain.cli.evaluate import EvaluateArgs, evaluate

    summary = train(make_cfg(epochs=1, data__residency="stream"), tmp_path / "run")
    report, _ = evaluate(EvaluateArgs(ckpt=str(tmp_path / "run" / "checkpoints" / "last.npz"), device="cpu"))
    assert report["samples"] == 359  # digits' test split (20% of 1,797), read again streamed (its data config)
    np.testing.assert_allclose(report["loss"], summary["test/loss"], rtol=1e-6)
