"""data.normalize=robust and quantile (mlptrain.data.files.column_stats): the statistics against scikit-learn's
RobustScaler and QuantileTransformer on tables with skew, outliers, ties and constant columns; the plan's 0/1
columns; streamed rows; the quantile table through the checkpoint, predict, evaluate and the exports."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from numpy.testing import assert_allclose, assert_array_equal
from scipy.special import ndtri as scipy_ndtri
from sklearn.preprocessing import QuantileTransformer, RobustScaler

from mlptrain.base.errors import CheckpointError, ConfigError
from mlptrain.base.normal import ndtri
from mlptrain.cli.export import ExportArgs, export, load_safetensors, preprocessing
from mlptrain.config.schema import NORMALIZATIONS, DataConfig, DatasetName
from mlptrain.data import load_dataset
from mlptrain.data.dataset import Normalization
from mlptrain.data.files.column_stats import SUBSAMPLE, QuantileMap
from mlptrain.data.prepare import normalization
from mlptrain.data.rows import NormalisedRows
from mlptrain.inference.consistency import check_for_scoring
from mlptrain.inference.onnx_columns import feeds
from mlptrain.inference.predictor import Predictor
from mlptrain.run import checkpoint

REPO = Path(__file__).resolve().parent.parent


def table(n: int, seed: int = 0) -> np.ndarray:
    """``(n, 7)``: skewed (lognormal), outliers (a normal with 2% at 1e6), ties (integers 0..3), a constant, a
    column whose IQR is 0 but that varies (94% zeros), a bounded uniform and an integer column of many ties."""
    rng = np.random.default_rng(seed)
    return np.stack(
        [
            rng.lognormal(0.0, 2.0, n),
            np.where(rng.random(n) < 0.02, 1e6, rng.normal(5.0, 3.0, n)),
            rng.integers(0, 4, n).astype(np.float64),
            np.full(n, 7.25),
            np.where(rng.random(n) < 0.06, rng.exponential(50.0, n), 0.0),
            rng.uniform(-1e-3, 1e-3, n),
            rng.poisson(2.0, n).astype(np.float64),
        ],
        axis=1,
    )


CONSTANT, ZERO_IQR = 3, 4


def test_ndtri_is_scipys_to_the_last_digits() -> None:
    p = np.concatenate([np.linspace(0.0, 1.0, 20001), [1e-300, 1e-7 - np.spacing(1), 1 - (1e-7 - np.spacing(1))]])
    want = scipy_ndtri(p)
    got = ndtri(p)
    finite = np.isfinite(want)
    assert_array_equal(got[~finite], want[~finite])  # -inf at 0, +inf at 1
    assert_allclose(got[finite], want[finite], rtol=1e-14, atol=1e-15)
    assert np.isnan(ndtri(np.array([-0.1, 1.1, np.nan]))).all()


# --- robust ----------------------------------------------------------------------------------------


def test_robust_is_robustscalers_on_the_train_rows_and_the_zero_iqr_fallback_is_the_std() -> None:
    x = table(3000)
    rows = np.random.default_rng(1).permutation(3000)[:2000]  # the train split: statistics of these rows only
    norm = normalization("robust", x, rows)
    ref = RobustScaler().fit(x[rows])
    iqr = [j for j in range(x.shape[1]) if j not in (CONSTANT, ZERO_IQR)]
    assert_allclose(norm.shift[iqr], ref.center_[iqr], rtol=1e-12)
    assert_allclose(norm.scale[iqr], ref.scale_[iqr], rtol=1e-12)
    # a column that varies with IQR 0: centred by its median, divided by its std (scikit-learn: by 1)
    assert ref.scale_[ZERO_IQR] == 1.0 and norm.shift[ZERO_IQR] == np.median(x[rows, ZERO_IQR]) == 0.0
    assert norm.scale[ZERO_IQR] == pytest.approx(x[rows, ZERO_IQR].std(), rel=1e-12)
    test = table(500, seed=2)
    z = norm.apply(test)  # float32, rounded once
    assert_allclose(z[:, iqr], ref.transform(test)[:, iqr], rtol=1e-6, atol=1e-6)
    assert_array_equal(z[:, CONSTANT], 0.0)  # a constant column becomes exactly 0 (scikit-learn: 0 too)


def test_every_mode_leaves_the_plans_0_1_columns_at_0_1() -> None:
    """The plan's one-hot and ``_missing`` columns stay 0/1 (scikit-learn's ColumnTransformer leaves one-hot
    columns unscaled), a constant one becomes 0; the other columns are scaled as without the plan."""
    x = table(1000)
    rng = np.random.default_rng(1)
    rare = (rng.random(len(x)) < 0.01).astype(np.float64)  # a 1% level: standardised, about 10 where set
    x = np.column_stack([x, rare, rng.integers(0, 2, len(x)).astype(np.float64), np.ones(len(x))])  # (1000, 10)
    binary = np.zeros(x.shape[1], bool)
    binary[[7, 8, 9]] = True  # the plan's 0/1 columns, the last one constant (a level of every training row)
    for method in ("standard", "minmax", "robust", "quantile"):
        norm = normalization(method, x, binary=binary)
        plain = normalization(method, x[:, :7])  # the same columns without the plan's
        assert norm.shift[[7, 8]].tolist() == [0.0, 0.0] and norm.scale[[7, 8]].tolist() == [1.0, 1.0], method
        assert_array_equal(norm.apply(x)[:, 7:], np.column_stack([rare, x[:, 8], np.zeros(len(x))]))
        assert_array_equal(norm.shift[:7], plain.shift)
        assert_array_equal(norm.scale[:7], plain.scale)
    q = normalization("quantile", x, binary=binary).quantile
    assert q is not None and q.columns.tolist() == [0, 1, 2, 4, 5, 6]  # neither the 0/1 columns nor the constant one


# --- quantile ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "train"), [(300, 300), (4000, 3000), (3 * SUBSAMPLE, 2 * SUBSAMPLE + 7)])
def test_quantile_is_quantiletransformers_quantiles_and_map(n: int, train: int) -> None:
    """n_quantiles = min(1000, rows), the same 10,000-row sample beyond that (seeded by data.split_seed),
    the same interpolation of ties and the same clip, to 1e-6 after the float32 rounding."""
    x = table(n)
    rows = np.random.default_rng(3).permutation(n)[:train]
    norm = normalization("quantile", x, rows, seed=5)
    ref = QuantileTransformer(output_distribution="normal", n_quantiles=min(1000, train), random_state=5)
    ref.fit(x[rows])
    assert norm.quantile is not None
    mapped = norm.quantile.columns.tolist()
    assert mapped == [j for j in range(x.shape[1]) if j != CONSTANT]
    assert_allclose(norm.quantile.quantiles, ref.quantiles_[:, mapped], rtol=0, atol=0)
    test = np.concatenate([table(400, seed=4), x[rows[:200]], np.full((5, x.shape[1]), -1e9), np.full((5, 7), 1e9)])
    z = norm.apply(test)
    assert_allclose(z[:, mapped], ref.transform(test)[:, mapped], rtol=0, atol=1e-6)
    assert np.abs(z[:, mapped]).max() == pytest.approx(5.1993375, abs=1e-6)  # the clip, at both ends
    assert_array_equal(z[:600, CONSTANT], 0.0)  # scikit-learn maps a constant column to -5.1993; mlptrain to 0
    ties = QuantileMap(norm.quantile.quantiles, norm.quantile.columns).apply_(test.copy())  # float64 itself
    assert_allclose(ties[:, mapped], ref.transform(test)[:, mapped], rtol=0, atol=1e-12)


def test_streamed_rows_are_the_made_split_with_the_quantile_map() -> None:
    x = table(2000).astype(np.float32)
    rows = np.arange(0, 2000, 3)
    norm = normalization("quantile", x, rows, seed=0)
    streamed = NormalisedRows(x, rows, norm.shift, norm.scale, mapped=norm.mapped)
    made = norm.apply(x[rows])
    assert_array_equal(streamed.take(np.arange(len(rows))[::-1], np.empty(made.shape, np.float32)), made[::-1])
    assert_array_equal(np.asarray(streamed), made)
    assert_array_equal(np.asarray(streamed.subset(slice(5, 50))), made[5:50])


@pytest.mark.parametrize("mode", ["robust", "quantile"])
def test_a_streamed_file_has_the_made_splits_and_the_train_splits_statistics(tmp_path: Path, mode: str) -> None:
    """data.residency=stream: the statistics from the memory-mapped table's train rows (a sample of them), the
    quantile map applied to each batch as it is gathered: the splits equal the made ones, bit for bit."""
    x = table(16_000).astype(np.float32)
    y = (x[:, 2] > 1).astype(np.int64)
    np.savez(tmp_path / "t.npz", x=x, y=y)  # uncompressed: memory-mapped where it lies
    cfg = {"name": DatasetName.file, "path": str(tmp_path / "t.npz"), "normalize": mode, "split_seed": 4}
    made, streamed = (load_dataset(DataConfig(**cfg, residency=r)) for r in ("host", "stream"))
    assert isinstance(streamed.x_train, NormalisedRows)
    assert (streamed.x_train.mapped is not None) == (mode == "quantile")
    for split in ("train", "val", "test"):
        assert_array_equal(np.asarray(getattr(streamed, f"x_{split}")), getattr(made, f"x_{split}"))
    norm = made.normalization
    assert norm is not None and len(made.y_train) > SUBSAMPLE  # the quantiles come from a sample of the train rows
    if mode == "quantile":
        assert norm.quantile is not None and norm.quantile.quantiles.shape == (1000, 6)  # all but the constant
    assert norm.shift[CONSTANT] == x[0, CONSTANT] and norm.scale[CONSTANT] == 1.0
    assert_array_equal(made.x_train[:, CONSTANT], 0.0)


# --- through a run, its checkpoint, predict, evaluate and the exports ----------------------------------------


def write_table(path: Path, n: int, seed: int) -> list[list[str]]:
    """Skewed and outlying numbers, ties, a constant, empty cells and a text column; a label that depends on them."""
    rng = np.random.default_rng(seed)
    x = table(n, seed)
    colour = rng.choice(["red", "green", "blue"], n)
    label = np.where((np.log(x[:, 0]) + (x[:, 2] > 1) + (colour == "red")) > 1.0, "yes", "no")
    header = ["skew", "outlier", "ties", "constant", "spike", "colour", "label"]
    rows = []
    for i in range(n):
        cells = [repr(float(v)) for v in x[i, [0, 1, 2, 3, 4]]] + [str(colour[i]), str(label[i])]
        if rng.random() < 0.05:
            cells[1] = ""  # an empty cell: the median fill and its 0/1 indicator
        rows.append(cells)
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    return rows


def cli(module: str, *args: str, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "HYDRA_MAIN_MODULE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def quantile_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run trained on a raw CSV with data.normalize=quantile (CPU, a few epochs)."""
    tmp = tmp_path_factory.mktemp("quantile")
    write_table(tmp / "train.csv", 600, 0)
    write_table(tmp / "test.csv", 150, 1)
    args = ["data=file", "data.path=train.csv", "data.test_path=test.csv", "data.target=label", "epochs=3"]
    cli("mlptrain", *args, "data.normalize=quantile", "device=cpu", "progress=false", "hydra.run.dir=run", cwd=tmp)
    return tmp


