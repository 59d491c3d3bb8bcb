"""mlptrain.sklearn.cross_val_predict and cross_validate: scikit-learn's calls, the folds trained as one batched run.

The reference is scikit-learn's own ``cross_val_predict`` / ``cross_validate`` on the same estimator and folds:
it fits one clone per fold, one after another. Where the folds' training sets have one size, each member of the
batched run is its fold's fit bit for bit on the CPU (the same data, seed, batch order and stopping rule; the
CPU engine computes member k as the single model, docs/ensembles.md), so the predictions are compared exactly.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

pytest.importorskip("sklearn")
from sklearn import model_selection as ms  # noqa: E402
from sklearn.base import clone  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402

from mlptrain.base.errors import ConfigError  # noqa: E402
from mlptrain.sklearn import MLPClassifier, MLPRegressor, cross_val_predict, cross_validate  # noqa: E402
from mlptrain.sklearn.crossval import fit_folds, folds  # noqa: E402

# (scikit-learn's reference fits warn as the folds do where max_iter ends a fold: asserted once, below)
pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")


def data(n: int = 200) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 6))
    y = (X[:, 0] + X[:, 1] * X[:, 2] > 0).astype(int) + (X[:, 3] > 1)  # 3 classes, imbalanced (102, 85, 13)
    return X, y, X[:, 0] * 3 + X[:, 1] ** 2 + 10


def classifier(**kw) -> MLPClassifier:
    # tol/n_iter_no_change: the folds converge at different epochs (asserted), so each stops by its own rule
    base = {"hidden_layer_sizes": (16,), "random_state": 3, "max_iter": 60, "batch_size": 32, "device": "cpu"}
    return MLPClassifier(**{**base, "tol": 1e-2, "n_iter_no_change": 2, **kw})


def regressor(**kw) -> MLPRegressor:
    base = {"hidden_layer_sizes": (16,), "random_state": 1, "max_iter": 60, "batch_size": 32, "device": "cpu"}
    return MLPRegressor(**{**base, "tol": 1e-2, "n_iter_no_change": 2, **kw})


def assert_folds_are_their_fits(est, X, y, splits) -> list[int]:
    """Each fold's fitted estimator equals ``clone(est).fit`` on its training rows: weights, curve, epochs."""
    fitted = fit_folds(est, X, y, splits)
    for k, (mine, (train, _)) in enumerate(zip(fitted, splits, strict=True)):
        alone = clone(est).fit(X.iloc[train] if hasattr(X, "iloc") else X[train], y[train])
        assert mine.n_iter_ == alone.n_iter_ and mine.loss_curve_ == alone.loss_curve_, k
        for a, b in zip(mine.coefs_ + mine.intercepts_, alone.coefs_ + alone.intercepts_, strict=True):
            np.testing.assert_array_equal(a, b)
    return [e.n_iter_ for e in fitted]


@pytest.mark.parametrize("early_stopping", [False, True])
@pytest.mark.parametrize("method", ["predict", "predict_proba"])
def test_a_classifier_cross_val_predict_equals_scikit_learns_bit_for_bit(method: str, early_stopping: bool) -> None:
    X, y, _ = data()
    est, cv = classifier(early_stopping=early_stopping), ms.StratifiedKFold(5, shuffle=True, random_state=0)
    mine = cross_val_predict(est, X, y, cv=cv, method=method)
    reference = ms.cross_val_predict(est, X, y, cv=cv, method=method)
    np.testing.assert_array_equal(mine, reference)
    assert mine.shape == ((200,) if method == "predict" else (200, 3))
    iters = assert_folds_are_their_fits(est, X, y, list(cv.split(X, y)))
    assert len(set(iters)) > 1 and max(iters) < 60  # every fold stopped, not all at one epoch


