"""data=file: the user's own CSV, TSV, NPZ and Parquet files; labels, regression, the cache, bad files."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg
from numpy.testing import assert_array_equal

from mlptrain.base.errors import ConfigError, DatasetError
from mlptrain.config.schema import DataConfig, DatasetName, Task
from mlptrain.data import load_dataset
from mlptrain.data.files import cache as data_cache
from mlptrain.data.files.readers import arrow_available, read_table, write_csv
from mlptrain.run import checkpoint
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train

REPO = Path(__file__).resolve().parent.parent
needs_arrow = pytest.mark.skipif(not arrow_available(), reason="pyarrow is not installed (the arrow extra)")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own cache folder (MLPTRAIN_DATA)."""
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "cache"))
    return tmp_path / "cache"


def rows(n: int = 120, seed: int = 0, labels: Any = ("bird", "cat", "dog")) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of 4 features whose class is readable from them (an MLP learns it), and their labels."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % len(labels)
    x = rng.standard_normal((n, 4)) + 3.0 * np.eye(len(labels), 4)[y]
    return x, np.asarray(labels)[y]


def write(path: Path, x: np.ndarray, y: np.ndarray, *, target: str = "label", sep: str = ",") -> Path:
    lines = [sep.join([*(f"f{j}" for j in range(x.shape[1])), target])]
    lines += [sep.join([*(repr(v) for v in r), str(label)]) for r, label in zip(x.tolist(), y.tolist(), strict=True)]
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def file_cfg(path: Path, **overrides: Any) -> Any:
    cfg = make_cfg(**{"epochs": 3, **overrides})
    cfg.data.name = DatasetName.file
    cfg.data.path = str(path)
    cfg.data.batch_size = 32
    return cfg


# --- formats --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["csv", "tsv", "csv.gz", "npz", "parquet", "csv-arrow"])
def test_every_format_reads_the_same_rows(tmp_path: Path, fmt: str) -> None:
    x, y = rows()
    if fmt == "npz":
        path = tmp_path / "d.npz"
        np.savez(path, x=x, y=y)
    elif fmt == "parquet":
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        path = tmp_path / "d.parquet"
        pq.write_table(pa.table({**{f"f{j}": x[:, j] for j in range(4)}, "label": y}), path)
    else:
        path = write(tmp_path / f"d.{fmt.split('-')[0]}", x, y, sep="\t" if fmt == "tsv" else ",")
    if fmt == "csv-arrow" and not arrow_available():
        pytest.skip("pyarrow is not installed")
    reader = "arrow" if fmt == "csv-arrow" else "numpy"
    table, test = read_table(path, "label", reader=reader)
    assert test is None
    assert_array_equal(table.x, x)  # exact: repr() round-trips every float
    assert_array_equal(table.y, y)
    assert table.feature_names == ([f"f{j}" for j in range(4)] if fmt != "npz" else ["x0", "x1", "x2", "x3"])


def test_npz_with_a_test_split_and_string_labels_trains_and_keeps_the_class_names(tmp_path: Path) -> None:
    x, y = rows(150)
    xt, yt = rows(30, seed=1)
    np.savez(tmp_path / "d.npz", x=x, y=y, x_test=xt, y_test=yt)
    summary = train(file_cfg(tmp_path / "d.npz", epochs=8), tmp_path / "run")
    assert summary["test/acc"] > 0.9
    ds = load_dataset(file_cfg(tmp_path / "d.npz").data)
    assert ds.class_names == ["bird", "cat", "dog"] and len(ds.x_test) == 30  # the file's own test split
    data = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.npz").meta["data"]
    assert data["class_names"] == ["bird", "cat", "dog"] and data["task"] == "classification"
    assert data["feature_names"] == ["x0", "x1", "x2", "x3"]


def test_integer_labels_that_are_not_0_to_c_are_mapped_and_named(tmp_path: Path) -> None:
    x, y = rows(90, labels=(3, 7, 9))
    ds = load_dataset(DataConfig(name=DatasetName.file, path=str(write(tmp_path / "d.csv", x, y))))
    assert ds.class_names == ["3", "7", "9"] and ds.num_classes == 3 and set(ds.y_train) == {0, 1, 2}