def test_the_quantile_table_round_trips_through_the_checkpoint(quantile_run: Path) -> None:
    ckpt = quantile_run / "run" / "checkpoints" / "best.npz"
    p = Predictor(ckpt, device="cpu")
    paths = {"path": str(quantile_run / "train.csv"), "test_path": str(quantile_run / "test.csv")}
    cfg = DataConfig(name=DatasetName.file, **paths, target="label", cache=False, normalize="quantile")  # the run's
    ds = load_dataset(DataConfig(**{**vars(cfg), "features": None}))
    norm = ds.normalization
    assert norm is not None and norm.quantile is not None and p.normalization.quantile is not None
    assert p.normalization.method == "quantile"
    assert_array_equal(p.normalization.quantile.quantiles, norm.quantile.quantiles)
    assert_array_equal(p.normalization.quantile.columns, norm.quantile.columns)
    assert_array_equal(p.shift, norm.shift)
    assert_array_equal(p.scale, norm.scale)
    names = p.feature_names or []
    mapped = [names[j] for j in norm.quantile.columns]
    assert mapped == ["skew", "outlier", "ties", "spike"]  # not the constant, the indicator or the one-hots
    # raw rows of the test file, encoded by the plan and mapped by the predictor: the inputs the run scored
    with open(quantile_run / "test.csv") as f:
        records = list(csv.DictReader(f))
    cells = {c: np.char.strip(np.array([r[c] for r in records])) for c in p.input_names or []}
    raw = p.encode(cells, "test.csv", str)  # (N, F) float64
    assert_array_equal(norm.apply(raw), ds.x_test)
    assert_array_equal(p.logits(raw), p.logits(ds.x_test, normalised=True))


