"""NPZ files (issues #28.4, #28.13, #27.6): feature names one per column and unique, when training and
predicting; an object array of names refused with the way to save it; a test split of another width,
no rows or no features: one clear error each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg

from mlptrain.config import DataConfig, DatasetName
from mlptrain.data import load_dataset
from mlptrain.errors import DatasetError
from mlptrain.predict import main as predict_main
from mlptrain.run import train


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
