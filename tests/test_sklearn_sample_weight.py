"""``fit(X, y, sample_weight=)`` on the estimators (#49): scikit-learn's parameter, the CLI's row-weighted loss.

A weighted fit must equal the fit on the rows repeated ``w`` times (integer weights, one full batch, float64), to
1e-12: a loss that ignored the weights or divided by the rows instead of their weight, statistics (the inputs' or a
regressor's targets') taken without the weights, or ``alpha`` not relative to the weight of the rows, would not.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

pytest.importorskip("sklearn")

from sklearn.exceptions import ConvergenceWarning  # noqa: E402
from sklearn.metrics import accuracy_score, r2_score  # noqa: E402

from mlptrain.base.errors import ConfigError  # noqa: E402
from mlptrain.sklearn import MLPClassifier, MLPRegressor  # noqa: E402
from mlptrain.sklearn.fitting import split_rows  # noqa: E402

# one full batch in float64: the weighted mean of the rows is the repeated rows' mean, to rounding
EXACT: dict[str, Any] = {
    "batch_size": 100_000,
    "precision": "fp64",
    "hidden_layer_sizes": (8,),
    "max_iter": 6,
    "random_state": 0,
}
GPU = pytest.param("gpu", marks=pytest.mark.gpu)


def _table(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``n`` rows of 3 features on different scales, labels of 3 classes, a target, integer weights 0..3."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3)) * [1.0, 10.0, 0.1] + [0.0, 5.0, -1.0]
    labels = np.array(["a", "b", "c"])[(x[:, 0] > 0).astype(int) + (x[:, 2] > -1.0)]
    target = x @ [1.0, -0.2, 5.0] + 0.1 * rng.standard_normal(n) + 40.0
    w = rng.integers(0, 4, n)
    w[:3] = [1, 2, 3]  # some rows of every weight (and the classes keep rows)
    return x, labels, target, w


def _fit(est: Any, *args: Any, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.filterwarnings("ignore", "Got `batch_size`", UserWarning)  # EXACT's batch is clipped to the rows
        return est.fit(*args, **kw)


def _same_fit(a: Any, b: Any, x: np.ndarray, tol: float) -> None:
    """Two fitted estimators alike: their epochs' losses, parameters and predictions on ``x``."""
    assert len(a.loss_curve_) == len(b.loss_curve_) and a.loss_curve_[0] != a.loss_curve_[-1]  # the loss moves
    assert_allclose(a.loss_curve_, b.loss_curve_, rtol=tol, atol=tol)
    for p, q in zip(a.coefs_ + a.intercepts_, b.coefs_ + b.intercepts_, strict=True):
        assert_allclose(p, q, rtol=tol, atol=tol)
    for method in ("predict_proba", "predict") if hasattr(a, "classes_") else ("predict",):
        got, want = getattr(a, method)(x), getattr(b, method)(x)
        assert_allclose(got, want, rtol=tol, atol=tol) if got.dtype.kind == "f" else assert_array_equal(got, want)


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("solver", ["adam", "sgd"])
@pytest.mark.parametrize("Est", [MLPClassifier, MLPRegressor])
def test_integer_weights_fit_as_the_rows_repeated_w_times(Est: Any, solver: str, device: str) -> None:
    """``alpha`` > 0 and ``normalize='standard'`` (the default): the penalty and the statistics follow the weights."""
    x, labels, target, w = _table(60, 0)
    y = labels if Est is MLPClassifier else target
    rep = np.repeat(np.arange(len(x)), w)  # row i, w_i times (a weight of 0: left out)
    params = {**EXACT, "solver": solver, "alpha": 0.01, "momentum": 0.5, "device": device}
    weighted = _fit(Est(**params), x, y, sample_weight=w)
    repeated = _fit(Est(**params), x[rep], y[rep])
    # cuBLAS sums the 60 weighted rows and the ~90 repeated ones in other orders than NumPy does, in fp64 still:
    # the classifier's weights differed by 2.3e-11 (5e-9 relative) on an H200, a probability by 1.6e-9 on an H100
    # (2026-12-05)
    tol = 1e-12 if device == "cpu" else 1e-8
    _same_fit(weighted, repeated, x, tol)
    plain = _fit(Est(**params), x, y)  # the check can fail: the weights change the fit
    assert abs(plain.loss_curve_[-1] - repeated.loss_curve_[-1]) > 1e-3
    # partial_fit takes them too: one more epoch, weighted and repeated
    weighted.partial_fit(x, y, sample_weight=w)
    repeated.partial_fit(x[rep], y[rep])
    _same_fit(weighted, repeated, x, tol)