def test_regression_on_two_target_columns(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 5))
    t = np.stack([x @ [1.0, -2.0, 0.5, 0.0, 1.0], np.sin(x[:, 0])], axis=1)  # (N, 2)
    header = "a,b,c,d,e,y1,y2"
    body = "\n".join(",".join(repr(v) for v in row) for row in np.hstack([x, t]).tolist())
    (tmp_path / "r.csv").write_text(header + "\n" + body + "\n")
    cfg = file_cfg(tmp_path / "r.csv", epochs=30, model__loss="mse", optimizer__lr=0.01)
    cfg.data.target = ["y1", "y2"]
    summary = train(cfg, tmp_path / "run")
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    epochs = [r for r in recs if r["kind"] == "epoch"]
    assert epochs[-1]["val/loss"] < 0.2 * epochs[0]["val/loss"]  # it learned the targets
    assert not any("train/acc" in r or "val/acc" in r for r in recs), "no accuracy for a regression"
    assert summary["test/loss"] < 0.5
    meta = checkpoint.load(tmp_path / "run" / "checkpoints" / "best.npz").meta
    assert meta["best"]["metric"] == "val/loss" and meta["best"]["mode"] == "min"
    assert meta["data"]["task"] == "regression" and meta["data"]["target_names"] == ["y1", "y2"]
    cfg.model.loss = "cross_entropy"
    with pytest.raises(ConfigError, match=r"is a regression \(targets y1, y2\) but model.loss=cross_entropy; set mod"):
        train(cfg, tmp_path / "run2")


@pytest.mark.parametrize("bgrad", ["drelu_bgrad", "bgradb"])
def test_regression_on_one_target_column_trains_fused_as_naive(tmp_path: Path, bgrad: str) -> None:
    """One output: the output layer's input-gradient GEMM has K = 1, which the dReLU epilogs reject."""
    from mlptrain.config.schema import Bgrad, Mode

    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 4))
    y = x @ [1.0, -2.0, 0.5, 0.0] + 0.1 * rng.standard_normal(300)
    write(tmp_path / "r.csv", x, y, target="y")
    losses = {}
    for mode in (Mode.fused, Mode.naive):
        cfg = file_cfg(tmp_path / "r.csv", epochs=4, model__loss="mse", model__hidden=[16, 8], execution__mode=mode)
        cfg.data.target = "y"
        if mode is Mode.fused:
            cfg.execution.bgrad = Bgrad(bgrad)
        train(cfg, tmp_path / f"run-{mode.value}")
        recs = read_metrics(tmp_path / f"run-{mode.value}" / "metrics.jsonl")
        losses[mode] = [r["train/loss"] for r in recs if r["kind"] == "step"]
    np.testing.assert_allclose(losses[Mode.fused], losses[Mode.naive], rtol=1e-5)
    assert losses[Mode.fused][-1] < 0.2 * losses[Mode.fused][0]  # it learned


def test_task_auto_reads_fractional_values_as_a_regression(tmp_path: Path) -> None:
    x, _ = rows(60)
    ds_cfg = DataConfig(name=DatasetName.file, path=str(write(tmp_path / "d.csv", x, x[:, 0] * 0.5)))
    assert load_dataset(ds_cfg).task == "regression"
    ds_cfg.task = Task.classification
    with pytest.raises(DatasetError, match="is not a whole number"):
        load_dataset(ds_cfg)


# --- bad files -------------------------------------------------------------------------------------