@pytest.mark.parametrize("early_stopping", [False, True])
def test_a_regressor_cross_val_predict_equals_scikit_learns_bit_for_bit(early_stopping: bool) -> None:
    X, _, y = data()
    Y = np.stack([y, X[:, 2] * 100], axis=1)  # two targets of other scales: each fold scales them on its own rows
    est, cv = regressor(early_stopping=early_stopping), ms.KFold(4, shuffle=True, random_state=0)
    for target in (y, Y):
        np.testing.assert_array_equal(
            cross_val_predict(est, X, target, cv=cv), ms.cross_val_predict(est, X, target, cv=cv)
        )
    iters = assert_folds_are_their_fits(est, X, y, list(cv.split(X)))
    if early_stopping:
        assert len(set(iters)) > 1 and max(iters) < 60


def test_a_dataframe_with_text_and_empty_cells_equals_scikit_learns() -> None:
    pd = pytest.importorskip("pandas")
    X, y, _ = data()
    frame = pd.DataFrame(X, columns=list("abcdef"))
    frame["city"] = np.random.default_rng(1).choice(["Oslo", "Lima", "Pune"], len(frame))  # one-hot, fitted per fold
    frame.loc[::17, "a"] = np.nan  # median-filled with a_missing: the medians are each fold's own
    est, cv = classifier(), ms.StratifiedKFold(5, shuffle=True, random_state=0)
    mine = cross_val_predict(est, frame, y, cv=cv, method="predict_proba")
    np.testing.assert_array_equal(mine, ms.cross_val_predict(est, frame, y, cv=cv, method="predict_proba"))
    fitted = fit_folds(est, frame, y, list(cv.split(frame, y)))
    assert fitted[0].column_plan_ is not None and fitted[0].n_features_in_ == 7


def test_an_int_cv_is_stratified_for_a_classifier_and_kfold_for_a_regressor() -> None:
    X, y, yr = data()
    splits = folds(classifier(), X, y, None, 5)
    for (train, test), (a, b) in zip(splits, ms.StratifiedKFold(5).split(X, y), strict=True):
        np.testing.assert_array_equal(test, b)
        np.testing.assert_array_equal(train, a)
        counts = np.bincount(y[test], minlength=3)
        assert np.all(np.abs(counts - np.bincount(y) / 5) <= 1)  # each class dealt evenly into each test fold
    for (_, test), (_, b) in zip(folds(regressor(), X, yr, None, 5), ms.KFold(5).split(X), strict=True):
        np.testing.assert_array_equal(test, b)
    np.testing.assert_array_equal(cross_val_predict(classifier(), X, y), ms.cross_val_predict(classifier(), X, y))


def test_a_group_splitter_takes_the_groups() -> None:
    X, y, _ = data()
    groups = np.repeat(np.arange(8), 25)  # 8 groups of 25 rows: 4 folds of 50
    cv = ms.GroupKFold(4)
    mine = cross_val_predict(classifier(), X, y, cv=cv, groups=groups, method="predict_proba")
    reference = ms.cross_val_predict(classifier(), X, y, cv=cv, groups=groups, method="predict_proba")
    np.testing.assert_array_equal(mine, reference)
    for train, test in folds(classifier(), X, y, groups, cv):
        assert not set(groups[train]) & set(groups[test])  # a group's rows never on both sides
    with pytest.raises(ConfigError, match="groups"):  # GroupKFold without groups: scikit-learn's words, ours around
        cross_val_predict(classifier(), X, y, cv=cv)


def test_folds_of_two_sizes_are_topped_up_and_the_full_size_ones_stay_exact() -> None:
    X, y, _ = data(197)  # 5 folds: training sets of 157 and 158 rows
    cv = ms.KFold(5)
    splits = list(cv.split(X))
    mine = cross_val_predict(classifier(), X, y, cv=cv, method="predict_proba")
    reference = ms.cross_val_predict(classifier(), X, y, cv=cv, method="predict_proba")
    full = [k for k, (train, _) in enumerate(splits) if len(train) == 158]
    assert 0 < len(full) < 5
    for k, (_, test) in enumerate(splits):
        if k in full:  # no row drawn again: its own fit
            np.testing.assert_array_equal(mine[test], reference[test])
        else:  # a row seen twice an epoch: close, not equal
            assert not np.array_equal(mine[test], reference[test])
            np.testing.assert_allclose(mine[test], reference[test], atol=0.2)


