"""The column plan of ``data=file`` (mlptrain.data.files.plan): kinds, one-hot levels, median fills, against
scikit-learn's encoders; data.drop and data.features; the plan through a checkpoint; raw rows scored by predict."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.impute import SimpleImputer
from sklearn.preprocessing import OneHotEncoder

from mlptrain.base.errors import ConfigError, DatasetError
from mlptrain.cli.export import preprocessing
from mlptrain.config.schema import DataConfig, DatasetName
from mlptrain.data import load_dataset
from mlptrain.data.files.plan import ColumnPlan, fit_plan
from mlptrain.inference.predictor import Predictor, predict

REPO = Path(__file__).resolve().parent.parent
HEADER = ["id", "age", "income", "student", "region", "code", "label"]


def make_table(path: Path, n: int = 240, seed: int = 0, empty: float = 0.1) -> list[list[str]]:
    """A table of mixed kinds: an id, two numeric columns with empty cells (one skewed), a yes/no text column,
    a text column with a rare level and empty cells, an integer-coded category, and a label that depends on them."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        age, income = rng.normal(40, 10), rng.lognormal(10, 1)
        student = str(rng.choice(["Yes", "No"]))
        region = str(rng.choice(["north", "south", "east", "west", "polar"], p=[0.3, 0.3, 0.2, 0.19, 0.01]))
        code = int(rng.integers(1, 4)) * (10 if rng.random() < 0.2 else 1)  # 1, 2, 3, 10, 20, 30
        label = "good" if (student == "Yes") ^ (age > 40) ^ (region == "east") else "bad"
        cells = [str(1000 + i), f"{age:.3f}", f"{income:.2f}", student, region, str(code), label]
        for j in (1, 2, 4):
            if rng.random() < empty:
                cells[j] = ["", "NA", "nan"][j % 3]
        rows.append(cells)
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([HEADER, *rows])
    return rows


def text(values: list[Any]) -> np.ndarray:
    return np.char.strip(np.asarray(values, dtype=str))


def where(row: int) -> str:
    return f"row {row}"


# --- the plan against scikit-learn ---------------------------------------------------------------


def test_one_hot_is_scikit_learns_on_the_training_rows_unseen_levels_all_zeros() -> None:
    rng = np.random.default_rng(1)
    column = rng.choice(["red", "green", "blue", "teal"], size=200)
    column[:5] = "violet"  # not among the training rows
    train = np.arange(5, 150)
    plan = fit_plan({"colour": text(column)}, train, [], 1)
    test = text([*column[150:], "violet", "ochre"])
    x, unknown = plan.encode({"colour": test}, where, "test")
    enc = OneHotEncoder(handle_unknown="ignore").fit(column[train].reshape(-1, 1))
    assert_array_equal(x, enc.transform(test.reshape(-1, 1)).toarray())
    assert plan.feature_names == [f"colour={c}" for c in enc.categories_[0]]
    assert unknown == {"colour": 2}


def test_rare_levels_are_one_column_as_scikit_learns_infrequent_one() -> None:
    column = np.array(["a"] * 10 + ["b"] * 6 + ["c"] * 2 + ["d"] * 1 + ["e"] * 2)
    plan = fit_plan({"k": text(column)}, np.arange(len(column)), [], 3)
    enc = OneHotEncoder(min_frequency=3, handle_unknown="infrequent_if_exist").fit(column.reshape(-1, 1))
    x, _ = plan.encode({"k": text(column)}, where, "t")
    assert_array_equal(x, enc.transform(column.reshape(-1, 1)).toarray())
    assert plan.feature_names == ["k=a", "k=b", "k=<rare>"]
    assert plan.columns[0].rare == ["c", "d", "e"]