def _bad(tmp_path: Path, kind: str) -> tuple[Path, dict[str, Any], list[str]]:
    """A bad data file of ``kind``: its path, config overrides, and phrases the error must hold."""
    x, y = rows(30)
    p = tmp_path / "bad.csv"
    csv = write(tmp_path / "good.csv", x, y).read_text().splitlines(keepends=True)
    over: dict[str, Any] = {}
    if kind == "missing":
        return tmp_path / "nowhere.csv", over, ["does not exist"]
    if kind == "empty":
        p.write_text("")
        return p, over, ["is empty"]
    if kind == "no header":
        p.write_text("".join(csv[1:]))
        return p, over, ["has no header row: line 1 holds numbers"]
    if kind == "no target":
        over["data.target"] = "class"
        p.write_text("".join(csv))
        return p, over, ["has no column 'class' (data.target); its columns are f0, f1, f2, f3, label"]
    if kind == "ragged":
        csv[7] = ",".join(csv[7].split(",")[:-2]) + "\n"
        p.write_text("".join(csv))
        return p, over, ["line 8 has 3 fields, the header has 5"]
    if kind == "text feature":  # a column of numbers in the training file, of text in the test file
        p.write_text("".join(csv))
        cells = csv[5].split(",")
        cells[2] = "abc"
        csv[5] = ",".join(cells)
        over["data.test_path"] = str(tmp_path / "test.csv")
        (tmp_path / "test.csv").write_text("".join(csv))
        return p, over, ["test.csv line 6, column 'f2': 'abc' is not a number; the column was numeric in the training"]
    if kind == "nan feature":  # refused with data.impute=error (fill: the training median and a _missing column)
        cells = csv[12].split(",")
        cells[1] = "nan"
        csv[12] = ",".join(cells)
        p.write_text("".join(csv))
        over["data.impute"] = "error"
        return p, over, ["line 13, column 'f1': an empty cell (1 in the column)"]
    if kind == "inf target":
        rng = np.random.default_rng(0)
        t = rng.standard_normal(30)
        t[4] = np.inf
        write(p, x, t)
        return p, over, ["line 6, column 'label': inf is not a finite number; targets must be finite"]
    if kind == "one class":
        write(p, x, np.array(["cat"] * 30))
        return p, over, ["holds one class only (cat)"]
    if kind == "test columns":
        over["data.test_path"] = str(write(tmp_path / "test.csv", x[:, :3], y))
        p.write_text("".join(csv))
        return p, over, ["test file", "has the columns ['f0', 'f1', 'f2', 'label']", "they must be the same"]
    if kind == "unseen label":
        y_test = y.astype("<U8")
        y_test[3] = "zebra"
        over["data.test_path"] = str(write(tmp_path / "test.csv", x, y_test))
        p.write_text("".join(csv))
        return p, over, ["test.csv line 5: label 'zebra' is not among the training labels (bird, cat, dog)"]
    if kind == "npz without y":
        p = tmp_path / "bad.npz"
        np.savez(p, x=x, labels=y)
        return p, over, ["holds the arrays labels, x; an NPZ dataset needs 'x'"]
    if kind == "unknown format":
        p = tmp_path / "bad.xlsx"
        p.write_text("x")
        return p, over, ["unknown format; expected a file ending in .csv"]
    if kind == "directory":
        p = tmp_path / "dir.csv"
        p.mkdir()
        return p, over, ["is a directory, not a regular file"]
    raise AssertionError(kind)


BAD = [
    "missing",
    "empty",
    "no header",
    "no target",
    "ragged",
    "text feature",
    "nan feature",
    "inf target",
    "one class",
    "test columns",
    "unseen label",
    "npz without y",
    "unknown format",
    "directory",
]


