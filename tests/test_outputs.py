"""What predict, evaluate and export write: never over an input or a checkpoint, temp files cleaned up,
evaluate's pair written as one unit (mlptrain.inference.outputs), and the checks a Predictor makes of a checkpoint."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import make_cfg
from test_cli import REPO

from mlptrain.base.errors import CheckpointError, ConfigError, DatasetError, OutputError
from mlptrain.cli.evaluate import EvaluateArgs, evaluate
from mlptrain.cli.evaluate import main as evaluate_main
from mlptrain.cli.export import main as export_main
from mlptrain.cli.predict import main as predict_main
from mlptrain.config.schema import DatasetName
from mlptrain.data.files.readers import write_csv
from mlptrain.inference import outputs
from mlptrain.inference.predictor import Predictor
from mlptrain.run import checkpoint
from mlptrain.run.run import train

FEATURES = ["a", "b", "c", "d"]
CLASSES = np.array(["cat", "dog", "emu"])


def _rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 4))
    return x, (x[:, 0] > 0).astype(int) + (x[:, 1] > 0)  # three classes a model can learn


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A classifier trained on a CSV (its run directory, its files); tests copy what they change."""
    d = tmp_path_factory.mktemp("outputs")
    x, y = _rows(240, 0)
    write_csv(d / "train.csv", x, CLASSES[y], FEATURES, target="animal")
    write_csv(d / "new.csv", _rows(30, 1)[0], np.array(["cat"] * 30), FEATURES, target="animal")
    cfg = make_cfg(
        data__name=DatasetName.file, data__path=str(d / "train.csv"), data__target="animal", data__cache=False, epochs=2
    )
    train(cfg, d / "run")
    return {
        "dir": d,
        "run": d / "run",
        "best": d / "run/checkpoints/best.npz",
        "last": d / "run/checkpoints/last.npz",
        "input": d / "new.csv",
    }


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", module, *args, *([] if module == "mlptrain.export" else ["device=cpu"])]
    return subprocess.run(command, capture_output=True, text=True, env={"PYTHONPATH": str(REPO)}, timeout=120)


def _one_error(proc: subprocess.CompletedProcess, phrase: str) -> None:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and phrase in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def _resign(src: Path, dst: Path, arrays: dict | None = None, **data: object) -> Path:
    """A copy of checkpoint ``src`` with ``arrays`` and ``meta.data`` entries changed, its SHA-256 recomputed."""
    ckpt = checkpoint.load(src)
    meta = {**ckpt.meta, "data": {**ckpt.meta["data"], **data}}
    checkpoint.save(dst, {**ckpt.arrays, **(arrays or {})}, meta)
    return dst


# --- #28.1: outputs never replace an input, a checkpoint, or anything in checkpoints/ --------------


def test_predict_never_replaces_its_input_however_the_path_is_written(model: dict, tmp_path: Path) -> None:
    src = tmp_path / "x.csv"
    src.write_bytes(model["input"].read_bytes())
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.csv").symlink_to(src)
    for out in (src, tmp_path / "sub" / ".." / "x.csv", tmp_path / "link.csv"):
        proc = _cli("mlptrain.predict", f"ckpt={model['run']}", f"input={src}", f"output={out}")
        _one_error(proc, f"is the input file {src}")
    os.link(src, tmp_path / "hard.csv")  # another name of the same file
    _one_error(
        _cli("mlptrain.predict", f"ckpt={model['run']}", f"input={src}", f"output={tmp_path / 'hard.csv'}"),
        "is the input file",
    )
    assert src.read_bytes() == model["input"].read_bytes()


def test_predict_never_writes_over_a_checkpoint_or_into_checkpoints(model: dict, tmp_path: Path) -> None:
    before = model["best"].read_bytes()
    base = [f"ckpt={model['run']}", f"input={model['input']}"]
    _one_error(_cli("mlptrain.predict", *base, f"output={model['best']}"), "is the checkpoint")
    _one_error(_cli("mlptrain.predict", *base, f"output={model['last']}"), "in a checkpoints/ folder")
    _one_error(_cli("mlptrain.predict", *base, f"output={model['run'] / 'checkpoints' / 'p.csv'}"), "checkpoints/")
    copy = tmp_path / "model.npz"  # a checkpoint anywhere, even with overwrite=true
    copy.write_bytes(before)
    _one_error(_cli("mlptrain.predict", *base, f"output={copy}", "overwrite=true"), "is an mlptrain checkpoint")
    assert model["best"].read_bytes() == before and copy.read_bytes() == before
    assert not (model["run"] / "checkpoints" / "p.csv").exists()