def test_the_median_fill_and_its_indicator_are_scikit_learns() -> None:
    rng = np.random.default_rng(2)
    a, b = rng.lognormal(size=100), rng.normal(size=100)
    a[rng.random(100) < 0.2] = np.nan
    b[80:] = np.nan  # empty in the test rows only: filled, no indicator (none in training)
    train, test = np.arange(80), np.arange(60, 100)
    cells = {"a": text([repr(v) for v in a.tolist()]), "b": text(["" if np.isnan(v) else repr(v) for v in b.tolist()])}
    plan = fit_plan(cells, train, [], 1)
    x, _ = plan.encode({k: v[test] for k, v in cells.items()}, where, "t")
    imp = SimpleImputer(strategy="median", add_indicator=True).fit(np.stack([a, b], axis=1)[train])
    want = imp.transform(np.stack([a, b], axis=1)[test])  # (n, 2 values + 1 indicator of a)
    assert plan.feature_names == ["a", "a_missing", "b"]
    assert_allclose(x, want[:, [0, 2, 1]], rtol=0, atol=0)


def test_empty_cells_in_every_column_kind() -> None:
    cells = {
        "num": text(["1.5", "", "2.5", "NA", "4"]),
        "txt": text(["x", "", "y", "x", "NaN"]),
        "code": text(["1", "2", "", "10", "2.0"]),
    }
    plan = fit_plan(cells, np.arange(5), ["code"], 1)
    assert plan.feature_names == [
        *["num", "num_missing"],
        *["txt=<empty>", "txt=x", "txt=y"],
        *["code=1", "code=2", "code=10", "code=<empty>"],  # integer codes in numeric order; 2.0 is 2
    ]
    x, unknown = plan.encode(cells, where, "t")
    assert_array_equal(x[:, :2], [[1.5, 0], [2.5, 1], [2.5, 0], [2.5, 1], [4, 0]])  # median of 1.5, 2.5, 4
    assert_array_equal(x[:, 2:5], [[0, 1, 0], [1, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]])
    assert_array_equal(x[:, 5:], [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0]])
    assert unknown == {}


def test_a_column_numeric_in_training_and_text_in_the_test_file_is_one_clear_error() -> None:
    plan = fit_plan({"age": text(["1", "2", "3"])}, np.arange(3), [], 1)
    with pytest.raises(DatasetError) as err:
        plan.encode({"age": text(["4", "old"])}, where, "input file t.csv")
    assert "input file t.csv row 1, column 'age': 'old' is not a number; the column was numeric in the training" in str(
        err.value
    )


def test_the_plan_survives_json() -> None:
    cells = {"a": text(["1", "", "3"]), "b": text(["p", "q", ""])}
    plan = fit_plan(cells, np.arange(3), [], 1)
    again = ColumnPlan.from_meta(json.loads(json.dumps(plan.to_meta())))
    assert again == plan
    assert_array_equal(again.encode(cells, where, "t")[0], plan.encode(cells, where, "t")[0])


# --- data=file -----------------------------------------------------------------------------------


def data_cfg(path: Path, **kw: Any) -> DataConfig:
    kw.setdefault("features", None)
    return DataConfig(name=DatasetName.file, path=str(path), target="label", cache=False, **kw)


def test_drop_and_features_choose_the_columns(tmp_path: Path) -> None:
    make_table(tmp_path / "t.csv")
    ds = load_dataset(data_cfg(tmp_path / "t.csv", drop=["id", "income"]))
    assert ds.feature_names is not None and [n for n in ds.feature_names if "=" not in n] == [
        "age",
        "age_missing",
        "code",
    ]
    assert ds.columns is not None and [c["name"] for c in ds.columns["columns"]] == ["age", "student", "region", "code"]
    kept = load_dataset(data_cfg(tmp_path / "t.csv", features=["student", "age"]))
    assert kept.columns is not None and [c["name"] for c in kept.columns["columns"]] == ["age", "student"]


@pytest.mark.parametrize("setting", ["drop", "features", "categorical"])
def test_an_unknown_column_name_is_one_error_listing_the_files_columns(tmp_path: Path, setting: str) -> None:
    make_table(tmp_path / "t.csv")
    with pytest.raises(DatasetError) as err:
        load_dataset(data_cfg(tmp_path / "t.csv", **{setting: ["ID"]}))
    assert f"has no column 'ID' (data.{setting}); its columns are id, age, income, student, region, code, label" in str(
        err.value
    )


