"""scikit-learn's cross-validation calls, each fold's model trained in one batched run: ``cross_val_predict``,
``cross_validate``.

scikit-learn keeps cross-validation outside the estimator: ``cross_val_predict(estimator, X, y, cv=5)`` clones
the estimator, fits one clone per fold on the fold's training rows and predicts its test rows. These calls take
the same arguments and return the same values, but fit the K clones as the K members of one ensemble
(:class:`~mlptrain.run.ensemble.EnsembleTrainer`, docs/ensembles.md): every GEMM of a step one batched GEMM over
the folds. Member ``k`` is fold ``k``'s fit, and nothing else:

* its data is what ``clone(estimator).fit(X[train_k], y[train_k])`` trains on, prepared by that fit's own code
  (:meth:`~mlptrain.sklearn.estimators.MLPClassifier.fit_setup`): the held-out ``validation_fraction`` where
  ``early_stopping=True``, the normalisation (and a DataFrame's column plan, a regressor's target scaling)
  fitted on the fold's own training rows. The members' rows are stacked into one array, ``(sum_k n_k, F)``;
  member ``k`` gathers its batches from its block (:class:`~mlptrain.data.member_loader.MemberLoader`);
* its seed is that fit's (``random_state``, the same for every fold as scikit-learn's clones have it); its
  batches come in that fit's order, and its loss is reported in its own targets' units;
* it stops by that fit's rule (:class:`~mlptrain.sklearn.fitting.Stopping`: ``tol`` and ``n_iter_no_change`` on
  its training loss, or with ``early_stopping=True`` on its held-out score, whose best weights it keeps). The
  test fold never decides anything. A member that has converged trains on with the others (its slice of the
  batched step is cheap); its state at convergence is what it returns, as its own fit would have stopped there.

So where the folds' training sets have one size (``KFold`` of N divisible by K, stratified folds of class
counts divisible by K), each fold's fitted estimator equals its own fit bit for bit on the CPU (weights,
``n_iter_``, ``loss_curve_``), and the predictions equal scikit-learn's ``cross_val_predict``
(tests/test_sklearn_crossval.py). Where they differ by a row or two, the smaller sets are topped up with as
many of their own rows drawn again (seeded), so that all members take batches of one size: those folds see a
row or two twice an epoch, and differ from their own fits by that. A fold of another shape (a DataFrame fold whose
plan encodes to fewer columns, a fold whose training rows lack a class) trains widened to the others' shape and is cut
back to its own (:mod:`mlptrain.sklearn.foldshape`): the widened run of its rows, not its own fit.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np
from sklearn.base import clone, is_classifier
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import check_scoring
from sklearn.model_selection import check_cv
from sklearn.utils import _safe_indexing

from mlptrain.base.errors import ConfigError
from mlptrain.data.member_loader import MemberLoader
from mlptrain.data.prepare import preprocess, target_scaling
from mlptrain.nn.losses import mse_in_units
from mlptrain.nn.members import MemberHead
from mlptrain.run.ensemble import EnsembleTrainer
from mlptrain.run.interval import Interval
from mlptrain.sklearn import foldshape, persist
from mlptrain.sklearn.estimators import MLPClassifier, MLPRegressor
from mlptrain.sklearn.fitting import FitSetup, Stopping, folds_memory, held_out, member_scores, run_epoch
from mlptrain.step import build

ACCEPTED = (
    "cv=None or an int (StratifiedKFold for a classifier, KFold for a regressor, as scikit-learn chooses), a "
    "splitter whose test sets partition the rows (KFold, StratifiedKFold, GroupKFold, StratifiedGroupKFold, "
    "LeaveOneGroupOut, PredefinedSplit ...), or an iterable of (train, test) index pairs whose test sets do"
)
METHODS = {"classification": ("predict", "predict_proba", "predict_log_proba"), "regression": ("predict",)}


def cross_val_predict(
    estimator: Any,
    X: Any,
    y: Any,
    *,
    groups: Any = None,
    cv: Any = None,
    n_jobs: Any = None,
    verbose: int = 0,
    params: Any = None,
    pre_dispatch: Any = "2*n_jobs",
    method: str = "predict",
) -> np.ndarray:
    """scikit-learn's ``cross_val_predict`` for :class:`MLPClassifier` and :class:`MLPRegressor`, its folds trained
    as one batched run (the module docstring): each row's prediction (``method``) by the fold model that did not
    train on it, in row order. ``n_jobs``, ``verbose`` and ``pre_dispatch`` are scikit-learn's, and unused (one
    run, one process); ``params`` (fit parameters: ``sample_weight``) must be empty: the batched folds take no weights.

    Raises:
        ConfigError: a ``cv`` whose test sets do not partition the rows (ShuffleSplit, TimeSeriesSplit), a
            ``method`` the estimator lacks, fit parameters, or ``ensemble_size`` other than 1.
        TypeError: an estimator other than mlptrain's (use scikit-learn's own ``cross_val_predict``).
    """
    task = _task(estimator, "cross_val_predict")
    if method not in METHODS[task]:
        raise ConfigError(
            f"cross_val_predict(method={method!r}): {type(estimator).__name__} predicts with {', '.join(METHODS[task])}"
        )
    _no_fit_params(params)
    splits = folds(estimator, X, y, groups, cv)
    fitted = fit_folds(estimator, X, y, splits)
    out: np.ndarray | None = None
    every = np.unique(np.concatenate([e.classes_ for e in fitted])) if task == "classification" else None
    for est, (_, test) in zip(fitted, splits, strict=True):
        found = np.asarray(getattr(est, method)(_safe_indexing(X, test)))
        found = found if every is None else foldshape.all_classes(found, est.classes_, every, method)
        if out is None:
            out = np.empty((_rows(X), *found.shape[1:]), dtype=found.dtype)
        out[test] = found
    assert out is not None
    return out


def cross_validate(
    estimator: Any,
    X: Any,
    y: Any,
    *,
    groups: Any = None,
    scoring: Any = None,
    cv: Any = None,
    n_jobs: Any = None,
    verbose: int = 0,
    params: Any = None,
    pre_dispatch: Any = "2*n_jobs",
    return_train_score: bool = False,
    return_estimator: bool = False,
    return_indices: bool = False,
    error_score: Any = np.nan,
) -> dict[str, Any]:
    """scikit-learn's ``cross_validate``, the folds trained as one batched run: ``test_score`` (or
    ``test_<name>`` for several ``scoring`` names), ``train_score`` where asked, ``fit_time`` (the run's wall time
    shared equally among the folds), ``score_time``, ``estimator`` and ``indices`` where asked. The folds must
    partition the rows, as for :func:`cross_val_predict`; ``error_score`` is a failed scorer's score (a failed fit
    raises: the folds are one run)."""
    _task(estimator, "cross_validate")
    _no_fit_params(params)
    scorers = _scorers(estimator, scoring)
    splits = folds(estimator, X, y, groups, cv, caller="cross_validate")
    t0 = time.perf_counter()
    fitted = fit_folds(estimator, X, y, splits)
    k = len(splits)
    out: dict[str, Any] = {"fit_time": np.full(k, (time.perf_counter() - t0) / k), "score_time": np.zeros(k)}
    scores: dict[str, list[Any]] = {}  # test_<name> (or test_score), then train_<...>: each fold's value
    for i, (est, (train, test)) in enumerate(zip(fitted, splits, strict=True)):
        t1 = time.perf_counter()
        for which, rows in (("test", test), ("train", train)) if return_train_score else (("test", test),):
            for name, scorer in scorers.items():
                value = _score(scorer, est, _safe_indexing(X, rows), _safe_indexing(y, rows), error_score)
                for key, v in value.items() if isinstance(value, dict) else [(name, value)]:  # a dict: several
                    scores.setdefault(f"{which}_{key}" if key else f"{which}_score", []).append(v)
        out["score_time"][i] = time.perf_counter() - t1
    out.update({key: np.asarray(v, dtype=np.float64) for key, v in scores.items()})
    if return_estimator:
        out["estimator"] = fitted
    if return_indices:
        out["indices"] = {"train": [tr for tr, _ in splits], "test": [te for _, te in splits]}
    return out


def folds(estimator: Any, X: Any, y: Any, groups: Any, cv: Any, caller: str = "cross_val_predict") -> list[Any]:
    """The ``(train, test)`` row indices of ``cv`` (scikit-learn's ``check_cv``: an int is StratifiedKFold for a
    classifier of binary or multiclass targets, else KFold), after checking that the test sets partition the rows.

    Raises:
        ConfigError: the test sets leave rows out or hold a row twice (:data:`ACCEPTED` says what is taken).
    """
    n = _rows(X)
    try:
        splitter = check_cv(cv, y, classifier=is_classifier(estimator))
        pairs = list(splitter.split(X, y, groups))
    except ValueError as exc:  # scikit-learn's words: not an int, a splitter or an iterable; a group splitter's groups
        raise ConfigError(f"{caller}(cv={cv!r}): {exc}; accepted: {ACCEPTED}") from exc
    splits = [(_indices(train, n), _indices(test, n)) for train, test in pairs]
    test = np.concatenate([te for _, te in splits]) if splits else np.zeros(0, np.int64)
    counts = np.bincount(test, minlength=n) if len(test) else np.zeros(n, np.int64)
    if len(splits) < 2 or counts.min() != 1 or counts.max() != 1:
        what = f"{len(splits)} test set(s) holding {int((counts > 0).sum())} of the {n} rows"
        twice = int((counts > 1).sum())
        raise ConfigError(
            f"{caller}(cv={cv!r}) needs folds whose test sets partition the rows (every row in exactly one test "
            f"set, at least 2 folds); it gives {what}"
            + (f", {twice} of them more than once" if twice else "")
            + f"; accepted: {ACCEPTED}"
        )
    return splits


def fit_folds(estimator: Any, X: Any, y: Any, splits: list[Any]) -> list[Any]:
    """One fitted clone of ``estimator`` per fold, fold ``k``'s fitted on rows ``splits[k][0]``: the K fits
    trained as the members of one batched run (the module docstring)."""
    name = type(estimator).__name__
    if estimator.ensemble_size != 1:
        raise ConfigError(
            f"cross-validation of {name}(ensemble_size={estimator.ensemble_size}): the folds are the members of "
            "the batched run; set ensemble_size=1"
        )
    folds_memory(estimator, X, splits)  # K copies of the rows that cannot fit: refused before they are made
    ests = [clone(estimator) for _ in splits]
    setups = [e.fit_setup(_safe_indexing(X, r), _safe_indexing(y, r)) for e, (r, _) in zip(ests, splits, strict=True)]
    every = np.unique(np.concatenate([e.classes_ for e in ests])) if is_classifier(estimator) else None
    keep = [
        None if every is None or len(e.classes_) == len(every) else np.searchsorted(every, e.classes_) for e in ests
    ]
    tr, data = _trainer(setups, [e.seed_ for e in ests], keep, 0 if every is None else len(every))
    tr.train_loader.shuffle = bool(estimator.shuffle)
    with tr.backend.blas_threads(build.step_flops(tr.widths, tr.cfg.data.batch_size)):  # the CLI's thread policy
        runs = _train(tr, estimator, setups, data)
    _, meta = tr.state_dict()
    for est, setup, ds, run, own in zip(ests, setups, data, runs, keep, strict=True):
        _fitted(est, setup, ds, run, meta, own)
    late = [k for k, run in enumerate(runs) if not run.converged]
    if late:
        warnings.warn(
            f"Stochastic Optimizer: Maximum iterations ({estimator.max_iter}) reached and the optimization hasn't "
            f"converged yet (fold(s) {', '.join(map(str, late))}).",
            ConvergenceWarning,
            stacklevel=3,
        )
    return ests


@dataclasses.dataclass
class _Fold:
    """What fold k's fit did: its rule, its curves, and its member's state where it stopped."""

    stop: Stopping
    loss_curve: list[float] = dataclasses.field(default_factory=list)
    scores: list[float] = dataclasses.field(default_factory=list)
    n_iter: int = 0
    converged: bool = False
    state: dict[str, np.ndarray] | None = None  # param/..., optim/... of the member (its slices), at the stop


class _Member:
    """Member ``k`` of a trainer as :class:`Stopping` reads a trainer: its ``model.state_dict()``, sliced."""

    def __init__(self, tr: Any, k: int) -> None:
        self.model, self.k, self.tr = self, k, tr

    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: a[self.k].copy() for name, a in self.tr.model.state_dict().items()}


def _train(tr: Any, estimator: Any, setups: list[FitSetup], data: list[Any]) -> list[_Fold]:
    """Epochs of the batched run until every fold has stopped by its own fit's rule (or ``max_iter``)."""
    early = setups[0].early
    runs = [_Fold(Stopping(estimator.tol, estimator.n_iter_no_change, early)) for _ in setups]
    held = [held_out(tr, ds) for ds in data] if early else None
    interval = Interval(tr, tr.cfg.log_every)
    with tr.stream, np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for epoch in range(estimator.max_iter):
            run_epoch(tr, interval, epoch)
            extras = tr.epoch_extras()  # each member's training loss of the epoch (reads it back)
            scores = member_scores(tr, held, is_classifier(estimator)) if held is not None else None
            for k, run in enumerate(runs):
                if run.converged:
                    continue
                loss, score = extras[f"member{k}/train/loss"], None if scores is None else scores[k]
                run.loss_curve.append(loss)
                if score is not None:
                    run.scores.append(score)
                run.n_iter = epoch + 1
                if run.stop.update(_Member(tr, k), loss, score):
                    run.converged, run.state = True, _member_state(tr, k)
            if all(run.converged for run in runs):
                break
    for k, run in enumerate(runs):
        if run.state is None:
            run.state = _member_state(tr, k)
        if early and run.stop.best_params is not None:  # scikit-learn keeps the best validation score's weights
            run.state.update({f"param/{n}": a for n, a in run.stop.best_params.items()})
    return runs