def test_predict_on_raw_rows_is_evaluate(quantile_run: Path) -> None:
    ckpt = quantile_run / "run" / "checkpoints" / "best.npz"
    tmp = quantile_run
    cli("mlptrain.predict", f"ckpt={ckpt}", "input=test.csv", "output=pred.csv", "device=cpu", cwd=tmp)
    cli("mlptrain.evaluate", f"ckpt={ckpt}", "data=test.csv", "device=cpu", cwd=tmp)
    with open(tmp / "pred.csv") as f:
        predicted = [r["class_name"] for r in csv.DictReader(f)]
    with open(tmp / "test.csv") as f:
        truth = [r["label"] for r in csv.DictReader(f)]
    (report,) = (tmp / "run" / "evaluation").rglob("evaluation.json")
    accuracy = np.mean([a == b for a, b in zip(predicted, truth, strict=True)])
    assert json.loads(report.read_text())["acc"] == pytest.approx(accuracy, abs=1e-12)
    assert 0.0 < accuracy <= 1.0 and len(set(predicted)) >= 1


def test_safetensors_carries_the_quantile_table(quantile_run: Path) -> None:
    """(ONNX maps the columns in its graph: tests/test_export_quantile.py.)"""
    ckpt = quantile_run / "run" / "checkpoints" / "best.npz"
    p = Predictor(ckpt, device="cpu")
    out = export(ExportArgs(ckpt=str(ckpt), format="safetensors", output=str(quantile_run / "m.safetensors")))
    _, meta = load_safetensors(out)
    norm = json.loads(meta["mlptrain"])["normalization"]
    assert p.normalization.quantile is not None
    assert norm["method"] == "quantile" and norm["quantile"]["columns"] == p.normalization.quantile.columns.tolist()
    assert_array_equal(np.array(norm["quantile"]["quantiles"]).T, p.normalization.quantile.quantiles)
    assert preprocessing(p)["normalization"] == norm