@pytest.mark.parametrize("normalize", ["standard", "minmax", "robust", "quantile"])
@pytest.mark.parametrize("Est", [MLPClassifier, MLPRegressor])
def test_a_weight_of_zero_is_the_row_left_out(Est: Any, normalize: str) -> None:
    """Rows weighing 0 take no part: not in the loss, not in the statistics of the inputs or the targets."""
    x, labels, target, w = _table(50, 1)
    y = labels if Est is MLPClassifier else target
    x[w == 0] *= 1000.0  # the left-out rows are far away: statistics that counted them would be far off
    keep = np.flatnonzero(w > 0)
    zero_one = (w > 0).astype(np.float64)
    params = {**EXACT, "normalize": normalize}
    weighted, kept = _fit(Est(**params), x, y, sample_weight=zero_one), _fit(Est(**params), x[keep], y[keep])
    _same_fit(weighted, kept, x[keep], 1e-12)


@pytest.mark.parametrize("Est", [MLPClassifier, MLPRegressor])
def test_weights_of_all_ones_are_no_weights_bit_for_bit(Est: Any) -> None:
    """At the defaults (fp32, minibatches of 200, shuffled): every epoch's loss and every parameter equal."""
    x, labels, target, _ = _table(450, 2)
    y = labels if Est is MLPClassifier else target
    params: dict[str, Any] = {"hidden_layer_sizes": (16,), "max_iter": 4, "random_state": 3}
    none = _fit(Est(**params), x, y)
    for ones in (np.ones(len(x)), 1, [1] * len(x)):
        got = _fit(Est(**params), x, y, sample_weight=ones)
        assert got.loss_curve_ == none.loss_curve_
        for p, q in zip(got.coefs_ + got.intercepts_, none.coefs_ + none.intercepts_, strict=True):
            assert_array_equal(p, q)
    twos = _fit(Est(**params), x, y, sample_weight=2.0)  # weighted, and alpha now counts half: another fit
    assert twos.loss_curve_ != none.loss_curve_


def test_early_stopping_scores_the_held_out_rows_by_their_weights() -> None:
    """scikit-learn's MLP scores its validation split with the rows' sample_weight; so do these."""
    x, labels, _, w = _table(200, 3)
    w = w + (labels == "a") * 5.0  # one class weighs more: the weighted and the plain accuracy differ
    clf = _fit(
        MLPClassifier(early_stopping=True, max_iter=1, random_state=4, hidden_layer_sizes=(4,)),
        x,
        labels,
        sample_weight=w,
    )
    _, val = split_rows(np.searchsorted(clf.classes_, labels), "classification", clf.validation_fraction, clf.seed_)
    pred = clf.predict(x[val])  # one epoch: the best epoch's weights are the last's
    assert clf.validation_scores_ == [accuracy_score(labels[val], pred, sample_weight=w[val])]
    assert accuracy_score(labels[val], pred) != accuracy_score(labels[val], pred, sample_weight=w[val])
    # score(X, y, sample_weight) is scikit-learn's weighted accuracy and R^2 (ClassifierMixin, RegressorMixin)
    assert clf.score(x, labels, sample_weight=w) == accuracy_score(labels, clf.predict(x), sample_weight=w)
    reg = _fit(MLPRegressor(max_iter=3, random_state=0), x, x @ [1.0, 2.0, 3.0], sample_weight=w)
    assert reg.score(x, x @ [1.0, 2.0, 3.0], sample_weight=w) == r2_score(
        x @ [1.0, 2.0, 3.0], reg.predict(x), sample_weight=w
    )