def test_cross_validate_gives_scikit_learns_scores_and_the_fold_estimators() -> None:
    X, y, _ = data()
    scoring = ["accuracy", "neg_log_loss"]
    mine = cross_validate(classifier(), X, y, cv=4, scoring=scoring, return_train_score=True, return_estimator=True)
    reference = ms.cross_validate(classifier(), X, y, cv=4, scoring=scoring, return_train_score=True)
    for key in ("test_accuracy", "test_neg_log_loss", "train_accuracy", "train_neg_log_loss"):
        np.testing.assert_array_equal(mine[key], reference[key])
    assert len(mine["estimator"]) == 4 and mine["fit_time"].shape == (4,)
    X, _, yr = data()
    single = cross_validate(regressor(), X, yr, cv=4)  # scoring=None: the estimator's score (R^2)
    np.testing.assert_array_equal(single["test_score"], ms.cross_validate(regressor(), X, yr, cv=4)["test_score"])


def test_cross_validate_takes_scikit_learns_scorings_a_callable_returning_a_dict_among_them() -> None:
    from sklearn.metrics import accuracy_score, log_loss, make_scorer

    X, y, _ = data()

    def several(est, X, y):  # scikit-learn's multi-metric callable: each key a test_<key>
        return {"acc": accuracy_score(y, est.predict(X)), "loss": log_loss(y, est.predict_proba(X))}

    scorings = [several, make_scorer(accuracy_score), {"a": "accuracy", "b": make_scorer(accuracy_score)}, "f1_macro"]
    for scoring in scorings:
        mine = cross_validate(classifier(), X, y, cv=4, scoring=scoring, return_train_score=True)
        reference = ms.cross_validate(classifier(), X, y, cv=4, scoring=scoring, return_train_score=True)
        assert sorted(mine) == sorted(reference), scoring
        for key in reference:
            if key not in ("fit_time", "score_time"):
                np.testing.assert_array_equal(mine[key], reference[key])


@pytest.mark.parametrize(
    ("cv", "words"),
    [
        (ms.ShuffleSplit(3, random_state=0), r"cv=ShuffleSplit\(.*test sets partition the rows.*accepted: cv=None or"),
        (ms.TimeSeriesSplit(3), r"cv=TimeSeriesSplit\(.*holding 150 of the 200 rows"),
        ([(np.arange(100, 200), np.arange(100))], r"at least 2 folds"),
        ("five", r"cv='five'.*Expected `cv` as an integer"),
    ],
)
def test_folds_that_do_not_partition_the_rows_are_refused_naming_what_was_given(cv, words: str) -> None:
    X, y, _ = data()
    with pytest.raises(ConfigError, match=words):
        cross_val_predict(classifier(), X, y, cv=cv)


def test_what_cannot_be_one_batched_run_is_refused() -> None:
    X, y, yr = data()
    with pytest.raises(TypeError, match="got LogisticRegression: use sklearn.model_selection.cross_val_predict"):
        cross_val_predict(LogisticRegression(), X, y)
    with pytest.raises(ConfigError, match="MLPRegressor predicts with predict"):
        cross_val_predict(regressor(), X, yr, method="predict_proba")
    with pytest.raises(ConfigError, match="ensemble_size=2.*set ensemble_size=1"):
        cross_val_predict(classifier(ensemble_size=2), X, y)
    with pytest.raises(
        ConfigError, match=r"fit parameters \['sample_weight'\] \(params=\).*takes no sample_weight yet"
    ):
        cross_val_predict(classifier(), X, y, params={"sample_weight": np.ones(200)})


def test_folds_still_running_at_max_iter_warn_as_their_fits_would_naming_them() -> None:
    from sklearn.exceptions import ConvergenceWarning

    X, y, _ = data()
    est = classifier(max_iter=28)  # with max_iter=60 the folds stop after 26 to 31 epochs
    with pytest.warns(ConvergenceWarning, match=r"Maximum iterations \(28\) reached.*fold\(s\) (\d, )*\d\)"):
        fitted = fit_folds(est, X, y, folds(est, X, y, None, 5))
    iters = [e.n_iter_ for e in fitted]
    assert min(iters) < 28 and max(iters) == 28  # one fold converged, the others ran out of epochs


