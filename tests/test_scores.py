"""The scores users read (mlptrain.nn.scores): against scikit-learn's, on constructed cases and on real runs."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg
from sklearn import datasets, metrics

from mlptrain.base.errors import ConfigError
from mlptrain.config.schema import DatasetName, Task
from mlptrain.data.files.readers import write_csv
from mlptrain.inference.predictor import softmax
from mlptrain.nn import scores
from mlptrain.run import checkpoint
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train
from mlptrain.step.trainer import Trainer


def _sklearn_classification(y: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    pred, p = logits.argmax(axis=1), softmax(logits.astype(np.float64))
    labels = np.arange(logits.shape[1])
    prec, rec, f1, _ = metrics.precision_recall_fscore_support(y, pred, average="macro", zero_division=0)
    out = {
        "balanced_acc": metrics.balanced_accuracy_score(y, pred),
        "precision_macro": prec,
        "recall_macro": rec,
        "f1_macro": f1,
        "log_loss": metrics.log_loss(y, p, labels=labels),
    }
    if logits.shape[1] == 2:
        out["roc_auc"] = metrics.roc_auc_score(y, p[:, 1])
    return out


def test_classification_scores_on_a_confusion_matrix_with_an_absent_class() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 300)  # class 4 never true, sometimes predicted; class 5 neither
    pred = np.where(rng.random(300) < 0.6, y, rng.integers(0, 5, 300))
    confusion = np.zeros((6, 6))
    np.add.at(confusion, (y, pred), 1)
    got = scores.classification_scores(confusion, 0.5)
    prec, rec, f1, _ = metrics.precision_recall_fscore_support(y, pred, average="macro", zero_division=0)
    with pytest.warns(UserWarning):  # scikit-learn: y_pred contains classes not in y_true
        balanced = metrics.balanced_accuracy_score(y, pred)
    want = {"balanced_acc": balanced, "precision_macro": prec, "recall_macro": rec, "f1_macro": f1}
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-12), k
    pc = scores.per_class(confusion)
    p, r, f, s = metrics.precision_recall_fscore_support(y, pred, labels=range(6), zero_division=0)
    np.testing.assert_allclose(np.stack([pc["precision"], pc["recall"], pc["f1"]]), [p, r, f], atol=1e-12)
    np.testing.assert_array_equal(pc["support"], s)


def test_roc_auc_counts_ties_half_as_scikit_learn_does() -> None:
    rng = np.random.default_rng(1)
    label = rng.integers(0, 2, 500)
    score = np.round(label + rng.standard_normal(500), 1)  # many ties
    assert scores.roc_auc(score, label) == pytest.approx(metrics.roc_auc_score(label, score), abs=1e-12)
    assert np.isnan(scores.roc_auc(score, np.ones(500)))


def test_regression_scores_in_units_from_standardised_sums() -> None:
    rng = np.random.default_rng(2)
    y = rng.standard_normal((200, 3)) * [1.0, 50.0, 0.01] + [0.0, 1000.0, -3.0]
    out = y + rng.standard_normal((200, 3)) * [0.3, 20.0, 0.002]
    shift, scale = y.mean(axis=0), y.std(axis=0)
    sums = scores.regression_sums((out - shift) / scale, (y - shift) / scale)
    got = scores.scores(sums.ravel(), None, None, 200, scale=scale)
    assert got["rmse"] == pytest.approx(np.sqrt(metrics.mean_squared_error(y, out)), rel=1e-9)
    assert got["mae"] == pytest.approx(metrics.mean_absolute_error(y, out), rel=1e-9)
    assert got["r2"] == pytest.approx(metrics.r2_score(y, out), rel=1e-9)


def _last_val(cfg, run: Path) -> tuple[dict, np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
    """The last epoch record, and the val split's outputs of last.npz (in the targets' units) and its truth."""
    tr = Trainer(cfg)
    last = checkpoint.load(run / "checkpoints/last.npz")
    tr.model.load_state_dict({k[6:]: v for k, v in last.arrays.items() if k.startswith("param/")})
    z, y = tr.model.forward(tr.dataset.x_val, keep=False), tr.dataset.y_val
    if tr.dataset.target_scaling is not None:
        z, y = tr.dataset.target_scaling.undo(z), tr.dataset.target_scaling.undo(y)
    epochs = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "epoch"]
    return epochs[-1], z, y


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_a_binary_runs_scores_are_scikit_learns_on_its_checkpoints_predictions(tmp_path: Path, loss: str) -> None:
    x, y = datasets.load_breast_cancer(return_X_y=True)
    write_csv(tmp_path / "bc.csv", x, y, [f"f{i}" for i in range(x.shape[1])], target="label")
    cfg = make_cfg(data__name=DatasetName.file, data__path=str(tmp_path / "bc.csv"), data__cache=False)
    cfg.model.loss = loss  # mse: on the one-hot labels, the log loss from the probabilities
    cfg.data.task = Task.classification
    summary = train(cfg, tmp_path / "run")
    rec, z, yv = _last_val(cfg, tmp_path / "run")
    want = _sklearn_classification(yv, z)
    assert set(want) == {k[4:] for k in rec if k.startswith("val/")} - {"loss", "acc"}
    for k, v in want.items():
        assert rec[f"val/{k}"] == pytest.approx(v, rel=1e-6, abs=1e-6), k
        assert summary[f"test/{k}"] == rec[f"test/{k}"]
    if loss == "cross_entropy":
        assert rec["val/log_loss"] == rec["val/loss"]
    with open(tmp_path / "run/metrics.csv", newline="") as f:  # metrics.csv has the scores' columns too
        row = [r for r in csv.DictReader(f) if r["kind"] == "epoch"][-1]
    assert float(row["val/roc_auc"]) == pytest.approx(rec["val/roc_auc"], rel=1e-9)
    assert float(row["test/f1_macro"]) == pytest.approx(rec["test/f1_macro"], rel=1e-9)
    assert rec["val/balanced_acc"] != rec["val/acc"]  # imbalanced classes: a different number


def test_a_ten_class_runs_scores_are_scikit_learns(tmp_path: Path, capsys: Any) -> None:
    cfg = make_cfg(epochs=2)
    s = train(cfg, tmp_path / "run")
    line = capsys.readouterr().out.strip().splitlines()[-1]  # the summary line: accuracy and balanced accuracy
    assert f"| test acc {s['test/acc']:.4f} balanced {s['test/balanced_acc']:.4f} loss {s['test/loss']:.4f} |" in line
    rec, z, yv = _last_val(cfg, tmp_path / "run")
    for k, v in _sklearn_classification(yv, z).items():
        assert rec[f"val/{k}"] == pytest.approx(v, rel=1e-6, abs=1e-6), k
    assert "val/roc_auc" not in rec


def test_a_regression_runs_scores_are_scikit_learns_in_the_targets_units(tmp_path: Path, capsys: Any) -> None:
    x, y = datasets.load_diabetes(return_X_y=True)
    write_csv(tmp_path / "d.csv", x, y.astype(np.float64) + 0.5, [f"f{i}" for i in range(10)], target="label")
    cfg = make_cfg(data__name=DatasetName.file, data__path=str(tmp_path / "d.csv"), data__cache=False)
    cfg.model.loss = "mse"
    s = train(cfg, tmp_path / "run")
    line = capsys.readouterr().out.strip().splitlines()[-1]  # the summary line: the loss, RMSE and R²
    assert f"| test loss {s['test/loss']:.4g} rmse {s['test/rmse']:.4g} r2 {s['test/r2']:.4f} |" in line
    rec, z, yv = _last_val(cfg, tmp_path / "run")
    assert rec["val/rmse"] == pytest.approx(np.sqrt(metrics.mean_squared_error(yv, z)), rel=1e-6)
    assert rec["val/mae"] == pytest.approx(metrics.mean_absolute_error(yv, z), rel=1e-6)
    assert rec["val/r2"] == pytest.approx(metrics.r2_score(yv, z), rel=1e-6, abs=1e-6)
    assert rec["val/rmse"] ** 2 == pytest.approx(rec["val/loss"], rel=1e-5)  # the loss: the MSE in units


def test_early_stopping_watches_balanced_accuracy_with_mode_max(tmp_path: Path) -> None:
    cfg = make_cfg(early_stopping__metric="val/balanced_acc", early_stopping__patience=1)
    summary = train(cfg, tmp_path / "run")
    epochs = [r for r in read_metrics(tmp_path / "run/metrics.jsonl") if r["kind"] == "epoch"]
    best = max(epochs, key=lambda r: (r["val/balanced_acc"], r["epoch"]))  # a tie: the later epoch
    assert summary["best"]["metric"] == "val/balanced_acc" and summary["best"]["mode"] == "max"
    assert summary["best"]["value"] == best["val/balanced_acc"] and summary["best"]["epoch"] == best["epoch"]


@pytest.mark.parametrize(
    ("metric", "message"),
    [
        ("val/rmse", "a classification has no RMSE"),
        ("val/roc_auc", "ROC AUC is measured for two classes; this run has 10"),
        ("val/f1", "must be auto or one of .*val/f1_macro"),
        ("test/balanced_acc", "the test split never selects a model"),
    ],
)
def test_early_stopping_refuses_a_score_the_run_does_not_measure(tmp_path: Path, metric: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        train(make_cfg(early_stopping__metric=metric), tmp_path / "run")


def test_early_stopping_on_a_regressions_r2_and_rmse_picks_the_mode(tmp_path: Path) -> None:
    from mlptrain.run.resume import selection

    cfg = make_cfg(early_stopping__metric="val/r2")
    assert selection(cfg, False, True).mode == "max"
    cfg.early_stopping.metric = "val/rmse"
    assert selection(cfg, False, True).mode == "min"
    cfg.early_stopping.metric = "val/balanced_acc"
    with pytest.raises(ConfigError, match="a regression has no accuracy"):
        selection(cfg, False, True)


def _evaluated(run: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    """``python -m mlptrain.evaluate``'s report on best.npz's own test split, and the outputs and truth it scored."""
    from mlptrain.cli.evaluate import EvaluateArgs, _own_split, evaluate
    from mlptrain.inference.predictor import Predictor

    p = Predictor(run / "checkpoints/best.npz", device="cpu")
    x, y, _ = _own_split(p, "test")
    report, _ = evaluate(EvaluateArgs(ckpt=str(run), device="cpu"), p)
    return report, p.logits(x, normalised=True), np.asarray(y)


def test_evaluation_json_holds_scikit_learns_classification_scores(tmp_path: Path) -> None:
    x, y = datasets.load_breast_cancer(return_X_y=True)
    names = np.array(["malignant", "benign"])
    write_csv(tmp_path / "bc.csv", x, names[y], [f"f{i}" for i in range(x.shape[1])], target="label")
    cfg = make_cfg(data__name=DatasetName.file, data__path=str(tmp_path / "bc.csv"), data__cache=False)
    summary = train(cfg, tmp_path / "run")
    report, z, yt = _evaluated(tmp_path / "run")
    want = _sklearn_classification(yt, z)
    for k in ("balanced_acc", "log_loss", "roc_auc"):
        assert report[k] == pytest.approx(want[k], rel=1e-6, abs=1e-6), k
        assert report[k] == pytest.approx(summary[f"best/test/{k}"], rel=1e-5), k  # the run's own, on the GPU too
    for k in ("precision", "recall", "f1"):
        assert report["macro"][k] == pytest.approx(want[f"{k}_macro"], rel=1e-6, abs=1e-6), k
    classes = p_names = [str(n) for n in report["class_names"]]
    p, r, f, s = metrics.precision_recall_fscore_support(yt, z.argmax(axis=1), labels=[0, 1], zero_division=0)
    for i, name in enumerate(p_names):
        got = report["per_class"][name]
        assert [got["precision"], got["recall"], got["f1"], got["support"]] == pytest.approx([p[i], r[i], f[i], s[i]])
    assert sorted(classes) == ["benign", "malignant"]


def test_evaluation_json_holds_scikit_learns_regression_scores(tmp_path: Path) -> None:
    x, y = datasets.load_diabetes(return_X_y=True)
    t = np.column_stack([y + 0.5, 1000.0 + y / 100.0])  # two targets, one far from 0 with a small spread
    write_csv(tmp_path / "d.csv", np.column_stack([x, t[:, 0]]), t[:, 1], [*(f"f{i}" for i in range(10)), "a"], "b")
    cfg = make_cfg(data__name=DatasetName.file, data__path=str(tmp_path / "d.csv"), data__cache=False)
    cfg.data.target = ["a", "b"]
    cfg.model.loss = "mse"
    summary = train(cfg, tmp_path / "run")
    report, z, yt = _evaluated(tmp_path / "run")
    assert report["rmse"] == pytest.approx(np.sqrt(metrics.mean_squared_error(yt, z)), rel=1e-6)
    assert report["mae"] == pytest.approx(metrics.mean_absolute_error(yt, z), rel=1e-6)
    assert report["r2"] == pytest.approx(metrics.r2_score(yt, z), rel=1e-6)
    for j, name in enumerate("ab"):
        got = report["per_target"][name]
        assert got["r2"] == pytest.approx(metrics.r2_score(yt[:, j], z[:, j]), rel=1e-6)
        assert got["mae"] == pytest.approx(metrics.mean_absolute_error(yt[:, j], z[:, j]), rel=1e-6)
    for k in ("rmse", "mae", "r2"):  # the command's outputs are float32 in units (an ulp of 1000 is 6e-5)
        assert report[k] == pytest.approx(summary[f"best/test/{k}"], rel=1e-4), k


def test_two_ranks_score_a_binary_split_as_one_process(tmp_path: Path) -> None:
    """Data parallel: the confusion matrices are all-reduced and each rank's margins gathered for ROC AUC."""
    from test_distributed_run import _ranks

    def cfg():  # type: ignore[no-untyped-def]
        return make_cfg(
            data__name=DatasetName.synthetic, data__classes=2, data__batch_size=63, precision__name="fp64", epochs=1
        )

    one = train(cfg(), tmp_path / "one")
    two = _ranks(2, cfg(), tmp_path / "two")
    assert all(isinstance(r, dict) for r in two), two
    for k in ("val/roc_auc", "val/balanced_acc", "val/f1_macro", "val/log_loss", "test/roc_auc"):
        assert two[0][k] == two[1][k] == pytest.approx(one[k], rel=1e-12), k