def test_a_dataframe_with_text_columns_takes_weights_as_its_rows_repeated() -> None:
    pd = pytest.importorskip("pandas")
    x, labels, _, w = _table(60, 5)
    w = np.maximum(w, 1)  # every row kept: the column plan (levels) of the repeated frame is the same
    frame = pd.DataFrame({"a": x[:, 0], "colour": np.array(["red", "green", "blue"])[np.arange(60) % 3], "b": x[:, 1]})
    rep = np.repeat(np.arange(60), w)
    weights = pd.Series(w, index=np.arange(60) + 1000)  # a Series with its own index: read by position, as scikit-learn
    weighted = _fit(MLPClassifier(**EXACT), frame, labels, sample_weight=weights)
    repeated = _fit(MLPClassifier(**EXACT), frame.iloc[rep].reset_index(drop=True), labels[rep])
    assert weighted.column_plan_ is not None and weighted.n_features_in_ == 3
    _same_fit(weighted, repeated, frame, 1e-12)
    plain = _fit(MLPClassifier(**EXACT), frame, labels)
    assert abs(plain.loss_curve_[-1] - weighted.loss_curve_[-1]) > 1e-3


@pytest.mark.parametrize(
    ("weights", "said"),
    [
        (np.ones(59), r"sample_weight has shape \(59,\); expected \(60,\), one weight per row of X"),
        (np.ones((60, 2)), r"sample_weight has shape \(60, 2\); expected \(60,\)"),
        (np.r_[np.ones(59), -1.0], r"sample_weight\[59\] = -1.0; sample weights must be finite numbers >= 0"),
        (np.r_[np.nan, np.ones(59)], r"sample_weight\[0\] = nan; sample weights must be finite"),
        (np.r_[np.ones(59), np.inf], r"sample_weight\[59\] = inf; sample weights must be finite"),
        (np.zeros(60), r"sample_weight are all zero \(<ndarray of shape \(60,\)>\); at least one row must weigh"),
        (0, r"sample_weight are all zero \(0\)"),
        (-2.0, r"sample_weight\[0\] = -2.0; sample weights must be finite numbers >= 0"),
        (["1"] * 60, r"sample_weight=<list of shape \(60,\)> holds <U1 values; expected \(60,\) real numbers >= 0"),
        (np.ones(60) * 1j, r"sample_weight=<ndarray of shape \(60,\)> holds complex128 values"),
        (2j, r"sample_weight=2j: complex weights; expected a real number >= 0"),
    ],
    ids=[
        "short",
        "2d",
        "negative",
        "nan",
        "inf",
        "zeros",
        "zero",
        "negative-number",
        "text",
        "complex",
        "complex-number",
    ],
)
def test_bad_weights_are_one_error_naming_them(weights: Any, said: str) -> None:
    x, labels, _, _ = _table(60, 6)
    with pytest.raises(ConfigError, match=r"^MLPClassifier " + said):
        MLPClassifier(max_iter=1).fit(x, labels, sample_weight=weights)
    with pytest.raises(ValueError):  # scikit-learn's type for it (ConfigError is one)
        MLPRegressor(max_iter=1).partial_fit(x, x[:, 0], sample_weight=weights)


def test_held_out_rows_that_all_weigh_zero_are_one_error() -> None:
    """early_stopping would score them by weights summing to 0: refused in scikit-learn's SGDClassifier's words."""
    x, labels, _, _ = _table(60, 10)
    clf = MLPClassifier(early_stopping=True, random_state=1)
    _, val = split_rows(np.searchsorted(["a", "b", "c"], labels), "classification", 0.1, 1)
    w = np.ones(60)
    w[val] = 0.0
    with pytest.raises(ConfigError, match=r"sample weights for validation set are all zero \(6 rows held out"):
        clf.fit(x, labels, sample_weight=w)