def test_export_keeps_checkpoints_and_takes_only_its_formats_suffix(model: dict, tmp_path: Path) -> None:
    before = model["last"].read_bytes()
    _one_error(
        _cli("mlptrain.export", f"ckpt={model['run']}", "format=onnx", f"output={model['last']}"),
        "format=onnx writes a .onnx file; name it last.onnx",
    )
    into = model["run"] / "checkpoints" / "last.onnx"
    _one_error(_cli("mlptrain.export", f"ckpt={model['run']}", "format=onnx", f"output={into}"), "checkpoints/ folder")
    assert model["last"].read_bytes() == before and not into.exists()
    checkpoint.load(model["last"])  # resume=last still reads it
    _one_error(
        _cli("mlptrain.export", f"ckpt={model['run']}", "format=onnx", f"output={tmp_path / 'm.npz'}"),
        "format=onnx writes a .onnx file; name it m.onnx",
    )
    args = [f"ckpt={model['run']}", "format=safetensors", f"output={tmp_path / 'm.onnx'}"]
    _one_error(_cli("mlptrain.export", *args), "writes a .safetensors file")
    assert not (tmp_path / "m.npz").exists() and not (tmp_path / "m.onnx").exists()
    # The default goes into the run directory, never into its checkpoints/.
    assert export_main([f"ckpt={model['run']}", "format=safetensors"]) == 0
    assert (model["run"] / "best.safetensors").is_file()
    assert sorted(p.name for p in (model["run"] / "checkpoints").iterdir()) == ["best.npz", "last.npz"]


def test_an_existing_file_is_replaced_only_when_it_is_an_earlier_output(model: dict, tmp_path: Path) -> None:
    notes = tmp_path / "notes.csv"
    notes.write_text("name,phone\nann,123\n")  # the user's own table, not predictions
    base = [f"ckpt={model['run']}", f"input={model['input']}"]
    _one_error(_cli("mlptrain.predict", *base, f"output={notes}"), "exists and is not a predictions file")
    assert notes.read_text() == "name,phone\nann,123\n"
    assert predict_main([*base, f"output={notes}", "overwrite=true", "device=cpu"]) == 0
    assert notes.read_text().startswith("class_id,class_name\n")
    assert predict_main([*base, f"output={notes}", "probabilities=true", "device=cpu"]) == 0  # its own output again
    features = tmp_path / "x.npy"
    np.save(features, np.ones((30, 4)))  # float64 features: not what predict writes
    assert predict_main([*base, f"output={features}", "device=cpu"]) == 2
    np.testing.assert_array_equal(np.load(features), np.ones((30, 4)))
    onnx_out = tmp_path / "m.onnx"
    onnx_out.write_bytes(b"not a model")
    assert export_main([f"ckpt={model['run']}", "format=onnx", f"output={onnx_out}"]) == 2
    assert onnx_out.read_bytes() == b"not a model"
    assert export_main([f"ckpt={model['run']}", "format=onnx", f"output={onnx_out}", "overwrite=true"]) == 0
    assert export_main([f"ckpt={model['run']}", "format=onnx", f"output={onnx_out}"]) == 0  # an export: replaced


def test_an_output_in_a_loop_of_symlinks_is_one_error(tmp_path: Path) -> None:
    (tmp_path / "a.csv").symlink_to(tmp_path / "b.csv")
    (tmp_path / "b.csv").symlink_to(tmp_path / "a.csv")
    with pytest.raises(OutputError, match=r"output=.*a.csv cannot be resolved"):
        outputs.check_output(tmp_path / "a.csv", inputs={}, kind="a file", same_kind=lambda f: True, overwrite=True)


def test_evaluate_writes_no_report_into_checkpoints(model: dict) -> None:
    rc = evaluate_main([f"ckpt={model['best']}", f"output={model['run'] / 'checkpoints'}", "device=cpu"])
    assert rc == 2
    assert sorted(p.name for p in (model["run"] / "checkpoints").iterdir()) == ["best.npz", "last.npz"]


# --- #28.9, #28.13: a re-signed checkpoint that does not fit together is refused at load ---------


