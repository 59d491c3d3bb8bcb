"""Using a trained model: the Predictor, ``python -m mlptrain.predict`` and ``python -m mlptrain.evaluate``."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import make_cfg
from test_cli import REPO

import mlptrain
from mlptrain.base.errors import CheckpointError, ConfigError, DatasetError
from mlptrain.cli.evaluate import EvaluateArgs, classification_report, evaluate
from mlptrain.cli.predict import PredictArgs, read_inputs
from mlptrain.cli.predict import main as predict_main
from mlptrain.config.schema import DatasetName
from mlptrain.data.files.readers import write_csv
from mlptrain.inference.predictor import Predictor, softmax
from mlptrain.run import checkpoint
from mlptrain.run.run import train
from mlptrain.step.trainer import Trainer

CLASSES = ["cat", "dog", "emu"]
FEATURES = [f"f{i}" for i in range(6)]


def _blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Three classes of 6 features on very different scales (normalisation matters)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centres = np.array([[0, 1, 2, 0, 1, 2], [2, 0, 1, 2, 0, 1], [1, 2, 0, 1, 2, 0]], dtype=np.float64)
    x = centres[y] + 0.6 * rng.standard_normal((n, 6))
    return x * np.array([1.0, 10.0, 100.0, 0.1, 1000.0, 1.0]) + 50.0, y


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A model trained on a CSV with text labels and a separate test file; its run and its files."""
    d = tmp_path_factory.mktemp("trained")
    (xtr, ytr), (xte, yte) = _blobs(600, 0), _blobs(200, 1)
    write_csv(d / "train.csv", xtr, np.array(CLASSES)[ytr], FEATURES, target="animal")
    write_csv(d / "test.csv", xte, np.array(CLASSES)[yte], FEATURES, target="animal")
    cfg = make_cfg(
        data__name=DatasetName.file,
        data__path=str(d / "train.csv"),
        data__test_path=str(d / "test.csv"),
        data__target="animal",
        data__batch_size=32,
        data__cache=False,
        epochs=3,
    )
    summary = train(cfg, d / "run")
    return {
        "dir": d,
        "cfg": cfg,
        "run": d / "run",
        "best": d / "run/checkpoints/best.npz",
        "summary": summary,
        "x_test": xte,
        "y_test": yte,
    }


def test_predict_on_raw_inputs_equals_the_models_test_split_predictions(trained: dict) -> None:
    # The trainer's own view of the test split: normalised by the dataset, forward as in evaluation.
    tr = Trainer(trained["cfg"])
    best = checkpoint.load(trained["best"])
    tr.model.load_state_dict({k[6:]: v for k, v in best.arrays.items() if k.startswith("param/")})
    want = tr.model.forward(tr.dataset.x_test, keep=False)  # (N, 3) logits
    p = Predictor(trained["best"], device="cpu")
    x, y, _ = read_inputs(p, trained["dir"] / "test.csv")  # raw rows, by column name
    np.testing.assert_array_equal(p.logits(x), want)  # the same preprocessing, bit for bit
    ids = mlptrain.predict(p, x)
    np.testing.assert_array_equal(ids, want.argmax(axis=1))
    np.testing.assert_array_equal(y, tr.dataset.y_test)  # text labels to the same class indices
    assert np.mean(ids == y) == trained["summary"]["best/test/acc"]
    probs = mlptrain.predict(p, x, probabilities=True)
    np.testing.assert_allclose(probs, softmax(want.astype(np.float64)), rtol=1e-6, atol=1e-7)


def test_predict_matches_columns_by_name_in_any_order(trained: dict, tmp_path: Path) -> None:
    x, y = trained["x_test"], trained["y_test"]
    order = [3, 0, 5, 1, 4, 2]
    write_csv(tmp_path / "shuffled.csv", x[:, order], np.array(CLASSES)[y], [FEATURES[i] for i in order], "animal")
    p = Predictor(trained["best"], device="cpu")
    xs, ys, _ = read_inputs(p, tmp_path / "shuffled.csv")
    np.testing.assert_array_equal(xs, read_inputs(p, trained["dir"] / "test.csv")[0])
    # No target column: predicted all the same, no labels.
    np.savez(tmp_path / "rows.npz", x=x, feature_names=np.array(FEATURES))
    xn, yn, _ = read_inputs(p, tmp_path / "rows.npz")
    assert yn is None
    np.testing.assert_array_equal(mlptrain.predict(p, xn), mlptrain.predict(p, xs))


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        (FEATURES[:5], "lacks the feature column(s) 'f5'"),
        (
            [*FEATURES[:5], "F5"],
            "lacks the feature column(s) 'f5' and has column(s) the model was not trained on: 'F5' (renamed?)",
        ),
    ],
)
def test_missing_extra_or_renamed_columns_are_clear_errors(
    trained: dict, tmp_path: Path, columns: list[str], message: str
) -> None:
    x = np.random.default_rng(0).standard_normal((4, len(columns)))
    write_csv(tmp_path / "in.csv", x, np.array(["cat"] * 4), columns, "animal")
    p = Predictor(trained["best"], device="cpu")
    with pytest.raises(DatasetError) as err:
        read_inputs(p, tmp_path / "in.csv")
    assert message in str(err.value) and "in.csv" in str(err.value) and "'f0'" in str(err.value)