def test_an_ensemble_refuses_weights_as_the_cli_refuses_data_weight() -> None:
    x, labels, _, w = _table(40, 7)
    with pytest.raises(ConfigError, match=r"MLPClassifier\(ensemble_size=2\) does not take sample_weight yet"):
        MLPClassifier(ensemble_size=2, max_iter=1).fit(x, labels, sample_weight=w)
    _fit(MLPClassifier(ensemble_size=2, max_iter=1), x, labels)  # unweighted, it trains


def test_an_ensemble_checks_weights_first_and_takes_weights_of_one_as_none() -> None:
    """Weights that are all 1 are no weights (the unweighted fit): an ensemble takes them, as it takes None; weights
    that are wrong are named as for one model, before the ensemble's refusal of real weights."""
    x, labels, _, _ = _table(40, 7)
    kw = {"ensemble_size": 2, "max_iter": 2, "random_state": 0, "hidden_layer_sizes": (8,)}
    plain = _fit(MLPClassifier(**kw), x, labels)
    for ones in (np.ones(40), [1] * 40, 1.0):
        ens = _fit(MLPClassifier(**kw), x, labels, sample_weight=ones)
        assert ens.step_losses_ == plain.step_losses_
        for a, b in zip(ens.coefs_, plain.coefs_, strict=True):
            assert_array_equal(a, b)
    with pytest.raises(ConfigError, match=r"sample_weight has shape \(39,\); expected \(40,\)"):
        MLPClassifier(**kw).fit(x, labels, sample_weight=np.ones(39))
    with pytest.raises(ConfigError, match=r"sample_weight are all zero"):
        MLPClassifier(**kw).fit(x, labels, sample_weight=np.zeros(40))


def test_a_batch_of_only_zero_weight_rows_is_an_error_that_says_so() -> None:
    """Its weighted mean is 0/0 (scikit-learn's MLP raises ZeroDivisionError): the NaN error names the zero weights."""
    from mlptrain.base.errors import NonFiniteError

    x, labels, _, _ = _table(100, 8)
    w = np.zeros(100)
    w[:10] = 1.0
    with pytest.raises(NonFiniteError, match=r"training loss is nan.*90 of the 100 training rows weigh 0.*batch_size"):
        MLPClassifier(batch_size=5, max_iter=3, random_state=0).fit(x, labels, sample_weight=w)
    _fit(MLPClassifier(batch_size=100, max_iter=3, random_state=0), x, labels, sample_weight=w)  # one batch: trains


def test_scikit_learns_tools_route_the_weights_to_fit() -> None:
    """GridSearchCV slices ``sample_weight`` per fold and refits with all of it; a Pipeline passes
    ``step__sample_weight``: the refit and the pipeline's estimator equal a direct weighted fit bit for bit."""
    from sklearn.model_selection import GridSearchCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import FunctionTransformer

    x, labels, _, w = _table(80, 9)
    params: dict[str, Any] = {"hidden_layer_sizes": (8,), "max_iter": 3, "random_state": 0}
    direct = _fit(MLPClassifier(**params), x, labels, sample_weight=w)
    search = GridSearchCV(MLPClassifier(**params), {"alpha": [1e-4]}, cv=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        search.fit(x, labels, sample_weight=w)
        pipe = make_pipeline(FunctionTransformer(), MLPClassifier(**params))
        pipe.fit(x, labels, mlpclassifier__sample_weight=w)
    for fitted in (search.best_estimator_, pipe[-1]):
        assert fitted.loss_curve_ == direct.loss_curve_
        assert_array_equal(fitted.predict_proba(x), direct.predict_proba(x))
    assert _fit(MLPClassifier(**params), x, labels).loss_curve_ != direct.loss_curve_