@pytest.mark.parametrize(
    ("change", "phrase"),
    [
        (
            {"arrays": {"data/scale": np.array([1.0, 0.0, 1.0, 1.0])}},
            "data/scale[1] is 0.0; expected a finite number > 0",
        ),
        ({"arrays": {"data/scale": np.array([1.0, 1.0, np.nan, 1.0])}}, "data/scale[2] is nan"),
        ({"arrays": {"data/shift": np.zeros(3)}}, "data/shift is float64 (3,); expected float (4,)"),
        ({"arrays": {"param/layer0.weight": np.full((32, 4), np.inf, np.float32)}}, "param/layer0.weight[0, 0] is inf"),
        ({"arrays": {"param/layer1.bias": np.zeros(3, np.int64)}}, "param/layer1.bias is int64; expected floating"),
        ({"class_names": ["cat", "dog"]}, "data.class_names has 2 names for the model's 3 outputs"),
        ({"class_names": ["cat", "dog", "cat"]}, "data.class_names names 'cat' twice"),
        ({"task": "ranking"}, "data.task='ranking'; expected classification or regression"),
        ({"feature_names": ["a", "b", "c"]}, "data.feature_names has 3 names for the model's 4 inputs"),
    ],
)
def test_a_checkpoint_whose_preprocessing_does_not_fit_is_refused_naming_the_entry(
    model: dict, tmp_path: Path, change: dict, phrase: str
) -> None:
    bad = _resign(model["best"], tmp_path / "bad.npz", **change)
    with pytest.raises(CheckpointError, match="cannot score inputs") as err:
        Predictor(bad, device="cpu")
    assert phrase in str(err.value) and str(bad) in str(err.value)
    out = tmp_path / "p.csv"
    _one_error(_cli("mlptrain.predict", f"ckpt={bad}", f"input={model['input']}", f"output={out}"), phrase)
    _one_error(_cli("mlptrain.export", f"ckpt={bad}", "format=onnx", f"output={tmp_path / 'm.onnx'}"), phrase)
    assert not out.exists() and not (tmp_path / "m.onnx").exists()