def test_folds_that_cannot_fit_in_memory_are_refused_before_they_are_prepared(monkeypatch) -> None:
    """LeaveOneOut on N rows is N folds of N - 1 rows, each fold's copy held at once: counted first (here against
    1 MiB said available) and refused with one error that points to scikit-learn's one-fit-at-a-time function."""
    from mlptrain.base.errors import ResourceError
    from mlptrain.step import memory

    monkeypatch.setattr(memory, "host_memory_available", lambda: 2**20)
    X, y, _ = data()
    with pytest.raises(
        ResourceError,
        match=r"cross-validation of MLPClassifier in 200 folds: 200 members .*use fewer "
        r"folds, or sklearn.model_selection's own function",
    ):
        cross_val_predict(classifier(max_iter=1), X, y, cv=ms.LeaveOneOut())
    assert cross_val_predict(classifier(max_iter=1), X, y, cv=5).shape == (200,)  # 5 folds fit


def test_a_fold_whose_frame_encodes_to_fewer_columns_trains_padded_with_zero_columns() -> None:
    """A level (or an empty cell) that one fold's training rows lack gives that fold's plan fewer columns: the fold
    trains with zero columns appended up to the widest (their weights drawn, never used, then dropped), so it is the
    single run of its own rows so padded, bit for bit, and its estimator takes its own plan's columns."""
    import dataclasses

    pd = pytest.importorskip("pandas")
    from mlptrain.data.prepare import preprocess
    from mlptrain.run.interval import Interval
    from mlptrain.sklearn.fitting import run_epoch
    from mlptrain.step.trainer import Trainer

    X, y, _ = data()
    frame = pd.DataFrame(X, columns=list("abcdef"))
    frame["city"] = np.random.default_rng(1).choice(["Oslo", "Lima", "Pune"], len(frame))
    frame.loc[10, "city"] = "Rare"  # only in fold 0's test rows: fold 0's plan has no city=Rare
    frame.loc[[20, 120], "a"] = np.nan  # fold 0 and 2 hold one each out: every fold has a_missing
    est, cv = classifier(), ms.KFold(4)
    splits = list(cv.split(frame))
    fitted = fit_folds(est, frame, y, splits)
    widths = [e.coefs_[0].shape[0] for e in fitted]
    wide = widths[1]  # 6 numbers, a_missing, 4 levels of city
    assert widths == [wide - 1, wide, wide, wide] and "city=Rare" not in fitted[0].column_plan_.feature_names
    mine = cross_val_predict(est, frame, y, cv=cv, method="predict_proba")
    reference = ms.cross_val_predict(est, frame, y, cv=cv, method="predict_proba")
    for k, (_, test) in enumerate(splits[1:], 1):  # the full-width folds: their own fits
        np.testing.assert_array_equal(mine[test], reference[test], err_msg=f"fold {k}")
    train, test = splits[0]
    setup = clone(est).fit_setup(frame.iloc[train], y[train])
    own = preprocess(setup.dataset, setup.cfg.data)

    def pad(a: np.ndarray) -> np.ndarray:
        return np.pad(a, ((0, 0), (0, wide - a.shape[1])))

    tr = Trainer(
        setup.cfg, dataclasses.replace(own, **{s: pad(getattr(own, s)) for s in ("x_train", "x_val", "x_test")})
    )
    interval = Interval(tr, setup.cfg.log_every)
    with tr.stream:
        for epoch in range(fitted[0].n_iter_):
            run_epoch(tr, interval, epoch)
    arrays = tr.state_dict()[0]
    np.testing.assert_array_equal(fitted[0].coefs_[0], arrays["param/layer0.weight"][:, : wide - 1].T)
    np.testing.assert_array_equal(fitted[0].coefs_[1], arrays["param/layer1.weight"].T)
    np.testing.assert_array_equal(mine[test], fitted[0].predict_proba(frame.iloc[test]))