def _member_state(tr: Any, k: int) -> dict[str, np.ndarray]:
    """Member ``k``'s parameters and optimizer state (host copies of its slices; ``optim/t`` as it is)."""
    out = {f"param/{n}": a[k].copy() for n, a in tr.model.state_dict().items()}
    out.update({f"optim/{n}": a if a.ndim == 0 else a[k].copy() for n, a in tr.optimizer.state_dict().items()})
    return out


def _trainer(setups: list[FitSetup], seeds: list[int], keep: list[Any], classes: int) -> tuple[Any, list[Any]]:
    """The batched run of the folds' fits, and each fold's dataset as its fit trains on it (a regressor's targets
    scaled on the fold's own rows; ``keep[k]``: fold k's classes among the ``classes`` of y, where it lacks some).
    Member ``k`` gathers from its block of the stacked training rows, topped up to the largest fold's size with its
    own rows drawn again (seeded by its seed)."""
    data = [preprocess(s.dataset, s.cfg.data) for s in setups]  # what the fit's trainer would do with it
    wide = max(d.num_features for d in data)  # one shape (foldshape): the widest plan, every class of y
    data = [d if d.num_features == wide else foldshape.padded(d, wide) for d in data]
    data = [d if k is None else foldshape.relabelled(d, k, classes) for d, k in zip(data, keep, strict=True)]
    sizes = [len(d.y_train) for d in data]
    big, most = int(np.argmax(sizes)), max(sizes)
    offsets = np.cumsum([0, *sizes[:-1]])
    rows = []
    for k, (n, start) in enumerate(zip(sizes, offsets, strict=True)):
        own = start + np.arange(n, dtype=np.int64)
        extra = np.random.default_rng([seeds[k], TOP_UP]).choice(own, most - n, replace=most - n > n)
        rows.append(np.concatenate([own, extra]))
    x, y = np.concatenate([d.x_train for d in data]), np.concatenate([d.y_train for d in data])  # (sum n_k, F)
    regression = data[big].task == "regression"
    kept = target_scaling("none", y) if regression else None  # each fold's targets are scaled already
    pool = dataclasses.replace(
        data[big], x_train=x, y_train=y, x_val=x[:0], y_val=y[:0], x_test=x[:0], y_test=y[:0], target_scaling=kept
    )

    def loaders(cfg: Any, _: Any, xp: Any, dtype: Any, data_seeds: list[int], *__: Any) -> tuple[Any, dict]:
        kw = {"xp": xp, "dtype": dtype, "drop_last": cfg.drop_last}
        return MemberLoader(x, y, cfg.batch_size, seeds=data_seeds, rows=rows, **kw), {}

    cfg = dataclasses.replace(setups[big].cfg)  # the largest fold's: batch_size="auto" is min(200, its rows)
    cfg.ensemble = dataclasses.replace(cfg.ensemble, size=len(setups))
    tr = EnsembleTrainer(cfg, pool, member_data=loaders, member_seeds=seeds)
    assert isinstance(tr.head, MemberHead)
    if regression:  # each member's loss in its own targets' units, as its fit reports it
        units = [d.target_units() for d in data]
        tr.head.member_losses = [tr.head.loss_fn if u is None else mse_in_units(tr.xp.asarray(u)) for u in units]
    return tr, data