@pytest.mark.parametrize("reader", ["numpy", "arrow"])
@pytest.mark.parametrize("kind", BAD)
def test_a_bad_file_is_one_clear_error_and_nothing_is_written(
    tmp_path: Path, kind: str, reader: str, monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    if reader == "arrow" and not arrow_available():
        pytest.skip("pyarrow is not installed")
    monkeypatch.setattr("mlptrain.data.files.readers.arrow_available", lambda: reader == "arrow")
    path, over, phrases = _bad(tmp_path, kind)
    cfg = file_cfg(path)
    for key, value in over.items():
        setattr(cfg.data, key.split(".")[1], value)
    if kind == "inf target":
        cfg.model.loss = "mse"
    with pytest.raises(DatasetError) as err:
        train(cfg, tmp_path / "run")
    msg = str(err.value)
    assert str(path.name) in msg or "test.csv" in msg, msg
    for phrase in phrases:
        assert phrase in msg, msg
    assert not (tmp_path / "run").exists(), "a refused run leaves no run directory"
    assert not cache_dir.exists() or not any(cache_dir.rglob("*.npy")), "nothing cached of a bad file"


# --- the cache ---------------------------------------------------------------------------------------


def test_a_second_read_comes_from_the_memory_mapped_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = rows(200)
    path = write(tmp_path / "d.csv", x, y)
    first, _ = data_cache.read_cached(path, "label")
    parsed = []
    monkeypatch.setattr(data_cache, "read_table", lambda *a, **k: parsed.append(a) or pytest.fail("parsed again"))
    second, _ = data_cache.read_cached(path, "label")
    assert isinstance(second.x, np.memmap) and not parsed
    assert_array_equal(second.x, first.x) and second.feature_names == first.feature_names
    assert_array_equal(second.y, first.y)
    os.utime(path, (1, 1))  # touched: another time, the same bytes: recognised by its SHA-256
    third, _ = data_cache.read_cached(path, "label")
    assert_array_equal(third.x, x)
    monkeypatch.undo()
    write(path, x + 1, y)  # changed: parsed again
    changed, _ = data_cache.read_cached(path, "label")
    assert_array_equal(changed.x, x + 1)


# --- a real dataset through data=file ------------------------------------------------------------


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "mlptrain", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_digits_written_to_csv_and_npz_train_to_the_same_test_accuracy(tmp_path: Path) -> None:
    """The bundled digits, written out as files in their own row order: data=file splits them as digits is split
    (same data.split_seed) and, with digits' recipe (data=file's own is a table's: Adam, batches of 200, early
    stopping on val/loss, PyTorch's initialisation), the run reaches the same test accuracy, exactly."""
    from mlptrain.data.sources import _load_digits

    raw = _load_digits(DataConfig(), np.random.default_rng(0))
    write_csv(tmp_path / "digits.csv.gz", raw.x, raw.y, raw.feature_names or [], target="digit")
    np.savez(tmp_path / "digits.npz", x=raw.x, y=raw.y)
    common = ["device=cpu", "progress=false", "epochs=5"]
    builtin = _cli(*common, f"hydra.run.dir={tmp_path / 'builtin'}", cwd=tmp_path)
    assert builtin.returncode == 0, builtin.stderr
    want = json.loads((tmp_path / "builtin" / "metrics.jsonl").read_text().splitlines()[-1])["test/acc"]
    for name, target in (("digits.csv.gz", "digit"), ("digits.npz", "label")):
        run = tmp_path / name.split(".")[1]
        proc = _cli(
            *common,
            "data=file",
            f"data.path={tmp_path / name}",
            f"data.target={target}",
            "data.batch_size=64",
            "optimizer=sgd",
            "early_stopping.patience=0",
            "early_stopping.metric=auto",
            "model.init=he",
            f"hydra.run.dir={run}",
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr
        summary = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
        assert summary["test/acc"] == want, (name, summary["test/acc"], want)


def test_a_dataset_too_large_for_the_device_names_its_size_and_the_free_memory() -> None:
    from mlptrain.base.errors import ResourceError
    from mlptrain.data.host_loader import check_device_memory

    ds = load_dataset(DataConfig(name=DatasetName.synthetic, samples=1000, features=100))
    check_device_memory(ds, np.dtype(np.float32), free=10**9, total=2 * 10**9)  # 0.4 MB: fits
    with pytest.raises(ResourceError) as err:
        check_device_memory(ds, np.dtype(np.float32), free=300_000, total=80 * 2**30)
    msg = str(err.value)
    assert "dataset 'synthetic' (1,000 rows x 100 features in float32) needs 0.4 MiB" in msg
    assert "more than the 0.3 MiB free of 80.00 GiB" in msg and "precision=bf16" in msg
