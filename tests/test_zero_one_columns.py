"""The column plan's 0/1 columns (one-hot levels, ``<name>_missing``) stay 0/1 (#49), as scikit-learn's
OneHotEncoder and MissingIndicator leave them, the numeric columns standardised as StandardScaler does; stored as
shift 0, scale 1 in the checkpoint's normalisation, so predict on raw rows, evaluate, the host-resident path and the
ONNX export on raw columns apply it unchanged; a table without a plan (a column of 0/1 numbers included) is
standardised as before."""

from __future__ import annotations

import csv
import logging
import warnings
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.exceptions import ConvergenceWarning
from sklearn.impute import MissingIndicator, SimpleImputer
from sklearn.preprocessing import OneHotEncoder, StandardScaler
from test_column_plan import HEADER, data_cfg, make_table

from mlptrain.cli import predict as predict_cli
from mlptrain.cli.evaluate import EvaluateArgs, evaluate
from mlptrain.data import load_dataset
from mlptrain.data.files.plan import ColumnPlan
from mlptrain.inference.predictor import Predictor

pd = pytest.importorskip("pandas")


def files(tmp_path: Path) -> tuple[Path, Path]:
    make_table(tmp_path / "train.csv", n=300, seed=0)
    make_table(tmp_path / "test.csv", n=90, seed=1)
    return tmp_path / "train.csv", tmp_path / "test.csv"


def reference(train: Path, test: Path, names: list[str]) -> np.ndarray:
    """scikit-learn's encoding of the test file, fitted on every training row: the numbers median-filled and
    standardised, their MissingIndicator and the OneHotEncoder columns left 0/1, in the plan's column order."""
    tr, te = pd.read_csv(train), pd.read_csv(test)
    numeric, text = ["age", "income", "code"], ["student", "region"]
    imputer = SimpleImputer(strategy="median").fit(tr[numeric])
    scaler = StandardScaler().fit(imputer.transform(tr[numeric]))
    out = dict(zip(numeric, scaler.transform(imputer.transform(te[numeric])).T, strict=True))
    missing = MissingIndicator().fit(tr[numeric])
    for name, column in zip(missing.get_feature_names_out(numeric), missing.transform(te[numeric]).T, strict=True):
        out[f"{name.removeprefix('missingindicator_')}_missing"] = column
    filled = tr[text].fillna("<empty>")
    onehot = OneHotEncoder(handle_unknown="ignore", sparse_output=False).fit(filled)
    encoded = onehot.transform(te[text].fillna("<empty>")).T  # (levels, N)
    for name, column in zip(onehot.get_feature_names_out(text), encoded, strict=True):
        out[name.replace("_", "=", 1)] = column
    return np.stack([out[n] for n in names], axis=1)


def test_the_encoding_is_scikit_learns_column_for_column(tmp_path: Path) -> None:
    """Every training row is the train split (val_fraction=0, a test file): the test file's encoded, normalised
    rows against scikit-learn's StandardScaler on the numbers and 0/1 indicator and one-hot columns."""
    train, test = files(tmp_path)
    ds = load_dataset(data_cfg(train, test_path=str(test), drop=["id"], val_fraction=0.0))
    assert ds.feature_names is not None and "region=polar" in ds.feature_names and "age_missing" in ds.feature_names
    want = reference(train, test, ds.feature_names)
    assert_allclose(ds.x_test, want, rtol=1e-5, atol=1e-5)
    binary = ColumnPlan.from_meta(ds.columns).binary()  # type: ignore[union-attr]
    assert binary.sum() == len(binary) - 3 and set(np.unique(ds.x_test[:, binary])) == {0.0, 1.0}