def test_impute_error_refuses_an_empty_cell_and_stream_refuses_a_plan(tmp_path: Path) -> None:
    make_table(tmp_path / "t.csv")
    with pytest.raises(DatasetError, match=r"line \d+, column '(age|income|region)': an empty cell"):
        load_dataset(data_cfg(tmp_path / "t.csv", impute="error"))
    with pytest.raises(ConfigError, match=r"data.residency=stream: data file .*\(\d+\.\d MiB here, against") as err:
        load_dataset(data_cfg(tmp_path / "t.csv", drop=["id"], residency="stream"))
    assert "set data.residency=host" in str(err.value) and "streams once converted to numbers" in str(err.value)
    assert load_dataset(data_cfg(tmp_path / "t.csv", drop=["id"], residency="host")).columns is not None


def test_a_table_of_numbers_has_no_plan(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    with open(tmp_path / "n.csv", "w", newline="") as f:
        csv.writer(f).writerows([["a", "b", "label"], *[[*rng.normal(size=2), i % 2] for i in range(50)]])
    ds = load_dataset(data_cfg(tmp_path / "n.csv"))
    assert ds.columns is None and ds.feature_names == ["a", "b"]


def test_the_plan_is_fitted_on_the_train_split(tmp_path: Path) -> None:
    rows = make_table(tmp_path / "t.csv", empty=0.0)
    ds = load_dataset(data_cfg(tmp_path / "t.csv", drop=["id"], test_fraction=0.5, val_fraction=0.2))
    assert ds.columns is not None and ds.normalization is not None
    age = ds.columns["columns"][0]
    assert age["name"] == "age" and not age["indicator"]
    train_ages = ds.x_train[:, 0].astype(np.float64) * ds.normalization.scale[0] + ds.normalization.shift[0]
    assert len(train_ages) < len(rows) / 2
    assert age["fill"] == pytest.approx(np.median(train_ages), abs=1e-4)  # float32 splits: to their precision
    assert age["fill"] != pytest.approx(np.median([float(r[1]) for r in rows]), abs=1e-4)


def test_the_one_hot_and_missing_columns_reach_the_model_as_0_1(tmp_path: Path) -> None:
    """Standardised, the rare level ``polar`` (1%) would be about 10 where it is set; the plan's 0/1 columns
    stay 0/1 (shift 0, scale 1 in the checkpoint's normalisation), the numeric columns are standardised."""
    make_table(tmp_path / "t.csv", n=600)
    ds = load_dataset(data_cfg(tmp_path / "t.csv", drop=["id"], min_frequency=1))
    assert ds.feature_names is not None and ds.normalization is not None
    names = ds.feature_names
    flags = [n.endswith("_missing") or "=" in n for n in names]
    assert "region=polar" in names and sum(flags) >= 10
    for j, (name, flag) in enumerate(zip(names, flags, strict=True)):
        values = np.unique(ds.x_train[:, j])
        if flag:
            assert (ds.normalization.shift[j], ds.normalization.scale[j]) == (0.0, 1.0), name
            assert values.tolist() == [0.0, 1.0], name
        else:
            assert abs(float(ds.x_train[:, j].mean())) < 1e-5 and float(ds.x_train[:, j].std()) == pytest.approx(
                1, 1e-4
            )


def test_parquet_and_npz_tables_get_the_csvs_plan(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = make_table(tmp_path / "t.csv")
    want = load_dataset(data_cfg(tmp_path / "t.csv", drop=["id", "code"]))
    columns = {h: [r[j] for r in rows] for j, h in enumerate(HEADER)}
    typed = {
        "age": pa.array([float(v) if v not in ("", "NA", "nan") else None for v in columns["age"]]),
        "income": pa.array([float(v) if v not in ("", "NA", "nan") else None for v in columns["income"]]),
        "student": pa.array(columns["student"]),
        "region": pa.array([v if v not in ("", "NA", "nan") else None for v in columns["region"]]),
        "label": pa.array(columns["label"]),
    }
    pq.write_table(pa.table(typed), tmp_path / "t.parquet")
    got = load_dataset(data_cfg(tmp_path / "t.parquet"))
    assert got.columns == want.columns
    assert_array_equal(got.x_train, want.x_train)
    x = np.array([[np.nan if v in ("", "NA", "nan") else float(v) for v in columns[c]] for c in ("age", "income")]).T
    np.savez(tmp_path / "t.npz", x=x, y=np.array(columns["label"]), feature_names=np.array(["age", "income"]))
    numeric = load_dataset(data_cfg(tmp_path / "t.npz", features=["age", "income"]))
    assert numeric.feature_names == ["age", "age_missing", "income", "income_missing"]
    assert numeric.columns is not None and numeric.columns["columns"][0]["fill"] == want.columns["columns"][0]["fill"]


# --- trained from the raw file, scored on raw rows ---------------------------------------------------


def run(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "HYDRA_MAIN_MODULE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_trained_from_the_raw_csv_and_scored_on_raw_rows_as_evaluate_scores_them(tmp_path: Path) -> None:
    make_table(tmp_path / "train.csv", n=400, seed=0)
    rows = make_table(tmp_path / "test.csv", n=80, seed=1)
    order = ["extra", "label", "code", "region", "student", "income", "age", "id"]  # reordered, one extra column
    raw = [dict(zip(HEADER, r, strict=True), extra="zzz") for r in rows]
    raw[0]["region"], raw[1]["age"], raw[2]["student"] = "mars", "", ""  # unseen levels, an empty cell
    with open(tmp_path / "raw.csv", "w", newline="") as f:
        csv.writer(f).writerows([order, *[[r[k] for k in order] for r in raw]])
    args = ["data=file", f"data.path={tmp_path / 'train.csv'}", "data.target=label", "data.drop=[id]"]
    run("mlptrain", *args, "epochs=3", "device=cpu", "progress=false", "hydra.run.dir=run", cwd=tmp_path)
    ckpt = tmp_path / "run" / "checkpoints" / "best.npz"
    assert "a level of their own in region" in (tmp_path / "run" / "mlptrain.log").read_text()
    out = run("mlptrain.predict", f"ckpt={ckpt}", "input=raw.csv", "output=pred.csv", "device=cpu", cwd=tmp_path)
    assert "levels never seen in training, scored as unknown (all zeros): student (1), region (1)" in out.stderr
    run("mlptrain.evaluate", f"ckpt={ckpt}", "data=raw.csv", "device=cpu", cwd=tmp_path)
    with open(tmp_path / "pred.csv") as f:
        predicted = [r["class_name"] for r in csv.DictReader(f)]
    (report,) = (tmp_path / "run" / "evaluation").rglob("evaluation.json")
    accuracy = np.mean([p == r["label"] for p, r in zip(predicted, raw, strict=True)])
    assert json.loads(report.read_text())["acc"] == pytest.approx(accuracy, abs=1e-12)
    p = Predictor(ckpt, device="cpu")  # the plan through the checkpoint, and raw rows in a DataFrame
    assert p.plan is not None and p.input_names == ["age", "income", "student", "region", "code"]
    ds = load_dataset(data_cfg(tmp_path / "train.csv", drop=["id"]))  # the run's data settings: the same plan
    assert p.plan.to_meta() == ds.columns and p.feature_names == ds.feature_names
    assert preprocessing(p)["column_plan"] == ds.columns  # written beside an export's weights
    pd = pytest.importorskip("pandas")
    frame = pd.read_csv(tmp_path / "raw.csv", dtype=str, keep_default_na=False)
    assert_array_equal(np.asarray(p.class_name(predict(p, frame))), predicted)


def test_a_table_with_a_plan_trains_host_resident_as_it_trains_on_the_device(tmp_path: Path) -> None:
    """data.residency=host takes the plan's encoded splits (stream is refused: the text is in memory already)."""
    from helpers import make_cfg, records

    from mlptrain.run.run import train

    make_table(tmp_path / "t.csv", n=200)
    over = {"data__name": DatasetName.file, "data__path": str(tmp_path / "t.csv"), "data__drop": ["id"]}
    train(make_cfg(**over, data__batch_size=32), tmp_path / "device")
    train(make_cfg(**over, data__batch_size=32, data__residency="host"), tmp_path / "host")
    got = records(tmp_path / "host")
    assert got == records(tmp_path / "device") and got[0]["train/loss"] > 0
