"""Messages about data files that must be one clear line (issues #28.13, #28.17, #27.6): each names the
setting the user gave (``input=`` and ``keep=`` for predict), the line of an Arrow parse error, and a
value beyond what training can hold, without a traceback or a warning."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import make_cfg

from mlptrain.base.errors import DatasetError
from mlptrain.cli.predict import main as predict_main
from mlptrain.config.schema import DataConfig, DatasetName
from mlptrain.data import load_dataset
from mlptrain.data.files.readers import arrow_available, read_table, write_csv
from mlptrain.run.run import train

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "cache"))
    return tmp_path / "cache"


def blobs(n: int = 120, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    return rng.standard_normal((n, 3)) + 2.0 * y[:, None], np.array(["cat", "dog"])[y]


def test_features_beyond_float32_are_one_error_without_warnings(tmp_path: Path) -> None:
    x, y = blobs()
    x[:, 1] = np.where(np.arange(len(x)) % 2, 1e308, -1e308)
    write_csv(tmp_path / "d.csv", x, y, ["f0", "f1", "f2"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the overflow used to show as three RuntimeWarnings, then "holds nan"
        with pytest.raises(DatasetError) as err:
            load_dataset(DataConfig(name=DatasetName.file, path=str(tmp_path / "d.csv")))
    assert "d.csv line 2, column 'f1': -1e+308 is beyond float32's range (+-3.4e+38)" in str(err.value)


@pytest.mark.skipif(not arrow_available(), reason="no pyarrow")
def test_an_arrow_parse_error_names_the_problem_by_line(tmp_path: Path) -> None:
    (tmp_path / "h.csv").write_text("f0,f1,label")  # a header and no newline: "Empty CSV file or block"
    with pytest.raises(DatasetError, match="h.csv has a header but no data rows$"):
        read_table(tmp_path / "h.csv", "label", reader="arrow")
    (tmp_path / "r.csv").write_text("f0,f1,label\n1,2,a\n3,4\n")
    with pytest.raises(DatasetError, match="r.csv line 3 has 2 fields, the header has 3"):
        read_table(tmp_path / "r.csv", "label", reader="arrow")


def test_a_target_named_twice_is_one_line(tmp_path: Path) -> None:
    x, y = blobs()
    write_csv(tmp_path / "d.csv", x, np.arange(len(x)) * 0.5, ["f0", "f1", "f2"])
    with pytest.raises(DatasetError) as err:
        read_table(tmp_path / "d.csv", ["label", "label"])
    assert (
        str(err.value) == "data.target=['label', 'label'] names the column 'label' more than once; name each "
        "target column once"
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("trained")
    x, y = blobs()
    write_csv(d / "train.csv", x, y, ["f0", "f1", "f2"])
    train(make_cfg(data__name=DatasetName.file, data__path=str(d / "train.csv"), data__cache=False, epochs=1), d / "r")
    return d / "r" / "checkpoints" / "best.npz"


def test_predict_names_its_own_settings(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x, y = blobs(20, seed=1)
    write_csv(tmp_path / "in.csv", x, y, ["f0", "f1", "f2"])
    cases = [
        ([f"input={tmp_path / 'nowhere.csv'}"], "nowhere.csv does not exist; set input to an existing file"),
        ([f"input={tmp_path / 'in.csv'}", "keep=nope"], "has no column 'nope' (keep); its columns are f0, f1, f2"),
    ]
    for args, phrase in cases:
        capsys.readouterr()
        assert predict_main([f"ckpt={ckpt}", *args, f"output={tmp_path / 'p.csv'}"]) == 2
        err = capsys.readouterr().err
        assert phrase in err and "data.path" not in err and "data.target" not in err, err


def test_evaluate_of_a_checkpoint_without_a_data_file_asks_for_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """#27: a checkpoint fitted from Python (mlptrain.sklearn) records no data file; evaluate without
    ``data=`` said "data file None does not exist; set data.path to an existing file"."""
    pytest.importorskip("sklearn")
    from mlptrain.cli.evaluate import main as evaluate_main
    from mlptrain.sklearn import MLPClassifier

    x, y = blobs()
    path = MLPClassifier(hidden_layer_sizes=(8,), max_iter=2, random_state=0).fit(x, y).save(tmp_path / "m.npz")
    capsys.readouterr()
    assert evaluate_main([f"ckpt={path}", "device=cpu"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: checkpoint {path} records no data file to split; pass data=<a labelled file>"]
    x2, y2 = blobs(20, seed=1)
    write_csv(tmp_path / "labelled.csv", x2, y2, ["x0", "x1", "x2"])  # the estimator's own column names
    assert evaluate_main([f"ckpt={path}", f"data={tmp_path / 'labelled.csv'}", "device=cpu"]) == 0


def test_from_the_command_line_each_is_one_line_and_exit_2(tmp_path: Path) -> None:
    x, y = blobs()
    np.savez(tmp_path / "w.npz", x=x, y=np.arange(len(x)) % 2, x_test=np.zeros((5, 4)), y_test=np.zeros(5))
    (tmp_path / "sp.csv").write_text("f0, f1, label\n" + "".join(f"{i}, {i % 3}, {i % 2}\n" for i in range(40)))
    write_csv(tmp_path / "t.csv", x, np.arange(len(x)) * 0.5, ["f0", "f1", "f2"])
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLPTRAIN_DATA": str(tmp_path / "cache")}
    common = [sys.executable, "-m", "mlptrain", "device=cpu", "progress=false", "epochs=1", "data=file"]
    twice = "data.target=['label', 'label'] names the column 'label' more than once; name each target column once"
    for path, extra, rc, phrase in [
        (tmp_path / "w.npz", [], 2, "x_test has 4 columns, x has 3"),
        (tmp_path / "sp.csv", [], 0, ""),
        (tmp_path / "t.csv", ["data.target=[label,label]", "model.loss=mse"], 2, twice),  # #28.17
    ]:
        run = tmp_path / f"run_{path.stem}"
        proc = subprocess.run(
            [*common, f"data.path={path}", *extra, f"hydra.run.dir={run}"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=300,
        )
        assert proc.returncode == rc and "Traceback" not in proc.stderr, proc.stderr
        if rc:
            errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
            assert len(errors) == 1 and phrase in errors[0], proc.stderr