def test_a_table_without_a_plan_standardises_a_column_of_0_1_numbers(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    rows = [[*rng.normal(size=2), int(rng.random() < 0.3), i % 2] for i in range(60)]  # a 0/1 column of numbers
    with open(tmp_path / "n.csv", "w", newline="") as f:
        csv.writer(f).writerows([["a", "b", "flag", "label"], *rows])
    ds = load_dataset(data_cfg(tmp_path / "n.csv"))
    assert ds.columns is None and ds.normalization is not None
    assert ds.normalization.shift[2] != 0 and ds.normalization.scale[2] != 1  # only the plan's columns are kept 0/1
    assert len(np.unique(ds.x_train[:, 2])) == 2 and not set(np.unique(ds.x_train[:, 2])) <= {0.0, 1.0}


@pytest.mark.parametrize("mode", ["standard", "robust"])  # (quantile's ONNX: tests/test_export_quantile.py)
def test_the_0_1_columns_round_trip_predict_evaluate_host_and_onnx(tmp_path: Path, mode: str, caplog) -> None:
    """The checkpoint holds shift 0, scale 1 for the 0/1 columns; predict on the raw test rows
    (reordered, an extra column, an unseen level, empty cells) scores what evaluate scores on the run's own
    test split; the host-resident run equals the device one; ONNX on the raw columns equals predict."""
    from helpers import make_cfg, records

    from mlptrain.run.run import train

    train_csv, test_csv = files(tmp_path)
    rows = list(csv.reader(open(test_csv)))[1:]
    rows[0][4], rows[1][1], rows[2][3] = "mars", "", ""  # unseen level, empty cells
    order = ["extra", "label", "code", "region", "student", "income", "age", "id"]
    with open(tmp_path / "raw.csv", "w", newline="") as f:
        records_ = [dict(zip(HEADER, r, strict=True), extra="zzz") for r in rows]
        csv.writer(f).writerows([order, *[[r[k] for k in order] for r in records_]])
    with open(test_csv, "w", newline="") as f:
        csv.writer(f).writerows([HEADER, *rows])
    over = dict(epochs=4, model__hidden=[16], data__batch_size=32)
    cfg = make_cfg(**over)
    cfg.data = data_cfg(train_csv, test_path=str(test_csv), drop=["id"], normalize=mode)
    cfg.data.batch_size = 32
    train(cfg, tmp_path / "run")
    host = make_cfg(**over)
    host.data = data_cfg(train_csv, test_path=str(test_csv), drop=["id"], normalize=mode)
    host.data.batch_size, host.data.residency = 32, "host"  # type: ignore[assignment]
    train(host, tmp_path / "host")
    assert records(tmp_path / "host") == records(tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "best.npz"
    p = Predictor(ckpt, device="cpu")
    assert p.plan is not None
    binary = p.plan.binary()
    assert_array_equal(p.shift[binary], 0.0)
    assert_array_equal(p.scale[binary], 1.0)
    assert (p.scale[~binary] != 1).all()  # the numbers scaled
    argv = [f"ckpt={ckpt}", f"input={tmp_path / 'raw.csv'}", f"output={tmp_path / 'pred.npz'}", "probabilities=true"]
    assert predict_cli.main([*argv, "device=cpu"]) == 0
    with np.load(tmp_path / "pred.npz") as got:
        predicted, probabilities = got["class_id"], got["probabilities"]
    labels = np.asarray(p.class_name(np.arange(p.num_outputs)))
    accuracy = np.mean(labels[predicted] == np.array([r[-1] for r in rows]))
    with caplog.at_level(logging.WARNING):
        report, _ = evaluate(EvaluateArgs(ckpt=str(ckpt), split="test", device="cpu"))
    assert "normalised differently" not in caplog.text  # the saved config re-makes the kept normalisation
    assert report["acc"] == pytest.approx(accuracy, abs=1e-12) and report["samples"] == len(rows)
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from mlptrain.cli.export import ExportArgs, export
    from mlptrain.inference.onnx_columns import feeds

    out = export(ExportArgs(ckpt=str(ckpt), format="onnx", output=str(tmp_path / "m.onnx")))
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    frame = pd.read_csv(tmp_path / "raw.csv", dtype=str, keep_default_na=False)
    (onnx_probabilities,) = sess.run(["probabilities"], feeds(p.plan, frame))
    assert_allclose(onnx_probabilities, probabilities, rtol=0, atol=1e-5)


@pytest.mark.parametrize("weighted", [False, True])
def test_the_estimators_scale_the_numbers_alone(weighted: bool) -> None:
    """MLPClassifier on a DataFrame: the 0/1 columns of its plan stored as shift 0, scale 1, the numbers
    standardised (with sample_weight: the weighted mean and std), as ColumnTransformer([SimpleImputer +
    StandardScaler on the numbers, MissingIndicator, OneHotEncoder]) scales them."""
    from test_sklearn_frames import table

    from mlptrain.sklearn import MLPClassifier
    from mlptrain.sklearn.frames import predict_input

    frame, y = table(300)
    w = np.where(np.arange(300) % 3 == 0, 2.0, 1.0) if weighted else None

    params = dict(hidden_layer_sizes=(8,), max_iter=2, random_state=0, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        kept = MLPClassifier(**params, categorical_features=["code"]).fit(frame, y, sample_weight=w)
    binary = kept.column_plan_.binary()
    x = predict_input(kept, frame, kept.column_plan_)  # (300, F) the encoded rows, every one a training row
    shift, scale = kept.state_.arrays["data/shift"], kept.state_.arrays["data/scale"]
    assert_array_equal(shift[binary], 0.0)
    assert_array_equal(scale[binary], 1.0)
    numbers = np.flatnonzero(~binary)  # age, income
    mean = np.average(x[:, numbers], axis=0, weights=w)
    assert len(numbers) == 2 and binary.sum() > 8
    assert_allclose(shift[numbers], mean, rtol=1e-12)
    assert_allclose(scale[numbers], np.sqrt(np.average((x[:, numbers] - mean) ** 2, axis=0, weights=w)), rtol=1e-12)
