"""NPZ files (issues #28.4, #28.13, #27.6): feature names one per column and unique, when training and
predicting; an object array of names refused with the way to save it; a test split of another width,
no rows or no features: one clear error each; an uncompressed NPZ's tables memory-mapped where they lie
in the zip, equal to what NumPy reads, and not copied into the cache (#31)."""

from __future__ import annotations

import io
import logging
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg

from mlptrain.base.errors import DatasetError
from mlptrain.cli.predict import main as predict_main
from mlptrain.config.schema import DataConfig, DatasetName
from mlptrain.data import load_dataset
from mlptrain.data.files.npz_reader import in_place, read_npz, stored_member
from mlptrain.run.run import train


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "cache"))
    return tmp_path / "cache"


def blobs(n: int = 120, features: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    return rng.standard_normal((n, features)) + 2.0 * y[:, None], y


def load(path: Path) -> Any:
    return load_dataset(DataConfig(name=DatasetName.file, path=str(path)))


@pytest.mark.parametrize(
    ("names", "phrase"),
    [
        (["a", "a", "b"], "feature_names holds 'a' more than once for 3 columns; expected one unique name per column"),
        (["a", "b"], "feature_names holds 2 names for 3 columns; expected one unique name per column"),
    ],
    ids=["repeated", "too few"],
)
def test_feature_names_must_name_each_column_once_when_training(tmp_path: Path, names: list[str], phrase: str) -> None:
    x, y = blobs()
    np.savez(tmp_path / "d.npz", x=x, y=y, feature_names=np.array(names))
    with pytest.raises(DatasetError) as err:
        load(tmp_path / "d.npz")
    assert phrase in str(err.value), str(err.value)


def test_feature_names_are_checked_when_predicting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x, y = blobs()
    np.savez(tmp_path / "train.npz", x=x, y=y, feature_names=np.array(["a", "b", "c"]))
    cfg = make_cfg(data__name=DatasetName.file, data__path=str(tmp_path / "train.npz"), epochs=1)
    train(cfg, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "best.npz"
    cases = [  # [a, a, b] fed column 0 twice; 6 columns and 4 names were cut to 4
        (blobs(50)[0], ["a", "a", "b"], "feature_names holds 'a' more than once for 3 columns"),
        (blobs(50, features=6)[0], ["a", "b", "c", "d"], "feature_names holds 4 names for 6 columns"),
    ]
    for i, (xi, names, phrase) in enumerate(cases):
        np.savez(tmp_path / f"in{i}.npz", x=xi, feature_names=np.array(names))
        capsys.readouterr()
        rc = predict_main([f"ckpt={ckpt}", f"input={tmp_path / f'in{i}.npz'}", f"output={tmp_path / 'p.csv'}"])
        err = capsys.readouterr().err
        assert rc == 2 and phrase in err and err.count("error:") == 1, err
        assert not (tmp_path / "p.csv").exists()


def test_names_saved_as_an_object_array_say_how_to_save_them(tmp_path: Path) -> None:
    x, y = blobs()
    np.savez(tmp_path / "d.npz", x=x, y=y, feature_names=np.array(["a", "b", "c"], dtype=object))  # a pandas Index
    with pytest.raises(DatasetError) as err:
        load(tmp_path / "d.npz")
    msg = str(err.value)
    assert "its array 'feature_names' is an array of Python objects" in msg, msg
    assert "np.savez(..., feature_names=np.array(names, dtype=str))" in msg, msg


@pytest.mark.parametrize(
    ("arrays", "phrase"),
    [
        ({"x_test": np.zeros((10, 4)), "y_test": np.zeros(10)}, "x_test has 4 columns, x has 3"),
        ({"x_test": np.zeros((0, 3)), "y_test": np.zeros(0)}, "x_test has the shape (0, 3); expected at least one"),
        ({"x": np.zeros((0, 3)), "y": np.zeros(0)}, "x has the shape (0, 3); expected at least one row and column"),
        ({"x": np.zeros((120, 0))}, "x has the shape (120, 0); expected at least one row and column"),
    ],
    ids=["x_test width", "x_test no rows", "x no rows", "x no features"],
)
def test_a_test_split_of_another_width_or_an_empty_array_is_one_error(
    tmp_path: Path, arrays: dict[str, np.ndarray], phrase: str
) -> None:
    x, y = blobs()
    np.savez(tmp_path / "d.npz", **{"x": x, "y": y, **arrays})
    with pytest.raises(DatasetError) as err:
        load(tmp_path / "d.npz")
    assert phrase in str(err.value), str(err.value)


# --- tables memory-mapped where they lie in the zip (#31) ----------------------------------------------


def write_stored(path: Path, arrays: dict[str, np.ndarray], version: tuple[int, int] = (1, 0)) -> Path:
    """An uncompressed NPZ written by zipfile itself (no zip64 extra field, unlike np.savez), any .npy version."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, a in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, a, version=version, allow_pickle=False)
            zf.writestr(f"{name}.npy", buf.getvalue())
    return path


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("writer", ["savez", "zipfile 1.0", "zipfile 2.0"])
def test_a_stored_table_is_memory_mapped_with_the_values_numpy_reads(
    tmp_path: Path, dtype: type, order: str, writer: str
) -> None:
    x, y = blobs(97, 5)
    x, xt = np.asarray(x, dtype, order=order), np.asarray(x[:11] * 3, dtype, order=order)
    arrays = {"x": x, "y": y, "x_test": xt, "y_test": y[:11]}
    path = tmp_path / "d.npz"
    if writer == "savez":
        np.savez(path, **arrays)
    else:
        write_stored(path, arrays, (1, 0) if writer.endswith("1.0") else (2, 0))
    member = stored_member(path, "x")
    assert member is not None and member.shape == (97, 5) and member.fortran == (order == "F")
    train, test = read_npz(path)
    assert test is not None
    for got, want in ((train.x, x), (test.x, xt)):
        assert isinstance(got, np.memmap) and got.dtype == dtype and not got.flags.writeable
        np.testing.assert_array_equal(got, want)
    assert in_place(path)


def test_a_compressed_or_integer_table_is_read_and_not_in_place(tmp_path: Path) -> None:
    x, y = blobs()
    np.savez_compressed(tmp_path / "c.npz", x=x.astype(np.float32), y=y)
    np.savez(tmp_path / "i.npz", x=np.round(x * 10).astype(np.int16), y=y)
    assert stored_member(tmp_path / "c.npz", "x") is None and not in_place(tmp_path / "c.npz")
    assert stored_member(tmp_path / "i.npz", "x") is not None and not in_place(tmp_path / "i.npz")  # cast: cached
    table, _ = read_npz(tmp_path / "c.npz")
    assert not isinstance(table.x, np.memmap)
    np.testing.assert_array_equal(table.x, x.astype(np.float32))


def test_a_stored_npz_trains_as_the_compressed_one_and_writes_no_cache_entry(
    tmp_path: Path, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    x, y = blobs(400, 6)
    np.savez(tmp_path / "s.npz", x=x.astype(np.float32), y=y)
    np.savez_compressed(tmp_path / "c.npz", x=x.astype(np.float32), y=y)
    with caplog.at_level(logging.INFO, logger="mlptrain.data"):
        stored = load(tmp_path / "s.npz")
    assert "memory-mapped in the NPZ" in caplog.text and "cache entry" not in caplog.text, caplog.text
    assert not cache_dir.exists() or not any(cache_dir.rglob("*.npy")), "nothing copied into the cache"
    compressed = load(tmp_path / "c.npz")  # read, checked, cached as before
    assert len(list((cache_dir / "tables").iterdir())) == 1
    for split in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(stored, split), getattr(compressed, split))
    np.testing.assert_array_equal(stored.normalization.shift, compressed.normalization.shift)


def test_a_truncated_stored_npz_is_one_clear_error(tmp_path: Path) -> None:
    x, y = blobs()
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=y)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the table cut, the central directory gone
    assert stored_member(path, "x") is None and not in_place(path)
    with pytest.raises(DatasetError, match="cannot be read as an NPZ file"):
        load(path)
