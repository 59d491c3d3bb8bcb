"""mlptrain.sklearn: the CLI's numbers from Python, scikit-learn's tools around it, and its errors (issue #32).

The equality tests build the same file the CLI reads and compare every step's loss and the final
parameters exactly: the estimator's split, normalisation, data order and steps are the CLI's.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")

from sklearn.datasets import load_breast_cancer, load_digits, make_regression  # noqa: E402
from sklearn.exceptions import ConvergenceWarning, NotFittedError  # noqa: E402
from sklearn.model_selection import GridSearchCV, cross_val_score  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

import mlptrain  # noqa: E402
from mlptrain.base.errors import ConfigError, MlptrainError  # noqa: E402
from mlptrain.data.files.readers import write_csv  # noqa: E402
from mlptrain.data.prepare import normalization  # noqa: E402
from mlptrain.run import checkpoint  # noqa: E402
from mlptrain.sklearn import MLPClassifier, MLPRegressor  # noqa: E402
from tests.helpers import make_cfg  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NO_STOP = {"n_iter_no_change": 1000}  # scikit-learn's convergence rule never ends these fits early


def _blobs(n: int = 150, features: int = 5, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Three classes named a, b, c, features on different scales (normalisation matters)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.normal(size=(n, features)) + y[:, None] * 3.0
    return x * np.array([1.0, 10.0, 100.0, 0.1, 3.0])[:features] + 7.0, np.array(["a", "b", "c"])[y]


def _params(run: Path, name: str) -> dict[str, np.ndarray]:
    arrays = checkpoint.load(run / "checkpoints" / name).arrays
    return {k: v for k, v in arrays.items() if k.startswith("param/")}


def _step_losses(run: Path) -> list[float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in lines if r["kind"] == "step"]


def test_the_classifier_takes_the_clis_steps_on_the_same_file(tmp_path: Path) -> None:
    """``python -m mlptrain data=file`` and ``MLPClassifier.fit`` on the same rows: every step's loss, every
    epoch's validation accuracy and the best epoch's parameters are equal (early stopping holds out 20%)."""
    x, y = _blobs()
    names = [f"f{i}" for i in range(x.shape[1])]
    write_csv(tmp_path / "train.csv", x, y, names)
    write_csv(tmp_path / "test.csv", x[:20], y[:20], names)  # a test file of its own: no test split is drawn
    run = tmp_path / "run"
    args = [
        "device=cpu",
        "progress=false",
        "data=file",
        f"data.path={tmp_path / 'train.csv'}",
        f"data.test_path={tmp_path / 'test.csv'}",
        "data.batch_size=32",
        "data.val_fraction=0.2",
        "seed=3",
        "data.split_seed=3",
        "model.hidden=[16,8]",
        "optimizer=adam",
        "optimizer.lr=0.01",
        "optimizer.schedule=constant",
        "optimizer.weight_decay=0.015625",
        *("model.init=he", "early_stopping.metric=val/acc"),  # the estimator's, not data=file's (torch, val/loss)
        "epochs=6",
        f"hydra.run.dir={run}",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "mlptrain", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    clf = MLPClassifier(
        hidden_layer_sizes=(16, 8),
        learning_rate_init=0.01,
        alpha=0.5,
        batch_size=32,
        max_iter=6,
        random_state=3,
        early_stopping=True,
        validation_fraction=0.2,
        device="cpu",
        **NO_STOP,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(x, y)
    cli = _step_losses(run)
    assert len(cli) == 6 * 4 and clf.step_losses_ == cli  # 120 training rows: 4 batches of <= 32 an epoch
    epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert clf.validation_scores_ == [r["val/acc"] for r in epochs if r["kind"] == "epoch"]
    best = _params(run, "best.npz")  # the same strict improvement picks the same epoch
    for k, v in best.items():
        np.testing.assert_array_equal(clf.state_.arrays[k], v, err_msg=k)
    assert list(clf.classes_) == ["a", "b", "c"] and clf.best_validation_score_ == max(clf.validation_scores_)
    loaded = MLPClassifier.load(run / "checkpoints" / "best.npz")  # a CLI run's checkpoint, as an estimator
    names_x = pytest.importorskip("pyarrow").table({n: x[:, i] for i, n in enumerate(names)})
    np.testing.assert_array_equal(loaded.predict_proba(names_x), clf.predict_proba(x))
    assert loaded.get_params()["hidden_layer_sizes"] == (16, 8) and list(loaded.classes_) == ["a", "b", "c"]


def test_the_regressor_takes_train_s_steps_with_two_targets_and_nesterov(tmp_path: Path) -> None:
    """``mlptrain.train`` on a two-target file (SGD, Nesterov, a short last batch) and ``MLPRegressor``."""
    from mlptrain.config.schema import DatasetName, Schedule, Task

    x, y = make_regression(n_samples=90, n_features=4, n_targets=2, noise=0.1, random_state=1)
    y = y / 100.0
    header = ["a", "b", "c", "d", "t0", "t1"]
    rows = "\n".join(",".join(map(repr, r)) for r in np.hstack([x, y]).tolist())
    (tmp_path / "train.csv").write_text(",".join(header) + "\n" + rows + "\n")
    (tmp_path / "test.csv").write_text(",".join(header) + "\n" + rows + "\n")
    cfg = make_cfg(model__hidden=[12], model__loss=type(make_cfg().model.loss)("mse"), seed=5, epochs=4)
    d, o = cfg.data, cfg.optimizer
    d.name, d.path, d.test_path, d.target, d.task = (
        DatasetName.file,
        str(tmp_path / "train.csv"),
        str(tmp_path / "test.csv"),
        ["t0", "t1"],
        Task.regression,
    )
    d.batch_size, d.val_fraction, d.split_seed, d.cache = 16, 0.0, 5, False
    o.name, o.lr, o.momentum, o.nesterov, o.schedule, o.weight_decay = (
        "sgd",
        0.01,
        0.8,
        True,
        Schedule.constant,
        0.0,
    )
    mlptrain.train(cfg, tmp_path / "run")
    reg = MLPRegressor(
        hidden_layer_sizes=12,
        solver="sgd",
        learning_rate_init=0.01,
        momentum=0.8,
        alpha=0.0,
        batch_size=16,
        max_iter=4,
        random_state=5,
        device="cpu",
        **NO_STOP,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        reg.fit(x, y)
    assert reg.step_losses_ == _step_losses(tmp_path / "run") and len(reg.step_losses_) == 4 * 6
    for k, v in _params(tmp_path / "run", "last.npz").items():
        np.testing.assert_array_equal(reg.state_.arrays[k], v, err_msg=k)
    assert reg.predict(x).shape == (90, 2) and reg.n_outputs_ == 2 and reg.n_layers_ == 3
    assert reg.out_activation_ == "identity" and [c.shape for c in reg.coefs_] == [(4, 12), (12, 2)]
    assert [b.shape for b in reg.intercepts_] == [(12,), (2,)]


def test_partial_fit_and_warm_start_continue_a_fit_step_for_step() -> None:
    """Three partial_fit epochs equal fit(max_iter=3); fit(2) then a warm fit(3) equals fit(5)."""
    x, y = _blobs(60)
    kw = {"hidden_layer_sizes": (8,), "batch_size": 16, "random_state": 0, "device": "cpu", **NO_STOP}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        whole = MLPClassifier(max_iter=3, **kw).fit(x, y)
        parts = MLPClassifier(**kw)
        for _ in range(3):
            parts.partial_fit(x, y, classes=["a", "b", "c"])
        assert parts.step_losses_ == whole.step_losses_ and parts.n_iter_ == 3
        np.testing.assert_array_equal(parts.coefs_[0], whole.coefs_[0])
        five = MLPClassifier(max_iter=5, **kw).fit(x, y)
        warm = MLPClassifier(max_iter=2, warm_start=True, **kw).fit(x, y)
        warm.set_params(max_iter=3).fit(x, y)
    assert warm.step_losses_ == five.step_losses_ and warm.n_iter_ == 5 and len(warm.loss_curve_) == 5
    np.testing.assert_array_equal(warm.predict_proba(x), five.predict_proba(x))


def test_in_a_pipeline_a_grid_search_and_cross_validation() -> None:
    """Breast cancer (569 rows, 30 features): the usual scikit-learn tools drive the estimator."""
    x, y = load_breast_cancer(return_X_y=True)
    kw = {"hidden_layer_sizes": (16,), "max_iter": 30, "random_state": 0, "device": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        pipe = make_pipeline(StandardScaler(), MLPClassifier(**{**kw, "max_iter": 100})).fit(x[:400], y[:400])
        assert pipe.score(x[400:], y[400:]) > 0.95  # scikit-learn's own MLP in its place: 0.964
        scores = cross_val_score(MLPClassifier(**kw), x, y, cv=3)
        assert scores.shape == (3,) and scores.min() > 0.85  # unnormalised rows: about 0.63, the majority class
        np.testing.assert_array_equal(scores, cross_val_score(MLPClassifier(**kw), x, y, cv=3))  # seeded
        grid = GridSearchCV(MLPClassifier(**kw), {"hidden_layer_sizes": [(4,), (16,)], "alpha": [1e-4, 1.0]}, cv=3)
        grid.fit(x, y)
    assert len(grid.cv_results_["params"]) == 4 and grid.best_score_ > 0.9
    assert grid.best_params_["hidden_layer_sizes"] in [(4,), (16,)]
    assert grid.best_estimator_.coefs_[0].shape == (30, grid.best_params_["hidden_layer_sizes"][0])


def test_raw_rows_in_raw_rows_scored_normalised_by_the_train_split() -> None:
    """Features on scales of 0.1 to 100 and shifted by 7: the model keeps the train split's standardisation."""
    x, y = _blobs(300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        kw = {"hidden_layer_sizes": (32,), "max_iter": 40, "learning_rate_init": 0.01, "random_state": 0}
        clf = MLPClassifier(**kw, device="cpu").fit(x, y)
        raw = MLPClassifier(**kw, device="cpu", normalize="none").fit(x, y)
    norm, cli = clf.state_.arrays, normalization("standard", x)  # every row is in the train split here
    np.testing.assert_allclose(norm["data/shift"], cli.shift, rtol=1e-12)  # (summed in another row order)
    np.testing.assert_allclose(norm["data/scale"], cli.scale, rtol=1e-12)
    np.testing.assert_allclose(norm["data/shift"], x.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(norm["data/scale"], x.std(axis=0), rtol=1e-12)  # every feature scaled (#47)
    assert clf.score(x, y) > 0.98 and raw.score(x, y) < 0.95 and set(clf.predict(x)) == {"a", "b", "c"}


def test_save_load_and_the_cli_tools_read_the_estimators_checkpoint(tmp_path: Path) -> None:
    """``save`` writes a checkpoint that ``load``, ``mlptrain.predict``, ``.evaluate`` and ``.export`` read."""
    pa = pytest.importorskip("pyarrow")
    from mlptrain.cli import evaluate, export

    x, y = _blobs(120)
    names = ["f0", "f1", "f2", "f3", "f4"]
    table = pa.table({n: x[:, i] for i, n in enumerate(names)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf = MLPClassifier(hidden_layer_sizes=(8,), max_iter=20, random_state=0, device="cpu").fit(table, y)
    assert list(clf.feature_names_in_) == names
    path = clf.save(tmp_path / "model.npz")
    back = MLPClassifier.load(path)
    np.testing.assert_array_equal(back.predict_proba(table), clf.predict_proba(table))
    assert back.get_params() == clf.get_params() and back.loss_curve_ == clf.loss_curve_
    # a CSV with its columns in another order: the CLI matches them by name, and prints the class names
    order = [3, 0, 4, 1, 2]
    write_csv(tmp_path / "rows.csv", x[:, order], y, [names[i] for i in order])
    assert (
        mlptrain.cli.predict.main([f"ckpt={path}", f"input={tmp_path / 'rows.csv'}", f"output={tmp_path / 'p.csv'}"])
        == 0
    )
    predicted = [line.split(",")[-1] for line in (tmp_path / "p.csv").read_text().splitlines()[1:]]
    assert predicted == clf.predict(table).tolist()
    report, _ = evaluate.evaluate(evaluate.EvaluateArgs(ckpt=str(path), data=str(tmp_path / "rows.csv")))
    assert report["acc"] == clf.score(table, y)
    ort = pytest.importorskip("onnxruntime")
    onnx_file = export.export(export.ExportArgs(ckpt=str(path), format="onnx"))
    (probs,) = ort.InferenceSession(str(onnx_file)).run(["probabilities"], {"x": x.astype(np.float32)})
    np.testing.assert_allclose(probs, clf.predict_proba(table), rtol=1e-5, atol=1e-6)
    unpickled = pickle.loads(pickle.dumps(clf))
    np.testing.assert_array_equal(unpickled.predict(table), clf.predict(table))


def test_load_refuses_a_checkpoint_of_the_other_task(tmp_path: Path) -> None:
    x, y = make_regression(n_samples=40, n_features=3, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        path = MLPRegressor(max_iter=2, device="cpu").fit(x, y).save(tmp_path / "r.npz")
    with pytest.raises(MlptrainError, match="holds a regression model; MLPClassifier needs a classification"):
        MLPClassifier.load(path)


@pytest.mark.parametrize(
    ("param", "value", "message"),
    [
        ("activation", "tanh", "activation='tanh' .mlptrain's cuBLASLt epilogs have relu and gelu"),
        ("solver", "lbfgs", "solver='lbfgs' .L-BFGS is a full-batch solver"),
        ("learning_rate", "adaptive", "learning_rate='adaptive' .scikit-learn's schedule of that name has no exact"),
        ("hidden_layer_sizes", (8, 0), r"hidden_layer_sizes=\(8, 0\); expected a positive integer"),
        ("validation_fraction", 1.0, r"validation_fraction=1.0; expected a number in \(0.0, 1.0\)"),
        ("batch_size", 0, "batch_size=0; expected 'auto' or a positive integer"),
    ],
)
def test_parameters_without_an_exact_meaning_are_refused_in_fit(param: str, value: object, message: str) -> None:
    x, y = _blobs(30)
    clf = MLPClassifier(**{param: value})  # __init__ stores anything, as scikit-learn's estimators do
    with pytest.raises(ConfigError, match="MLPClassifier " + message) as err:
        clf.fit(x, y)
    assert isinstance(err.value, ValueError) and not hasattr(clf, "state_")


def test_bad_input_gets_scikit_learns_errors() -> None:
    x, y = _blobs(40)
    clf = MLPClassifier(max_iter=2, device="cpu")
    with pytest.raises(NotFittedError):
        clf.predict(x)
    bad = x.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="Input X contains NaN"):
        clf.fit(bad, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(x, y)
    with pytest.raises(ValueError, match="X has 4 features, but MLPClassifier is expecting 5 features as input"):
        clf.predict(x[:, :4])
    scipy_sparse = pytest.importorskip("scipy.sparse")
    with pytest.raises(TypeError, match="dense data is required"):
        MLPClassifier().fit(scipy_sparse.csr_matrix(x), y)
    with pytest.raises(ValueError, match="needs at least 2 classes in y; got 1 class"):
        MLPClassifier().fit(x, np.zeros(40))
    with pytest.raises(ValueError, match="Unknown label type"):
        MLPClassifier().fit(x, np.linspace(0, 1, 40))
    with pytest.raises(ValueError, match=r"partial_fit needs classes=<every class> on its first call"):
        MLPClassifier().partial_fit(x, y)
    with pytest.raises(ValueError, match=r"y contains classes not in classes_: \['d'\]"):
        clf.partial_fit(x, np.where(y == "a", "d", y))


def test_a_dataframe_names_the_features_and_other_names_are_scikit_learns_error(tmp_path: Path) -> None:
    """#32: ``feature_names_in_`` from a pandas DataFrame's columns, kept in the checkpoint (so ``predict``
    matches a file's columns by name); a frame with other names is scikit-learn's ValueError."""
    pd = pytest.importorskip("pandas")
    x, y = _blobs(60)
    columns = ["area", "rooms", "age", "floor", "rent"]
    frame = pd.DataFrame(x, columns=columns)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf = MLPClassifier(hidden_layer_sizes=(8,), max_iter=3, random_state=0, device="cpu").fit(frame, y)
    assert list(clf.feature_names_in_) == columns and clf.feature_names_in_.dtype == object
    assert clf.state_.meta["data"]["feature_names"] == columns
    np.testing.assert_array_equal(clf.predict(frame), clf.predict(x))  # a frame and its values score alike
    assert MLPClassifier.load(clf.save(tmp_path / "m.npz")).feature_names_in_.tolist() == columns
    renamed = frame.rename(columns={"age": "years"})
    with pytest.raises(ValueError, match="The feature names should match those that were passed during fit"):
        clf.predict(renamed)
    with pytest.raises(ValueError, match="Feature names unseen at fit time:\n- years"):
        clf.predict_proba(renamed)


def test_fit_writes_no_run_directory_and_nothing_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#32: "writes no run directory unless asked": fit, partial_fit, predict and score leave the working
    folder empty and write nothing into mlptrain's cache (``$MLPTRAIN_DATA``, ``$HOME``); only ``save``
    writes, and only the file it is given."""
    work, cache, home = tmp_path / "work", tmp_path / "cache", tmp_path / "home"
    for folder in (work, cache, home):
        folder.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("MLPTRAIN_DATA", str(cache))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    x, y = _blobs(60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf = MLPClassifier(hidden_layer_sizes=(8,), max_iter=3, early_stopping=True, random_state=0).fit(x, y)
        clf.partial_fit(x, y)
        reg = MLPRegressor(hidden_layer_sizes=(8,), max_iter=3, random_state=0).fit(x, x[:, :2])
    clf.predict(x), clf.predict_proba(x), clf.score(x, y), reg.predict(x), reg.score(x, x[:, :2])
    written = {d.name: sorted(str(p.relative_to(d)) for p in d.rglob("*")) for d in (work, cache, home)}
    assert written == {"work": [], "cache": [], "home": []}
    clf.save("model.npz")
    assert sorted(p.name for p in work.rglob("*")) == ["model.npz"]


def test_the_regressor_standardises_its_targets_from_the_train_split_as_the_cli_does() -> None:
    """#32, docs/sklearn.md: targets in the hundreds are standardised (train split), kept, and undone."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    y = 300.0 + 100.0 * x[:, 0] + rng.normal(0.0, 5.0, 200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        reg = MLPRegressor(max_iter=50, random_state=0, device="cpu").fit(x, y)
    a = reg.state_.arrays
    assert reg.state_.meta["data"]["target_scaling"] == "standard"
    np.testing.assert_allclose(a["data/target_shift"], [y.mean()], rtol=1e-6)  # no held-out split here
    np.testing.assert_allclose(a["data/target_scale"], [y.std()], rtol=1e-6)
    assert reg.score(x, y) > 0.8 and abs(reg.predict(x).mean() - y.mean()) < 10.0  # in the targets' units


def test_verbose_prints_scikit_learns_lines(capsys: pytest.CaptureFixture[str]) -> None:
    x, y = _blobs(60)
    clf = MLPClassifier(max_iter=50, early_stopping=True, n_iter_no_change=2, tol=0.5, verbose=True, random_state=0)
    clf.fit(x, y)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"Iteration 1, loss = {clf.loss_curve_[0]:.8f}"
    assert lines[1] == f"Validation score: {clf.validation_scores_[0]:f}"
    assert lines[-1] == "Validation score did not improve more than tol=0.5 for 2 consecutive epochs. Stopping."
    assert clf.n_iter_ == 4 and len(lines) == 2 * 4 + 1  # more than 2 epochs without a gain of 0.5: the 4th ends it


@pytest.mark.gpu
def test_on_the_gpu_the_estimator_trains_in_graphs_and_scores_as_on_the_cpu() -> None:
    """device=gpu (CUDA graphs, fused epilogs): fp32 steps close to the CPU's, the same predictions almost
    everywhere; bf16 trains too. The lead runs it on the H200."""
    x, y = load_digits(return_X_y=True)
    kw = {"hidden_layer_sizes": (128, 128), "max_iter": 10, "random_state": 0, **NO_STOP}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        cpu = MLPClassifier(device="cpu", **kw).fit(x, y)
        gpu = MLPClassifier(device="gpu", **kw).fit(x, y)
        bf16 = MLPClassifier(device="gpu", precision="bf16", **kw).fit(x, y)
    np.testing.assert_allclose(gpu.step_losses_, cpu.step_losses_, rtol=1e-3, atol=1e-4)
    assert np.mean(gpu.predict(x) == cpu.predict(x)) > 0.99 and bf16.score(x, y) > 0.95
    assert pickle.loads(pickle.dumps(gpu)).score(x, y) == gpu.score(x, y)