def test_a_checkpoint_with_a_broken_quantile_table_is_refused(quantile_run: Path) -> None:
    ckpt = checkpoint.load(quantile_run / "run" / "checkpoints" / "best.npz")
    good = ckpt.arrays["data/quantiles"]
    for key, bad in [
        ("data/quantiles", good[::-1].copy()),  # not ascending
        ("data/quantile_columns", np.array([0, 0, 1, 2])),  # a column twice
        ("data/quantile_columns", np.array([0, 1, 2, 99])),  # not a feature
    ]:
        arrays: dict[str, Any] = {**ckpt.arrays, key: bad}
        with pytest.raises(CheckpointError, match=key):
            check_for_scoring(checkpoint.Checkpoint(ckpt.path, arrays, ckpt.meta))


def test_robust_exports_to_onnx_equal_to_predict(tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    write_table(tmp_path / "train.csv", 300, 0)
    args = ["data=file", "data.path=train.csv", "data.target=label", "data.normalize=robust", "epochs=1"]
    cli("mlptrain", *args, "device=cpu", "progress=false", "hydra.run.dir=run", cwd=tmp_path)
    ckpt = tmp_path / "run" / "checkpoints" / "best.npz"
    p = Predictor(ckpt, device="cpu", precision="fp32")
    assert p.normalization.method == "robust" and p.normalization.quantile is None
    out = export(ExportArgs(ckpt=str(ckpt), format="onnx", output=str(tmp_path / "m.onnx")))
    # the table has a text column, so the graph takes the raw columns (mlptrain.inference.onnx_columns)
    frame = pd.read_csv(tmp_path / "train.csv", keep_default_na=False, dtype=str)
    (logits,) = ort.InferenceSession(str(out)).run(["logits"], feeds(p.plan, frame))
    cells = {c: np.char.strip(frame[c].to_numpy().astype(str)) for c in p.plan.names}
    assert_allclose(logits, p.logits(p.encode(cells, "raw", str)), rtol=1e-5, atol=1e-5)


def test_an_unknown_mode_is_one_error_listing_the_choices(tmp_path: Path) -> None:
    proc = cli("mlptrain", "data.normalize=rank", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, ok=False)
    (line,) = [s for s in proc.stderr.splitlines() if s.startswith("error: ")]
    assert "'rank'" in line and f"expected one of [{', '.join(NORMALIZATIONS)}]" in line
    assert NORMALIZATIONS == ("standard", "minmax", "robust", "quantile", "none")
    with pytest.raises(ConfigError, match="expected standard, minmax, robust, quantile or none"):
        normalization("rank", table(10))
    assert Normalization.identity(3).quantile is None


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")  # two epochs: enough to compare
@pytest.mark.parametrize("mode", ["robust", "quantile"])
def test_the_sklearn_estimator_keeps_its_first_fits_scaling_and_scores_raw_rows(mode: str) -> None:
    from mlptrain.sklearn import MLPClassifier

    x = table(400)
    y = (np.log(x[:, 0]) + x[:, 2] > 1.5).astype(np.int64)
    clf = MLPClassifier(hidden_layer_sizes=(16,), max_iter=2, normalize=mode, random_state=0, device="cpu")
    clf.fit(x, y)
    first = clf.predictor_.normalization
    assert first.method == mode and (first.quantile is not None) == (mode == "quantile")
    clf.partial_fit(x[:100] * 10.0, y[:100])  # rows of another spread: the first fit's scaling is kept
    again = clf.predictor_.normalization
    assert_array_equal(again.shift, first.shift)
    assert_array_equal(again.scale, first.scale)
    if first.quantile is not None:
        assert again.quantile is not None
        assert_array_equal(again.quantile.quantiles, first.quantile.quantiles)
    logits = clf.predictor_.logits(again.apply(x), normalised=True)
    assert_array_equal(clf.predict(x), logits.argmax(axis=1))