def test_a_fold_without_a_class_trains_with_every_classs_output_and_predicts_as_scikit_learns() -> None:
    """A fold whose training rows lack a class (every row of class 2 in fold 0's test set) trains with an output for
    every class of y, the missing one never a target, and keeps its own classes: the single run of its rows so
    widened, bit for bit; its out-of-fold probabilities fill the missing column as scikit-learn's cross_val_predict
    does (0, or the float minimum for log probabilities), with scikit-learn's warning; the other folds are theirs."""
    import dataclasses

    from mlptrain.data.prepare import preprocess
    from mlptrain.run.interval import Interval
    from mlptrain.sklearn.fitting import run_epoch
    from mlptrain.step.trainer import Trainer

    X, y, _ = data()  # class 2: 13 rows
    rest = np.flatnonzero(y != 2)
    first = np.concatenate([np.flatnonzero(y == 2), rest[:37]])  # fold 0's test rows: 50, every row of class 2
    parts = [first, *np.split(rest[37:], 3)]  # 4 test sets of 50 rows: training sets of 150
    splits = [(np.setdiff1d(np.arange(200), part), part) for part in parts]
    est = classifier()
    words = r"Number of classes in training fold \(2\) does not match total number of classes \(3\)"
    for method in ("predict_proba", "predict_log_proba", "predict"):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", RuntimeWarning)
            mine = cross_val_predict(est, X, y, cv=splits, method=method)
            reference = ms.cross_val_predict(est, X, y, cv=splits, method=method)
        warned = [w for w in said if w.category is RuntimeWarning and re.match(words, str(w.message))]
        assert len(warned) == (0 if method == "predict" else 2)  # mine and scikit-learn's, once each
        for k, (_, test) in enumerate(splits[1:], 1):
            np.testing.assert_array_equal(mine[test], reference[test], err_msg=f"{method} fold {k}")
        if method != "predict":
            np.testing.assert_array_equal(mine[first, 2], reference[first, 2])  # 0, or float64's minimum
            assert mine.shape == (200, 3)
    fitted = fit_folds(est, X, y, splits)
    assert fitted[0].classes_.tolist() == [0, 1] and fitted[0].coefs_[-1].shape == (16, 2)
    setup = clone(est).fit_setup(X[splits[0][0]], y[splits[0][0]])
    tr = Trainer(setup.cfg, dataclasses.replace(preprocess(setup.dataset, setup.cfg.data), num_classes=3))
    interval = Interval(tr, setup.cfg.log_every)
    with tr.stream:
        for epoch in range(fitted[0].n_iter_):
            run_epoch(tr, interval, epoch)
    arrays = tr.state_dict()[0]
    np.testing.assert_array_equal(fitted[0].coefs_[0], arrays["param/layer0.weight"].T)
    np.testing.assert_array_equal(fitted[0].coefs_[1], arrays["param/layer1.weight"][:2].T)
    np.testing.assert_array_equal(fitted[0].intercepts_[1], arrays["param/layer1.bias"][:2])


def test_a_scorer_that_fails_gives_error_score_as_scikit_learns_cross_validate() -> None:
    """A scorer's failure on a fold is ``error_score`` (NaN by default) with scikit-learn's warning, per scorer, or
    raises with ``error_score="raise"``; a fit's failure still raises (one run: there is no fold to leave out)."""
    X, y, _ = data()

    def fussy(est, X, y):  # fails on the fold whose test rows start at row 0
        if len(y) and X[0, 0] == data()[0][0, 0]:
            raise ValueError("no score for this fold")
        return est.score(X, y)

    scoring = {"fussy": fussy, "accuracy": "accuracy"}
    with pytest.warns(UserWarning, match=r"Scoring failed\. The score on this train-test partition for these "):
        mine = cross_validate(classifier(), X, y, cv=4, scoring=scoring)
    with pytest.warns(UserWarning, match="Scoring failed"):
        reference = ms.cross_validate(classifier(), X, y, cv=4, scoring=scoring)
    for key in ("test_fussy", "test_accuracy"):
        np.testing.assert_array_equal(mine[key], reference[key])
    assert np.isnan(mine["test_fussy"][0]) and not np.isnan(mine["test_fussy"][1:]).any()
    with pytest.warns(UserWarning, match="will be set to -1.0"):
        assert cross_validate(classifier(), X, y, cv=4, scoring=fussy, error_score=-1.0)["test_score"][0] == -1.0
    with pytest.raises(ValueError, match="no score for this fold"):
        cross_validate(classifier(), X, y, cv=4, scoring=fussy, error_score="raise")