def test_checkpoints_of_another_format_version_are_refused_clearly(trained: dict, tmp_path: Path) -> None:
    ckpt = checkpoint.load(trained["best"])
    # Version 1 (before the preprocessing was kept): readable, but it cannot score raw inputs.
    arrays = {k: v for k, v in ckpt.arrays.items() if not k.startswith("data/")}
    meta = {**ckpt.meta, "format_version": 1, "data": None}
    meta.pop("sha256")
    meta["sha256"] = checkpoint.digest(arrays)
    with (tmp_path / "v1.npz").open("wb") as f:
        np.savez(f, **arrays, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    with pytest.raises(CheckpointError, match=r"format version 1, .*does not hold the data's preprocessing"):
        Predictor(tmp_path / "v1.npz", device="cpu")
    # A version from the future: named, with the versions this mlptrain reads.
    meta = {**ckpt.meta, "format_version": 3}
    with (tmp_path / "v3.npz").open("wb") as f:
        np.savez(f, **ckpt.arrays, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    with pytest.raises(CheckpointError, match="has format version 3 .* reads versions 1, 2"):
        Predictor(tmp_path / "v3.npz", device="cpu")


def test_predict_command_writes_ids_names_and_probabilities(trained: dict, tmp_path: Path, capsys) -> None:
    out = tmp_path / "pred.csv"
    rc = predict_main(
        [
            f"ckpt={trained['run']}",
            f"input={trained['dir'] / 'test.csv'}",
            f"output={out}",
            "probabilities=true",
            "batch_size=7",
            "device=cpu",
        ]
    )
    assert rc == 0
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    p = Predictor(trained["best"], device="cpu")
    x, y, _ = read_inputs(p, trained["dir"] / "test.csv")
    ids = mlptrain.predict(p, x)
    assert [int(r["class_id"]) for r in rows] == ids.tolist()
    assert [r["class_name"] for r in rows] == [CLASSES[i] for i in ids]
    probs = np.array([[float(r[f"p_{c}"]) for c in CLASSES] for r in rows])
    np.testing.assert_allclose(probs, mlptrain.predict(p, x, probabilities=True), rtol=1e-5)
    line = capsys.readouterr().out
    assert f"accuracy {np.mean(ids == y):.4f} against the file's 'animal' column" in line
    assert (
        predict_main(
            [
                f"ckpt={trained['best']}",
                f"input={trained['dir'] / 'test.csv'}",
                f"output={tmp_path / 'ids.npy'}",
                "device=cpu",
            ]
        )
        == 0
    )
    np.testing.assert_array_equal(np.load(tmp_path / "ids.npy"), ids)


def test_predict_command_errors_are_one_line_and_leave_the_output_alone(trained: dict, tmp_path: Path) -> None:
    out = tmp_path / "pred.csv"
    out.write_text("class_id,class_name\n0,precious\n")  # an earlier output: the command may replace it
    bad = tmp_path / "bad.csv"
    write_csv(bad, np.ones((2, 5)), np.array(["cat", "dog"]), FEATURES[:5], "animal")
    env_path = {"PYTHONPATH": str(REPO)}
    for args, phrase in [
        ([f"input={bad}", f"output={out}"], "lacks the feature column(s) 'f5'"),
        ([f"input={trained['dir'] / 'test.csv'}", f"output={tmp_path / 'p.xlsx'}"], "unknown format"),
        ([f"input={trained['dir'] / 'test.csv'}", f"output={out}", "batch_size=0"], "batch_size=0"),
        ([f"input={trained['dir'] / 'test.csv'}", f"outptu={out}"], "did you mean output?"),
    ]:
        command = [sys.executable, "-m", "mlptrain.predict", f"ckpt={trained['best']}", "device=cpu", *args]
        proc = subprocess.run(command, capture_output=True, text=True, env=env_path, timeout=120)
        assert proc.returncode == 2, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and phrase in errors[0] and "Traceback" not in proc.stderr, proc.stderr
    assert out.read_text() == "class_id,class_name\n0,precious\n"


def test_inputs_of_the_wrong_shape_or_with_nan_are_refused(trained: dict) -> None:
    p = Predictor(trained["best"], device="cpu")
    with pytest.raises(DatasetError, match=r"shape \(3, 5\); the model .* takes \(N, 6\)"):
        p.run(np.zeros((3, 5)))
    x = np.ones((3, 6))
    x[1, 4] = np.nan
    with pytest.raises(DatasetError, match=r"row 1 \(0-based\), f4 holds nan"):
        p.run(x)
    with pytest.raises(ConfigError, match="batch_size=0"):
        Predictor(trained["best"], device="cpu", batch_size=0)


def test_evaluate_on_the_own_test_split_matches_the_runs_best_scores(trained: dict, tmp_path: Path) -> None:
    report, folder = evaluate(EvaluateArgs(ckpt=str(trained["best"]), device="cpu"))
    s = trained["summary"]
    assert report["acc"] == s["best/test/acc"]
    assert report["loss"] == pytest.approx(s["best/test/loss"], rel=1e-5)
    assert folder == trained["run"] / "evaluation" / "best-test"
    confusion = np.array(report["confusion"])
    assert confusion.sum() == report["samples"] == 200
    assert np.trace(confusion) / 200 == report["acc"]
    # The same scores from the file of the test split, with its text labels.
    args = EvaluateArgs(ckpt=str(trained["best"]), data=str(trained["dir"] / "test.csv"), device="cpu")
    from_file, _ = evaluate(args)
    assert from_file["acc"] == report["acc"] and from_file["confusion"] == report["confusion"]


def test_classification_report_on_a_constructed_case() -> None:
    # true:      0 0 0 1 1 2;  predicted: 0 0 1 1 2 2
    y = np.array([0, 0, 0, 1, 1, 2])
    logits = np.eye(3)[[0, 0, 1, 1, 2, 2]] * 5.0
    r = classification_report(logits, y, ["a", "b", "c"])
    assert r["confusion"] == [[2, 1, 0], [0, 1, 1], [0, 0, 1]]
    assert r["acc"] == pytest.approx(4 / 6)
    assert r["per_class"]["a"] == {
        "precision": 1.0,
        "recall": pytest.approx(2 / 3),
        "f1": pytest.approx(0.8),
        "support": 3,
    }
    assert r["per_class"]["b"]["precision"] == 0.5 and r["per_class"]["b"]["recall"] == 0.5
    assert r["per_class"]["c"]["precision"] == 0.5 and r["per_class"]["c"]["recall"] == 1.0
    lse = np.log(np.exp(5.0) + 2.0)
    assert r["loss"] == pytest.approx((4 * (lse - 5.0) + 2 * lse) / 6)


def test_evaluate_command_writes_json_and_png(trained: dict, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from mlptrain.cli.evaluate import main

    assert main([f"ckpt={trained['best']}", f"output={tmp_path / 'ev'}", "device=cpu"]) == 0
    report = json.loads((tmp_path / "ev" / "evaluation.json").read_text())
    assert report["class_names"] == CLASSES and len(report["confusion"]) == 3
    assert (tmp_path / "ev" / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc = main([f"ckpt={trained['best']}", f"data={trained['dir'] / 'nope.csv'}", "device=cpu"])
    assert rc == 2


def test_predict_args_reject_unknown_and_missing_keys() -> None:
    from mlptrain.cli.commands import parse

    with pytest.raises(ConfigError, match="missing input=..., output=..."):
        parse(PredictArgs, ["ckpt=x"])
    with pytest.raises(ConfigError, match="probabilities='maybe'; expected true or false"):
        parse(PredictArgs, ["ckpt=x", "input=y", "output=z", "probabilities=maybe"])
    args = parse(PredictArgs, ["ckpt=x", "input=y", "output=z", "precision=null", "batch_size=5"])
    assert args.precision is None and args.batch_size == 5


def test_keep_copies_an_id_column_beside_the_predictions(trained: dict, tmp_path: Path) -> None:
    x, y = trained["x_test"][:20], trained["y_test"][:20]
    order = [5, 4, 3, 2, 1, 0]
    ids = np.arange(100, 120)
    src = tmp_path / "new.csv"
    write_csv(
        src,
        np.column_stack([x[:, order], ids]),
        np.array(CLASSES)[y],
        [*(FEATURES[i] for i in order), "id"],
        target="animal",
    )
    p = Predictor(trained["best"], device="cpu")
    np.testing.assert_array_equal(read_inputs(p, src)[0], x)  # not a feature: ignored unless kept (logged)
    out = tmp_path / "pred.csv"
    assert predict_main([f"ckpt={trained['best']}", f"input={src}", f"output={out}", "keep=id", "device=cpu"]) == 0
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["id", "class_id", "class_name"]
    assert [float(r["id"]) for r in rows] == ids.tolist()  # as the file has them
    assert [int(r["class_id"]) for r in rows] == mlptrain.predict(p, x).tolist()
    assert predict_main([f"ckpt={trained['best']}", f"input={src}", f"output={tmp_path / 'p.npy'}", "keep=id"]) == 2
    assert predict_main([f"ckpt={trained['best']}", f"input={src}", f"output={out}", "keep=nope"]) == 2


def test_kept_columns_are_copied_as_the_file_has_them(trained: dict, tmp_path: Path) -> None:
    """Big ids (beyond float64's 2^53) and leading zeros survive: kept cells are never numbers."""
    x, y = trained["x_test"][:3], trained["y_test"][:3]
    ids = ["9007199254740993", "9007199254740995", "007"]
    lines = [",".join([*FEATURES, "animal", "id"])]
    lines += [",".join([*(repr(v) for v in row), CLASSES[c], i]) for row, c, i in zip(x.tolist(), y, ids, strict=True)]
    (tmp_path / "in.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "pred.csv"
    assert (
        predict_main(
            [f"ckpt={trained['best']}", f"input={tmp_path / 'in.csv'}", f"output={out}", "keep=id", "device=cpu"]
        )
        == 0
    )
    with open(out, newline="") as f:
        assert [r["id"] for r in csv.DictReader(f)] == ids


def test_labels_that_are_numbers_name_classes_before_indices(trained: dict) -> None:
    p = Predictor(trained["best"], device="cpu")
    p.class_names = ["1", "2", "3"]  # classes that are numbers: label 1 is class "1", never index 1
    np.testing.assert_array_equal(p.labels(np.array([1.0, 3.0, 2.0]), "t"), [0, 2, 1])
    with pytest.raises(DatasetError, match="label 0.0 is not a class of the model"):
        p.labels(np.array([0.0]), "t")
    p.class_names = ["cat", "dog", "emu"]  # names that are not numbers: an integer label is an index
    np.testing.assert_array_equal(p.labels(np.array(["dog", "2", "0"]), "t"), [1, 2, 0])


def test_a_target_given_as_a_one_element_list_and_npz_targets(trained: dict, tmp_path: Path) -> None:
    p = Predictor(trained["best"], device="cpu")
    p.meta["config"]["data"]["target"] = ["animal"]  # data.target=[animal]
    assert p.target_columns == ["animal"]
    x, y = trained["x_test"], trained["y_test"]
    np.savez(tmp_path / "t.npz", x=x, y=np.array(CLASSES)[y], feature_names=np.array(FEATURES))
    report, _ = evaluate(EvaluateArgs(ckpt=str(trained["best"]), data=str(tmp_path / "t.npz"), device="cpu"))
    assert report["acc"] == trained["summary"]["best/test/acc"]  # the NPZ's y are the labels


def test_a_failed_write_is_one_error_after_the_work(trained: dict, tmp_path: Path, capsys) -> None:
    rc = predict_main(
        [f"ckpt={trained['best']}", f"input={trained['dir'] / 'test.csv'}", "output=/proc/pred.csv", "device=cpu"]
    )
    assert rc == 2 and "cannot write /proc/pred.csv" in capsys.readouterr().err


def test_regression_files_with_some_of_the_targets_are_scored_on_those(tmp_path: Path) -> None:

    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 3))
    t = np.stack([x @ [1.0, 2.0, 0.0], x @ [0.0, -1.0, 3.0]], axis=1)
    (tmp_path / "r.csv").write_text(
        "a,b,c,t1,t2\n" + "\n".join(",".join(map(repr, r)) for r in np.hstack([x, t]).tolist())
    )
    cfg = make_cfg(
        data__name=DatasetName.file,
        data__path=str(tmp_path / "r.csv"),
        data__target=["t1", "t2"],
        data__cache=False,
        model__loss="mse",
        epochs=2,
    )
    train(cfg, tmp_path / "run")
    p = Predictor(tmp_path / "run", device="cpu")
    only_t2 = tmp_path / "t2.csv"
    only_t2.write_text("a,b,c,t2\n" + "\n".join(",".join(map(repr, r)) for r in np.hstack([x, t[:, 1:]]).tolist()))
    xs, ys, _ = read_inputs(p, only_t2)
    assert np.isnan(ys[:, 0]).all() and np.array_equal(ys[:, 1], t[:, 1])
    report, _ = evaluate(EvaluateArgs(ckpt=str(tmp_path / "run"), data=str(only_t2), device="cpu"))
    out = p.run(xs).values.astype(np.float64)
    assert list(report["mse"]) == ["t2"]
    assert report["mse"]["t2"] == pytest.approx(np.mean((out[:, 1] - t[:, 1]) ** 2), rel=1e-12)