TOP_UP = 0xF01D  # the stream of the rows drawn again to top a smaller fold up ([seed, TOP_UP])


def _fitted(est: Any, setup: FitSetup, data: Any, run: _Fold, meta: dict[str, Any], keep: Any) -> None:
    """Set fold ``est``'s fitted attributes and state as its own ``fit`` would: its curves and ``n_iter_``, its
    member's slices of the run's state in its own shape (``keep``: its classes' outputs, :mod:`foldshape`) with its
    own data's preprocessing, its position and its seed."""
    early, spe = setup.early, setup.cfg.log_every  # (log_every: the fit's steps per epoch)
    est.n_iter_, est.t_, est.loss_curve_ = run.n_iter, run.n_iter * len(data.y_train), run.loss_curve
    est.best_loss_ = None if early else run.stop.best_loss
    est.validation_scores_ = run.scores if early else None
    est.best_validation_score_ = run.stop.best_score if early else None
    data_meta, data_arrays = data.preprocessing()
    m = {key: v for key, v in meta.items() if key not in ("members", "folds")}  # one model's
    m.update(steps_per_epoch=spe, data=data_meta, rng={"seed": est.seed_, "data_seed": build.seeds(est.seed_)[1]})
    assert run.state is not None
    arrays, m["widths"] = foldshape.own_shape(run.state, m["widths"], setup.dataset.num_features, keep)
    arrays.update(data_arrays)
    est.state_ = persist.assemble(arrays, m, setup.cfg, run.n_iter * spe, spe, est.fitted_attributes())
    est.predictor_ = persist.predictor(est.state_, est.device)