def test_evaluate_draws_class_names_holding_dollar_signs(model: dict, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    odd = _resign(model["best"], tmp_path / "odd.npz", class_names=["$x^$", "a$_$b", "$$"])
    assert evaluate_main([f"ckpt={odd}", f"output={tmp_path / 'ev'}", "device=cpu"]) == 0
    report = json.loads((tmp_path / "ev" / "evaluation.json").read_text())
    assert report["class_names"] == ["$x^$", "a$_$b", "$$"]
    assert (tmp_path / "ev" / "confusion.png").read_bytes()[:4] == b"\x89PNG"


# --- #27.6, #27.7: messages ------------------------------------------------------------------


def test_evaluate_on_a_file_of_another_model_names_the_columns(model: dict, tmp_path: Path) -> None:
    other = tmp_path / "iris.csv"
    write_csv(other, np.ones((5, 3)), np.array(["setosa"] * 5), ["sepal", "petal", "width"], target="species")
    with pytest.raises(DatasetError) as err:
        evaluate(EvaluateArgs(ckpt=str(model["best"]), data=str(other), device="cpu"))
    message = str(err.value)
    assert "lacks the feature column(s) 'a', 'b', 'c', 'd'" in message and "'species'" in message
    assert "(a file of another model?)" in message
    assert "not a number" not in message


@pytest.fixture(scope="module")
def regression(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("regression")
    x = np.random.default_rng(0).standard_normal((200, 3))
    write_csv(d / "r.csv", x, x @ [1.0, -2.0, 0.5], ["a", "b", "c"], target="price")
    cfg = make_cfg(
        data__name=DatasetName.file,
        data__path=str(d / "r.csv"),
        data__target="price",
        data__cache=False,
        model__loss="mse",
        epochs=1,
    )
    train(cfg, d / "run")
    return {"run": d / "run", "input": d / "r.csv"}


def test_probabilities_of_a_regression_are_refused_in_one_line(regression: dict, tmp_path: Path) -> None:
    out = tmp_path / "p.csv"
    proc = _cli(
        "mlptrain.predict",
        f"ckpt={regression['run']}",
        f"input={regression['input']}",
        f"output={out}",
        "probabilities=true",
    )
    _one_error(proc, "probabilities=true: the model best.npz is a regression (targets price)")
    assert not out.exists()
    with pytest.raises(ConfigError, match="no class probabilities"):
        Predictor(regression["run"], device="cpu").run(np.zeros((2, 3)), probabilities=True)


# --- #28.15: temp files of a killed command -----------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temp_files_of_a_killed_predict_are_removed_at_the_next_start(model: dict, tmp_path: Path, caplog) -> None:
    out = tmp_path / "out.csv"
    dead = tmp_path / f"out.csv.{_dead_pid()}.0badcafe.tmp"
    alive = tmp_path / f"out.csv.{os.getpid()}.00c0ffee.tmp"  # a writer still going (this process)
    other = tmp_path / f"other.csv.{_dead_pid()}.0badcafe.tmp"  # another output's: not this command's to judge
    for tmp in (dead, alive, other):
        tmp.write_text("class_id,cl")
    assert predict_main([f"ckpt={model['run']}", f"input={model['input']}", f"output={out}", "device=cpu"]) == 0
    assert not dead.exists() and alive.exists() and other.exists()
    assert f"removed {dead}" in caplog.text


def _predict_killed_mid_write(model: dict, out: Path, kill: str) -> subprocess.CompletedProcess:
    """``python -m mlptrain.predict`` into ``out``, stopped by the Python statement ``kill`` with the
    output's temp file half written."""
    script = (
        "import os, signal, sys\n"
        "import mlptrain.cli.predict as m\n"
        "import mlptrain.cli.predictions as w\n"  # the CSV writer of predict's output
        "write = w._write_csv\n"
        "def killed(*a):\n"
        "    a[3].write(b'class_id,class_name\\n0,')\n"
        "    a[3].flush()\n"
        f"    {kill}\n"
        "    write(*a)\n"
        "w._write_csv = killed\n"
        "sys.exit(m.main(sys.argv[1:]))\n"
    )
    args = [f"ckpt={model['run']}", f"input={model['input']}", f"output={out}", "device=cpu"]
    command = [sys.executable, "-c", script, *args]
    return subprocess.run(command, capture_output=True, text=True, env={"PYTHONPATH": str(REPO)}, timeout=120)


def test_sigterm_while_writing_removes_the_temp_file_and_keeps_the_old_output(model: dict, tmp_path: Path) -> None:
    out = tmp_path / "out.csv"
    out.write_text("class_id,class_name\n0,old\n")
    proc = _predict_killed_mid_write(model, out, "signal.raise_signal(signal.SIGTERM)")  # a scheduler's stop
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "error: interrupted by SIGTERM; no output was written" in proc.stderr
    assert out.read_text() == "class_id,class_name\n0,old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]


def test_the_temp_file_of_a_sigkilled_predict_is_removed_by_the_next_one(model: dict, tmp_path: Path) -> None:
    out = tmp_path / "out.csv"
    proc = _predict_killed_mid_write(model, out, "os.kill(os.getpid(), signal.SIGKILL)")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (left,) = tmp_path.iterdir()  # what nothing could remove: the killed process's temp file
    assert left.name.startswith("out.csv.") and left.name.endswith(".tmp")
    assert predict_main([f"ckpt={model['run']}", f"input={model['input']}", f"output={out}", "device=cpu"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]


def test_a_gz_output_names_no_file_in_its_header(model: dict, tmp_path: Path) -> None:
    out = tmp_path / "p.csv.gz"
    assert predict_main([f"ckpt={model['run']}", f"input={model['input']}", f"output={out}", "device=cpu"]) == 0
    raw = out.read_bytes()
    assert raw[:2] == b"\x1f\x8b" and raw[3] & 0x08 == 0  # FNAME not set: no name (the temp file's) in it
    assert b".tmp" not in raw[:64]
    assert gzip.decompress(raw).decode().startswith("class_id,class_name\n")


# --- #28.16: evaluate's evaluation.json and confusion.png, one unit -------------------------------


def test_evaluate_interrupted_while_drawing_leaves_both_files_and_says_so(
    model: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    folder = tmp_path / "ev"
    assert evaluate_main([f"ckpt={model['best']}", f"output={folder}", "device=cpu"]) == 0
    files = [folder / "evaluation.json", folder / "confusion.png"]
    before = [(f.stat().st_ino, f.read_bytes()) for f in files]  # a replaced file is a new inode

    def ctrl_c(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", ctrl_c)
    capsys.readouterr()
    assert evaluate_main([f"ckpt={model['best']}", f"output={folder}", "device=cpu"]) == 130
    assert "error: interrupted by SIGINT; no output was written" in capsys.readouterr().err
    assert [(f.stat().st_ino, f.read_bytes()) for f in files] == before
    assert sorted(p.name for p in folder.iterdir()) == ["confusion.png", "evaluation.json"]


def test_the_report_names_the_figure_it_was_written_with(model: dict, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert evaluate_main([f"ckpt={model['best']}", f"output={tmp_path}", "device=cpu"]) == 0
    report = json.loads((tmp_path / "evaluation.json").read_text())
    png = (tmp_path / "confusion.png").read_bytes()
    assert report["figure"] == {"file": "confusion.png", "sha256": hashlib.sha256(png).hexdigest()}


def test_a_failed_second_write_renames_neither_file(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("old a")
    (tmp_path / "b").write_text("old b")

    def full_disk(f: object) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        outputs.write_together([(tmp_path / "a", "new a"), (tmp_path / "b", full_disk)])
    assert (tmp_path / "a").read_text() == "old a" and (tmp_path / "b").read_text() == "old b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temp file left


def test_ctrl_c_during_the_renames_waits_until_both_are_done(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    replace = os.replace

    def interrupted_replace(src: Path, dst: Path) -> None:
        replace(src, dst)
        if dst.name == "a":  # Ctrl-C between the two renames
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(outputs.os, "replace", interrupted_replace)
    outputs.written.clear()
    with pytest.raises(KeyboardInterrupt):
        outputs.write_together([(tmp_path / "a", "new a"), (tmp_path / "b", "new b")])
    assert (tmp_path / "a").read_text() == "new a" and (tmp_path / "b").read_text() == "new b"
    assert outputs.written == [tmp_path / "a", tmp_path / "b"]  # what the interrupt message names
