"""Issue #47, the commands after training (predict, evaluate, plot): what a new user and an adversarial
pass found, each case held here (see docs/reliability.md)."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from test_inference import CLASSES, FEATURES
from test_inference import trained as trained  # the model these tests score with (a fixture)

from mlptrain.cli.evaluate import EvaluateArgs, evaluate
from mlptrain.cli.evaluate import main as evaluate_main
from mlptrain.cli.plot import main as plot_main
from mlptrain.cli.predict import main as predict_main
from mlptrain.cli.predict import read_inputs
from mlptrain.cli.predictions import spreadsheet_text, write_outputs
from mlptrain.inference.predictor import Outputs, Predictor
from mlptrain.run import checkpoint
from mlptrain.run.restore import from_flat


def _run_dir(folder: Path) -> Path:
    """A run folder with a small ``metrics.jsonl`` (steps and epochs), as training writes it."""
    folder.mkdir(parents=True)
    records = [{"kind": "step", "step": s, "train/loss": 1.0 / s} for s in range(1, 5)]
    records += [{"kind": "epoch", "epoch": e, "val/loss": 0.5 / e, "val/acc": 0.5 + 0.1 * e} for e in (1, 2)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


@pytest.mark.parametrize(
    ("name", "make", "message"),
    [
        ("data.csv", lambda d: (d / "data.csv").write_text("a,label\n1,0\n"), "expected the name of an image file"),
        ("run/metrics.jsonl", lambda d: None, "expected the name of an image file"),
        ("data.png", lambda d: (d / "data.png").write_text("a,label\n1,0\n"), "exists and is not an image"),
        ("link.png", lambda d: (d / "link.png").symlink_to(d / "run/metrics.jsonl"), "is the metrics of the run"),
        ("run/checkpoints/best.png", lambda d: (d / "run/checkpoints").mkdir(), "in a checkpoints/ folder"),
    ],
)
def test_plot_out_is_an_image_and_never_an_input_or_another_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, make, message: str
) -> None:
    pytest.importorskip("matplotlib")
    run = _run_dir(tmp_path / "run")
    make(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert plot_main([str(run), "--out", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --out={tmp_path / name}") and message in err[0], err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing written or replaced


@pytest.mark.parametrize(("suffix", "magic"), [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF-")])
def test_plot_writes_the_image_format_its_name_says_and_replaces_an_image(tmp_path: Path, suffix: str, magic: bytes):
    pytest.importorskip("matplotlib")
    run = _run_dir(tmp_path / "run")
    out = tmp_path / f"curves{suffix}"
    assert plot_main([str(run), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(magic)
    assert plot_main([str(run), "--out", str(out)]) == 0  # an earlier figure may be replaced


def test_plot_names_the_file_and_line_of_a_binary_metrics_jsonl(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    run = _run_dir(tmp_path / "run")
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\xfe\x00garbage\n")
    assert plot_main([str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    byte = len((run / "metrics.jsonl").read_bytes()) - 11  # where the bad line starts
    assert err == [
        f"error: {run / 'metrics.jsonl'}: line 7 is not UTF-8 text (byte {byte}); expected the JSON lines "
        "of a run's metrics"
    ]


# --- predict and evaluate on files --------------------------------------------------------------------------


def _csv(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    path.write_text("\n".join(",".join(map(str, r)) for r in [header, *rows]) + "\n")
    return path


def _test_rows(trained: dict, n: int = 12) -> tuple[list[list[float]], list[str]]:
    return trained["x_test"][:n].tolist(), [CLASSES[c] for c in trained["y_test"][:n]]


def _read(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _edited(src: Path, dst: Path, edit) -> Path:
    """A copy of the checkpoint ``src`` whose meta (its config) ``edit`` changed."""
    ckpt = checkpoint.load(src)
    meta = json.loads(json.dumps(ckpt.meta))
    edit(meta)
    meta["sha256"] = checkpoint.digest(ckpt.arrays, meta)  # intact: only what it says changed
    with dst.open("wb") as f:
        np.savez(f, **ckpt.arrays, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    return dst


def test_predict_ignores_a_column_the_model_does_not_take_and_says_so(trained: dict, tmp_path: Path, caplog) -> None:
    x, names = _test_rows(trained)
    src = _csv(
        tmp_path / "in.csv",
        [*FEATURES, "animal", "id"],
        [[*r, n, f"c{i}"] for i, (r, n) in enumerate(zip(x, names, strict=True))],
    )
    out = tmp_path / "pred.csv"
    with caplog.at_level(logging.INFO, logger="mlptrain.cli.predict"):
        assert predict_main([f"ckpt={trained['best']}", f"input={src}", f"output={out}", "device=cpu"]) == 0
    said = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert said == [
        f"input file {src}: ignoring the column(s) 'id', which are not features of the model; keep=id "
        "copies them into the output"
    ]
    assert list(_read(out)[0]) == ["class_id", "class_name"]
    assert predict_main([f"ckpt={trained['best']}", f"input={src}", f"output={out}", "keep=id", "device=cpu"]) == 0
    assert [r["id"] for r in _read(out)] == [f"c{i}" for i in range(len(x))]


def test_keep_of_a_feature_keeps_it_a_feature_and_copies_it(trained: dict, tmp_path: Path) -> None:
    x, names = _test_rows(trained)
    src = _csv(tmp_path / "in.csv", [*FEATURES, "animal"], [[*r, n] for r, n in zip(x, names, strict=True)])
    out = tmp_path / "pred.csv"
    assert predict_main([f"ckpt={trained['best']}", f"input={src}", f"output={out}", "keep=f0", "device=cpu"]) == 0
    rows = _read(out)
    assert list(rows[0]) == ["f0", "class_id", "class_name"]
    assert predict_main([f"ckpt={trained['best']}", f"input={src}", f"output={out}", "keep=f0", "device=cpu"]) == 0
    assert predict_main([f"ckpt={trained['best']}", f"input={src}", f"output={src}", "device=cpu"]) == 2  # the input
    assert [float(r["f0"]) for r in rows] == [r[0] for r in x]
    p = Predictor(trained["best"], device="cpu")
    xs, _, kept = read_inputs(p, src, ["f0"])
    np.testing.assert_array_equal(xs, np.array(x))  # f0 is still read as a feature
    assert kept["f0"].tolist() == [repr(r[0]) for r in x] or kept["f0"].tolist() == [str(r[0]) for r in x]


@pytest.mark.parametrize(
    ("cell", "written"),
    [
        ('=HYPERLINK("http://x","y")', '\'=HYPERLINK("http://x","y")'),
        ("+cmd|' /C calc'!A0", "'+cmd|' /C calc'!A0"),
        ("-2+3", "'-2+3"),
        ("@SUM(A1)", "'@SUM(A1)"),
        ("\tx", "'\tx"),
        ("\rx", "'\rx"),
        ("-5", "-5"),
        ("-1.5e3", "-1.5e3"),
        ("+.5", "+.5"),
        ("dog", "dog"),
        (-3, -3),
        (-2.5, -2.5),
    ],
)
def test_spreadsheet_text_escapes_formulas_and_leaves_numbers(cell: object, written: object) -> None:
    assert spreadsheet_text(cell) == written


def test_predictions_csv_escapes_class_names_and_kept_cells_a_spreadsheet_would_run(
    trained: dict, tmp_path: Path
) -> None:
    p = Predictor(trained["best"], device="cpu")
    p.class_names = ['=HYPERLINK("http://evil")', "@dog", "emu"]
    out = Outputs(class_id=np.array([0, 1, 2]), probabilities=np.full((3, 3), 1 / 3, dtype=np.float32))
    kept = {"id": np.array(["=1+2", "-7", "ok"]), "=x": np.array(["a", "b", "c"])}
    write_outputs(p, out, tmp_path / "p.csv", kept)
    rows = list(csv.reader(open(tmp_path / "p.csv", newline="")))
    assert rows[0] == ["id", "'=x", "class_id", "class_name", 'p_=HYPERLINK("http://evil")', "p_@dog", "p_emu"]
    assert [r[:4] for r in rows[1:]] == [
        ["'=1+2", "a", "0", '\'=HYPERLINK("http://evil")'],
        ["-7", "b", "1", "'@dog"],
        ["ok", "c", "2", "emu"],
    ]
    write_outputs(p, out, tmp_path / "p.npz", kept)  # NumPy files hold the names as they are
    assert np.load(tmp_path / "p.npz")["class_name"].tolist() == p.class_names


def test_a_stored_interpolation_is_text_not_resolved_where_the_checkpoint_is_read(
    trained: dict, tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("MLPTRAIN_SECRET", "leaked")

    def edit(meta: dict) -> None:
        meta["config"]["data"]["path"] = "${oc.env:MLPTRAIN_SECRET}/train.csv"
        meta["config"]["data"]["test_path"] = None

    ckpt = _edited(trained["best"], tmp_path / "interp.npz", edit)
    assert evaluate_main([f"ckpt={ckpt}", "device=cpu", f"output={tmp_path / 'ev'}"]) == 2
    err = capsys.readouterr().err
    assert "${oc.env:MLPTRAIN_SECRET}/train.csv" in err and "leaked" not in err, err
    cfg = from_flat({"data.path": "${oc.env:MLPTRAIN_SECRET}/x.csv", "data.target": ["a\\${b}"]})  # a resume's
    assert cfg.data.path == "${oc.env:MLPTRAIN_SECRET}/x.csv" and cfg.data.target == ["a\\${b}"]


def test_evaluate_target_names_the_label_column_of_the_file(trained: dict, tmp_path: Path, capsys) -> None:
    x, names = _test_rows(trained, 200)
    src = _csv(tmp_path / "in.csv", [*FEATURES, "species"], [[*r, n] for r, n in zip(x, names, strict=True)])
    report, _ = evaluate(EvaluateArgs(ckpt=str(trained["best"]), data=str(src), target="species", device="cpu"))
    assert report["acc"] == trained["summary"]["best/test/acc"] and report["samples"] == 200
    assert evaluate_main([f"ckpt={trained['best']}", f"data={src}", "device=cpu", f"output={tmp_path / 'a'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: data file {src} has no target column 'animal'; evaluation needs the true labels (set "
        "target=COLUMN; python -m mlptrain.predict scores a file without them)"
    ]
    assert evaluate_main([f"ckpt={trained['best']}", f"data={src}", "target=f2", "device=cpu"]) == 2
    said = capsys.readouterr().err.strip()
    assert said == "error: target=f2: 'f2' is a feature of the model; name the column of the labels"
    assert evaluate_main([f"ckpt={trained['best']}", f"data={src}", "target=zebra", "device=cpu"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: data file {src} has no column 'zebra' (target=zebra); its columns are 'f0', 'f1', 'f2', 'f3', 'f4', "
        "'f5', 'species'"
    )


def test_an_empty_label_column_is_no_labels(trained: dict, tmp_path: Path, capsys, caplog) -> None:
    x, names = _test_rows(trained)
    empty = _csv(tmp_path / "empty.csv", [*FEATURES, "animal"], [[*r, ""] for r in x])
    out = tmp_path / "pred.csv"
    with caplog.at_level(logging.INFO, logger="mlptrain.cli.predict"):
        assert predict_main([f"ckpt={trained['best']}", f"input={empty}", f"output={out}", "device=cpu"]) == 0
    line = capsys.readouterr().out
    assert "accuracy" not in line and f"-> {out}" in line
    assert f"input file {empty}: the column(s) 'animal' hold no values: no labels, no score" in caplog.messages
    assert evaluate_main([f"ckpt={trained['best']}", f"data={empty}", "device=cpu"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: data file {empty}: the target column(s) 'animal' hold no values; evaluation needs labels"
    )


def test_labels_of_some_rows_only_score_those_rows(trained: dict, tmp_path: Path, capsys) -> None:
    x, names = _test_rows(trained)
    given = [n if i % 3 else "" for i, n in enumerate(names)]  # rows 0, 3, 6, 9 (lines 2, 5, 8, 11) have none
    src = _csv(tmp_path / "part.csv", [*FEATURES, "animal"], [[*r, n] for r, n in zip(x, given, strict=True)])
    p = Predictor(trained["best"], device="cpu")
    _, y, _ = read_inputs(p, src)
    assert y.tolist() == [-1 if not n else CLASSES.index(n) for n in given]
    out = tmp_path / "pred.csv"
    assert predict_main([f"ckpt={trained['best']}", f"input={src}", f"output={out}", "device=cpu"]) == 0
    ids = np.array([int(r["class_id"]) for r in _read(out)])
    acc = np.mean(ids[y >= 0] == y[y >= 0])
    assert (
        f"accuracy {acc:.4f} against the file's 'animal' column (8 rows with a label; 4 empty)"
        in capsys.readouterr().out
    )
    assert evaluate_main([f"ckpt={trained['best']}", f"data={src}", "device=cpu"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: data file {src} lines 2, 5, 8 and 11: no value in the target column(s) 'animal'; evaluation needs a "
        "label on every row (fill or remove those rows)"
    )


def test_messages_name_the_setting_the_file_line_and_the_key(trained: dict, tmp_path: Path, capsys) -> None:
    assert evaluate_main([f"ckpt={trained['best']}", f"data={tmp_path / 'nope.csv'}", "device=cpu"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: data file {tmp_path / 'nope.csv'} does not exist; set data to an existing file"
    )
    x, names = _test_rows(trained, 6)
    x[3][4] = float("nan")  # the fourth data row: line 5 of the file
    src = _csv(tmp_path / "nan.csv", [*FEATURES, "animal"], [[*r, n] for r, n in zip(x, names, strict=True)])
    assert predict_main([f"ckpt={trained['best']}", f"input={src}", f"output={tmp_path / 'p.csv'}", "device=cpu"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: input file {src} line 5 (the header is line 1), column 'f4' holds nan; features must be finite numbers"
    )
    ckpt = _edited(trained["best"], tmp_path / "k.npz", lambda m: m["config"]["data"].update(shuffle_bufer=3))
    assert evaluate_main([f"ckpt={ckpt}", "device=cpu", f"output={tmp_path / 'ev'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: checkpoint {ckpt}: its data config has the key data.shuffle_bufer, which this mlptrain "
        "does not know; pass data=<a labelled file> to score the model on it"
    ]


def test_evaluate_target_of_a_regression_names_its_columns_in_the_models_order(tmp_path: Path) -> None:
    from helpers import make_cfg

    from mlptrain.base.errors import ConfigError
    from mlptrain.config.schema import DatasetName
    from mlptrain.run.run import train

    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 3))
    t = np.stack([x @ [1.0, 2.0, 0.0], x @ [0.0, -1.0, 3.0]], axis=1)
    _csv(tmp_path / "r.csv", ["a", "b", "c", "t1", "t2"], np.hstack([x, t]).tolist())
    path, target = str(tmp_path / "r.csv"), ["t1", "t2"]
    cfg = make_cfg(
        data__name=DatasetName.file,
        data__path=path,
        data__target=target,
        data__cache=False,
        model__loss="mse",
        epochs=1,
    )
    train(cfg, tmp_path / "run")
    renamed = _csv(tmp_path / "u.csv", ["a", "b", "c", "price", "rent"], np.hstack([x, t]).tolist())
    args = EvaluateArgs(ckpt=str(tmp_path / "run"), data=str(renamed), target="price,rent", device="cpu")
    report, _ = evaluate(args)
    out = Predictor(tmp_path / "run", device="cpu").run(x).values.astype(np.float64)
    assert list(report["mse"]) == ["t1", "t2"]
    assert report["mse"]["t2"] == pytest.approx(np.mean((out[:, 1] - t[:, 1]) ** 2), rel=1e-12)
    args.target = "price"
    with pytest.raises(ConfigError, match=r"target=price: the model best.npz takes 2 target columns"):
        evaluate(args)