def test_folds_that_each_lack_another_class_train_with_every_classs_output() -> None:
    """Class c only in group c (GroupKFold): no fold's training rows hold every class; each still trains with the 3
    outputs and predicts as scikit-learn's cross_val_predict lays it out (0 in its missing class's column)."""
    X, _, _ = data(150)
    groups = np.repeat(np.arange(3), 50)
    y = groups.copy()  # fold k's training rows lack class k
    est = classifier(max_iter=3)
    with pytest.warns(RuntimeWarning, match=r"training fold \(2\) does not match total number of classes \(3\)"):
        mine = cross_val_predict(est, X, y, cv=ms.GroupKFold(3), groups=groups, method="predict_proba")
    assert mine.shape == (150, 3)
    for k in range(3):
        np.testing.assert_array_equal(mine[groups == k, k], 0.0)
        np.testing.assert_allclose(mine[groups == k].sum(axis=1), 1.0)
    with pytest.warns(RuntimeWarning):
        reference = ms.cross_val_predict(est, X, y, cv=ms.GroupKFold(3), groups=groups, method="predict_proba")
    np.testing.assert_array_equal(mine == 0, reference == 0)


def test_a_fold_lacking_a_middle_class_keeps_its_own_classes_outputs_bit_for_bit() -> None:
    """The fold whose training rows hold classes 0 and 2 only: its fitted estimator's output layer is the widened
    run's rows 0 and 2 (not its first two), bit for bit against the single run of its rows with 3 outputs."""
    import dataclasses

    from mlptrain.data.prepare import preprocess
    from mlptrain.run.interval import Interval
    from mlptrain.sklearn.fitting import run_epoch
    from mlptrain.step.trainer import Trainer

    X, _, _ = data(150)
    groups = np.repeat(np.arange(3), 50)
    y = groups.copy()
    splits = list(ms.GroupKFold(3).split(X, y, groups))
    est = classifier(max_iter=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # max_iter=3: not converged, as asked
        fitted = fit_folds(est, X, y, splits)
    k = next(i for i, (_, test) in enumerate(splits) if (y[test] == 1).all())  # its training rows: classes 0 and 2
    assert fitted[k].classes_.tolist() == [0, 2] and fitted[k].coefs_[-1].shape == (16, 2)
    setup = clone(est).fit_setup(X[splits[k][0]], y[splits[k][0]])
    own = preprocess(setup.dataset, setup.cfg.data)  # targets 0, 1 for the classes 0, 2
    wide = {s: np.array([0, 2])[getattr(own, s)] for s in ("y_train", "y_val", "y_test")}
    tr = Trainer(setup.cfg, dataclasses.replace(own, num_classes=3, **wide))
    interval = Interval(tr, setup.cfg.log_every)
    with tr.stream:
        for epoch in range(fitted[k].n_iter_):
            run_epoch(tr, interval, epoch)
    arrays = tr.state_dict()[0]
    np.testing.assert_array_equal(fitted[k].coefs_[0], arrays["param/layer0.weight"].T)
    np.testing.assert_array_equal(fitted[k].coefs_[1], arrays["param/layer1.weight"][[0, 2]].T)
    np.testing.assert_array_equal(fitted[k].intercepts_[1], arrays["param/layer1.bias"][[0, 2]])