def _task(estimator: Any, caller: str) -> str:
    if not isinstance(estimator, (MLPClassifier, MLPRegressor)):
        raise TypeError(
            f"mlptrain.sklearn.{caller} trains mlptrain's MLPClassifier or MLPRegressor as one batched run; got "
            f"{type(estimator).__name__}: use sklearn.model_selection.{caller} for other estimators"
        )
    return "classification" if isinstance(estimator, MLPClassifier) else "regression"


def _no_fit_params(params: Any) -> None:
    """Refuse fit parameters (``sample_weight``): the folds train as an ensemble's members, which take no weights."""
    if params:
        raise ConfigError(
            f"fit parameters {sorted(map(str, params))} (params=): the folds train as the members of one batched "
            "run, which takes no sample_weight yet; pass params=None, or use sklearn.model_selection.cross_val_predict "
            "(one fit per fold) for weighted folds"
        )


def _scorers(estimator: Any, scoring: Any) -> dict[str, Any]:
    """``scoring`` as scikit-learn reads it: None (the estimator's ``score``), a name or a callable (key ``""``:
    ``test_score``; a callable that returns a dict gives ``test_<key>`` for each of its keys), or a list of names or
    a dict of name to scorer (``test_<name>``)."""
    if isinstance(scoring, dict):
        return {str(name): check_scoring(estimator, s) for name, s in scoring.items()}
    if isinstance(scoring, (list, tuple, set)):
        return {str(name): check_scoring(estimator, name) for name in scoring}
    return {"": check_scoring(estimator, scoring)}


def _score(scorer: Any, est: Any, X: Any, y: Any, error_score: Any) -> Any:
    """``scorer(est, X, y)``; where it fails, ``error_score`` with scikit-learn's warning (``"raise"``: the error)."""
    try:
        return scorer(est, X, y)
    except Exception:
        if isinstance(error_score, str) and error_score == "raise":
            raise
        warnings.warn(
            "Scoring failed. The score on this train-test partition for these parameters will be set to "
            f"{error_score}. Details: \n{traceback.format_exc()}",
            UserWarning,
            stacklevel=3,
        )
        return error_score


def _rows(X: Any) -> int:
    return int(X.shape[0]) if hasattr(X, "shape") else len(X)


def _indices(rows: Iterable[Any], n: int) -> np.ndarray:
    """A fold's rows as int64 indices (a boolean mask too); indices outside ``[0, n)`` are one ConfigError."""
    a = np.asarray(rows)
    a = np.flatnonzero(a) if a.dtype == bool else a.astype(np.int64)
    if len(a) and (a.min() < 0 or a.max() >= n):
        raise ConfigError(f"a fold holds row {int(a.min() if a.min() < 0 else a.max())}; X has rows 0 to {n - 1}")
    return a
