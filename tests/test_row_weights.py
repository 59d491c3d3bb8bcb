"""data.weight: a column of row weights in the training loss (the weighted mean, scikit-learn's sample_weight).

A weighted run must equal the run on the table with each row repeated ``w`` times (integer weights, full
batches, float64): a loss that ignored the weights, normalised by the rows instead of the weights, or gathered
another row's weight, would not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import make_cfg, records
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.metrics import mean_squared_error
from test_checkpoint import interrupt_at
from test_column_plan import run

from mlptrain.base.errors import ConfigError, DatasetError, TrainingInterrupted
from mlptrain.config.schema import DatasetName, Task
from mlptrain.data import load_dataset
from mlptrain.data.host_loader import HostLoader
from mlptrain.data.loader import DataLoader
from mlptrain.nn.losses import mse, row_weighted, softmax_cross_entropy
from mlptrain.run import checkpoint
from mlptrain.run.run import train
from mlptrain.step.checks import validate


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "cache"))


def _table(n: int, seed: int, regression: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` rows: 3 features, a label (or a target) and an integer weight 0..3."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3))
    y = x @ [1.0, -2.0, 0.5] + 0.1 * rng.standard_normal(n) if regression else (x[:, 0] + x[:, 1] > 0).astype(int)
    w = rng.integers(0, 4, n)
    w[:2] = 1  # both classes keep rows
    return x, y, w


def _write(path: Path, x: np.ndarray, y: np.ndarray, w: np.ndarray | None, header: str = "a,w,b,c,label") -> Path:
    """A CSV whose weight column ``w`` (if given) sits among the features."""
    lines = [header if w is not None else header.replace("w,", "")]
    for i in range(len(x)):
        cells = [repr(float(x[i, 0])), *([str(w[i])] if w is not None else []), *map(repr, x[i, 1:].tolist())]
        lines.append(",".join([*cells, repr(y[i].item())]))
    path.write_text("\n".join(lines) + "\n")
    return path


def _file_cfg(path: Path, test: Path, **over: Any) -> Any:
    base = {
        "data__name": DatasetName.file,
        "data__path": str(path),
        "data__test_path": str(test),
        "data__target": "label",
        "data__val_fraction": 0.0,
        "data__normalize": "none",  # statistics of the weighted and the repeated tables would differ
        "data__batch_size": 4096,  # one batch: the weighted mean of the table, as the repeated table's mean
        "precision__name": "fp64",
        "epochs": 4,
    }
    return make_cfg(**{**base, **over})


@pytest.mark.parametrize(
    "case", ["classification", "class_weight", "regression"], ids=["labels", "times-class-weight", "regression"]
)
def test_a_weighted_run_equals_the_run_on_the_rows_repeated_w_times(tmp_path: Path, case: str) -> None:
    regression = case == "regression"
    x, y, w = _table(60, 0, regression)
    xt, yt, _ = _table(20, 1, regression)
    test = _write(tmp_path / "test.csv", xt, yt, None)
    weighted = _write(tmp_path / "weighted.csv", x, y, w)
    rep = np.repeat(np.arange(len(x)), w)  # row i, w_i times (a weight of 0: left out)
    repeated = _write(tmp_path / "repeated.csv", x[rep], y[rep], None)
    over: dict[str, Any] = {}
    if regression:
        over = {"data__task": Task.regression, "model__loss": "mse", "data__target_scaling": "none"}
    if case == "class_weight":
        over = {"model__class_weight": [0.5, 3.0]}  # times the row weights
    train(_file_cfg(weighted, test, data__weight="w", **over), tmp_path / "w")
    train(_file_cfg(repeated, test, **over), tmp_path / "r")
    a, b = ([(r["train/loss"], r.get("test/loss", 0.0)) for r in records(tmp_path / d)[:8]] for d in ("w", "r"))
    assert len(a) == len(b) == 8 and a[0][0] != a[-1][0]  # 4 steps and 4 epochs, the loss moving
    assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    ca, cb = (checkpoint.load(tmp_path / run_ / "checkpoints" / "last.npz") for run_ in ("w", "r"))
    for k in (k for k in cb.arrays if k.startswith("param/")):
        assert_allclose(ca.arrays[k], cb.arrays[k], rtol=1e-11, atol=1e-13)
    unweighted = _write(tmp_path / "plain.csv", x, y, None)  # the check can fail: the weights change the run
    train(_file_cfg(unweighted, test, **over), tmp_path / "u")
    assert abs(records(tmp_path / "u")[6]["train/loss"] - b[6][0]) > 1e-4


def test_the_weight_column_is_no_feature_and_the_weights_are_the_training_rows(tmp_path: Path) -> None:
    x, y, w = _table(50, 2)
    path = _write(tmp_path / "t.csv", x, y, w)
    cfg = make_cfg(data__name=DatasetName.file, data__path=str(path), data__target="label", data__weight="w").data
    ds = load_dataset(cfg)
    assert ds.feature_names == ["a", "b", "c"] and ds.num_features == 3
    assert ds.w_train is not None and len(ds.w_train) == len(ds.x_train)
    # each training row's weight is its own: find the rows by their features (normalised: undo it)
    raw = ds.x_train * ds.normalization.scale + ds.normalization.shift
    rows = [int(np.argmin(np.abs(x - r).sum(1))) for r in raw]
    assert_array_equal(ds.w_train, w[rows].astype(np.float64))
    # through the column plan too (data.drop reads the table as text cells), and data.features need not name it
    for over in ({"drop": ["c"]}, {"features": ["a", "b"]}):
        plan_cfg = make_cfg(
            **{f"data__{k}": v for k, v in over.items()},
            **{"data__name": DatasetName.file, "data__path": str(path), "data__target": "label", "data__weight": "w"},
        ).data
        ds2 = load_dataset(plan_cfg)
        assert ds2.feature_names == ["a", "b"] and ds2.columns is not None
        assert_array_equal(ds2.w_train, ds.w_train)  # the same split, the same weights


@pytest.mark.parametrize(
    ("cell", "said"),
    [
        ("-1", "line 5, column 'w' (data.weight): -1 is not a row weight"),
        ("abc", "line 5, column 'w' (data.weight): 'abc' is not a row weight"),
        ("", "line 5, column 'w' (data.weight): an empty cell is not a row weight"),
        ("inf", "line 5, column 'w' (data.weight): inf is not a row weight"),
    ],
    ids=["negative", "text", "empty", "inf"],
)
def test_a_bad_weight_cell_is_one_error_naming_its_line(tmp_path: Path, cell: str, said: str) -> None:
    x, y, w = _table(30, 3)
    path = _write(tmp_path / "t.csv", x, y, w)
    lines = path.read_text().splitlines()
    parts = lines[4].split(",")
    parts[1] = cell
    lines[4] = ",".join(parts)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match="weights must be finite numbers >= 0") as err:
        load_dataset(make_cfg(data__name=DatasetName.file, data__path=str(path), data__weight="w").data)
    assert said in str(err.value)


def test_a_missing_or_zero_weight_column_and_a_weight_named_twice_are_refused(tmp_path: Path) -> None:
    x, y, w = _table(30, 4)
    path = _write(tmp_path / "t.csv", x, y, w)
    data = {"data__name": DatasetName.file, "data__path": str(path)}
    with pytest.raises(DatasetError, match=r"has no column 'weight' \(data.weight\); its columns are a, w, b, c"):
        load_dataset(make_cfg(**data, data__weight="weight").data)
    zero = _write(tmp_path / "z.csv", x, y, np.zeros(len(x), int))
    with pytest.raises(DatasetError, match=r"column 'w' \(data.weight\) of the \d+ training rows sum to 0"):
        load_dataset(make_cfg(**{**data, "data__path": str(zero)}, data__weight="w").data)
    with pytest.raises(ConfigError, match="data.weight=label is named by data.target or data.drop too"):
        validate(make_cfg(**data, data__weight="label"))
    with pytest.raises(ConfigError, match="data.weight"):  # a setting of data=file only
        validate(make_cfg(data__weight="w"))


def test_the_loaders_gather_each_rows_weight_with_it() -> None:
    rng = np.random.default_rng(5)
    x, y, w = rng.standard_normal((23, 4)), rng.integers(0, 3, 23), rng.uniform(0, 2, 23)
    for kind in (DataLoader, HostLoader):
        ld = kind(x, y, 5, xp=np, dtype=np.float32, shuffle=True, drop_last=False, seed=7, w=w)
        perm = ld.permutation(1)
        for i, (xb, yw) in enumerate(ld.epoch(1)):
            rows = perm[i * 5 : (i + 1) * 5]
            assert yw.dtype == np.float64 and yw.shape == (len(rows), 2)
            assert_array_equal(yw[:, 0], y[rows])
            assert_array_equal(yw[:, 1], w[rows])
            assert_array_equal(xb, x[rows].astype(np.float32))


def test_row_weighted_losses_are_sklearns_and_torchs_weighted_means() -> None:
    rng = np.random.default_rng(6)
    z, t, w = rng.standard_normal((17, 3)), rng.standard_normal((17, 3)), rng.uniform(0, 3, 17)
    yw = np.concatenate([t, w[:, None]], axis=1)
    loss, d, _ = row_weighted(mse, classification=False)(z, yw, 2.0)
    t32 = t.astype(np.float32).astype(np.float64)  # the targets travel as float32, as a regression's do
    ref = mean_squared_error(t32, z, sample_weight=w)  # the mean over the outputs, weighted over the rows
    assert_allclose(float(loss), ref, rtol=1e-12)
    tz = torch.tensor(z, requires_grad=True)
    tl = ((tz - torch.tensor(t32)) ** 2).mean(1) @ torch.tensor(w) / w.sum()
    (tl * 2.0).backward()
    assert_allclose(d, tz.grad.numpy(), rtol=1e-12, atol=1e-15)
    labels = rng.integers(0, 3, 17)
    loss, d, _ = row_weighted(softmax_cross_entropy, classification=True)(z, np.stack([labels, w], 1).astype(float))
    ref_loss, _, _ = softmax_cross_entropy(z, labels, row_weight=w)
    tz = torch.tensor(z, requires_grad=True)
    tl = (torch.nn.functional.cross_entropy(tz, torch.tensor(labels), reduction="none") @ torch.tensor(w)) / w.sum()
    tl.backward()
    assert_allclose(float(loss), tl.item(), rtol=1e-12)
    assert_allclose(float(ref_loss), tl.item(), rtol=1e-12)
    assert_allclose(d, tz.grad.numpy(), rtol=1e-12, atol=1e-15)


def test_a_resumed_weighted_run_equals_the_uninterrupted_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x, y, w = _table(80, 7)
    path = _write(tmp_path / "t.csv", x, y, w)
    over = {"data__name": DatasetName.file, "data__path": str(path), "data__weight": "w", "data__batch_size": 16}
    train(make_cfg(**over), tmp_path / "straight")  # parses the file into the data cache
    interrupt_at(monkeypatch, 7)
    with pytest.raises(TrainingInterrupted):
        train(make_cfg(**over), tmp_path / "run")  # read from the cache: the weights with it
    monkeypatch.undo()
    train(make_cfg(**over, resume="last"), tmp_path / "run")
    assert records(tmp_path / "run") == records(tmp_path / "straight")
    unweighted = {k: v for k, v in over.items() if k != "data__weight"}
    train(make_cfg(**unweighted, data__drop=["w"]), tmp_path / "plain")  # the check can fail
    assert records(tmp_path / "plain")[0]["train/loss"] != records(tmp_path / "straight")[0]["train/loss"]


def test_predict_and_evaluate_ignore_the_weight_column(tmp_path: Path) -> None:
    x, y, w = _table(120, 8)
    _write(tmp_path / "t.csv", x, y, w)
    xt, yt, wt = _table(40, 9)
    _write(tmp_path / "with.csv", xt, yt, wt)
    _write(tmp_path / "without.csv", xt, yt, None)
    args = ["data=file", "data.path=t.csv", "data.target=label", "data.weight=w", "epochs=3", "device=cpu"]
    run("mlptrain", *args, "progress=false", "hydra.run.dir=run", cwd=tmp_path)
    ckpt = tmp_path / "run" / "checkpoints" / "last.npz"
    assert checkpoint.load(ckpt).meta["config"]["data"]["weight"] == "w"
    preds = {}
    for name in ("with", "without"):
        out = run(
            "mlptrain.predict",
            f"ckpt={ckpt}",
            f"input={name}.csv",
            f"output={name}.pred.csv",
            "device=cpu",
            cwd=tmp_path,
        )
        assert ("ignoring the column(s) 'w'" in out.stderr) == (name == "with"), out.stderr
        preds[name] = (tmp_path / f"{name}.pred.csv").read_text()
    assert preds["with"] == preds["without"]
    run("mlptrain.evaluate", f"ckpt={ckpt}", "data=with.csv", "device=cpu", cwd=tmp_path)
    (report,) = (tmp_path / "run" / "evaluation").rglob("evaluation.json")
    predicted = [line.split(",")[-1] for line in preds["with"].splitlines()[1:]]
    header = preds["with"].splitlines()[0].split(",")
    assert header[-1] in ("class_name", "class_id"), header
    accuracy = np.mean([p == str(t) for p, t in zip(predicted, yt, strict=True)])
    assert json.loads(report.read_text())["acc"] == pytest.approx(accuracy, abs=1e-12)


@pytest.mark.parametrize("residency", ["host", "stream"])
def test_the_host_resident_and_streamed_loaders_carry_the_weights(tmp_path: Path, residency: str) -> None:
    x, y, w = _table(90, 10)
    path = _write(tmp_path / "t.csv", x, y, w)
    over = {"data__name": DatasetName.file, "data__path": str(path), "data__weight": "w", "data__batch_size": 16}
    train(make_cfg(**over), tmp_path / "device")
    train(make_cfg(**over, data__residency=residency), tmp_path / residency)
    assert records(tmp_path / residency) == records(tmp_path / "device")


def test_npz_and_parquet_tables_give_the_csvs_weights(tmp_path: Path) -> None:
    x, y, w = _table(40, 11)
    csv_ds = load_dataset(
        make_cfg(
            data__name=DatasetName.file, data__path=str(_write(tmp_path / "t.csv", x, y, w)), data__weight="w"
        ).data
    )
    table = np.concatenate([x[:, :1], w[:, None], x[:, 1:]], axis=1)  # the CSV's column order: a, w, b, c
    np.savez(tmp_path / "t.npz", x=table, y=y, feature_names=np.array(["a", "w", "b", "c"]))
    paths = [tmp_path / "t.npz"]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        pass
    else:
        columns = {"a": x[:, 0], "w": w, "b": x[:, 1], "c": x[:, 2], "label": y}
        pq.write_table(pa.table(columns), tmp_path / "t.parquet")
        paths.append(tmp_path / "t.parquet")
    for path in paths:
        cfg = make_cfg(data__name=DatasetName.file, data__path=str(path), data__target="label", data__weight="w")
        ds = load_dataset(cfg.data)
        assert ds.feature_names == ["a", "b", "c"], path
        assert_array_equal(ds.w_train, csv_ds.w_train)
        assert_array_equal(ds.x_train, csv_ds.x_train)


def test_a_batch_of_only_zero_weight_rows_stops_the_run_with_an_error_naming_the_zero_weights(tmp_path: Path) -> None:
    """A batch whose rows all weigh 0 has the weighted mean 0/0 (a NaN loss): the error says so, not only
    'lower the learning rate'; the same weights in one batch train."""
    from mlptrain.base.errors import NonFiniteError

    x, y, _ = _table(40, 0)
    w = np.zeros(40, np.int64)
    w[:4] = 1  # rows 0-3 weigh 1, the other 36 nothing: most batches of 2 weigh 0
    test = _write(tmp_path / "test.csv", *_table(10, 1)[:2], None)
    path = _write(tmp_path / "w.csv", x, y, w)
    with pytest.raises(NonFiniteError, match=r"training loss is nan.*36 of the 40 training rows weigh 0.*batch size"):
        train(_file_cfg(path, test, data__weight="w", data__batch_size=2), tmp_path / "small")
    train(_file_cfg(path, test, data__weight="w"), tmp_path / "one")  # one batch of 40: trains
    assert np.isfinite(records(tmp_path / "one")[-1]["train/loss"])
