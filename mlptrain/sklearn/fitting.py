"""What ``fit`` does with arrays: the CLI's split and normalisation, then epochs of the CLI's :class:`Trainer`.

The estimators train on exactly what ``python -m mlptrain data=file data.path=train.csv
data.test_path=test.csv`` would train on for the same rows, seed and settings (tests/test_sklearn.py
compares every step's loss):

* :func:`make_dataset` splits as :func:`mlptrain.data.prepare.load_dataset` does for a file with a
  test file of its own: one stratified ``val_fraction`` of the rows, drawn by a generator seeded
  ``[split_seed, 0xDA7A]``, and the normalisation from the train split alone (kept with the model);
* :func:`run_epoch` takes the steps :class:`mlptrain.run.loop.Loop` takes, by the same code
  (:meth:`mlptrain.run.interval.Interval.steps`: the same batches, from ``(seed, epoch)``), with no run
  directory: the per-step losses come back in memory, read from the device once per epoch (the estimators'
  log interval is the epoch: one host sync).

What ends the fit is scikit-learn's rule (:class:`Stopping`), not the CLI's ``early_stopping``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sklearn.metrics import accuracy_score, r2_score

from mlptrain.base.errors import ConfigError
from mlptrain.config.schema import TrainConfig
from mlptrain.data.dataset import Dataset, Normalization
from mlptrain.data.files.plan import ColumnPlan
from mlptrain.data.prepare import normalization, stratified_split
from mlptrain.nn.members import MemberMean, mean_of_probabilities
from mlptrain.run import faults
from mlptrain.run.interval import Closed, Interval
from mlptrain.sklearn.params import batch_rows, check, hidden_sizes, member_host_bytes
from mlptrain.sklearn.sample_weight import standardise, train_normalization
from mlptrain.step.memory import check_members_memory
from mlptrain.step.trainer import Trainer

# The seed stream of load_dataset's splits ([split_seed, SPLIT_STREAM]): the same rows held out as the CLI's
SPLIT_STREAM = 0xDA7A


def make_dataset(
    x: Any,
    y: np.ndarray,
    *,
    task: str,
    outputs: int,
    val_fraction: float,
    split_seed: int,
    method: str,
    norm: Normalization | None = None,
    names: dict[str, Any] | None = None,
    columns: Callable[[np.ndarray], tuple[np.ndarray, ColumnPlan]] | None = None,
    w: np.ndarray | None = None,
) -> Dataset:
    """The :class:`Dataset` of raw rows ``x (N, F)`` float64 and targets ``y`` (class indices ``(N,)``
    int64, or ``(N, T)`` float32), split and normalised as ``data=file`` with a test file does.

    ``norm``: keep this normalisation (a fit that continues one) instead of taking the train split's;
    ``names``: ``feature_names``, ``class_names``, ``target_names`` for the checkpoint; ``columns``: ``x`` is
    a DataFrame's raw columns (:mod:`mlptrain.sklearn.frames`), encoded by ``columns(train rows)``, which
    returns the inputs ``(N, F)`` float64 and the column plan (fitted on the train split, as the CLI's); ``w``:
    ``(N,)`` float64 row weights (``sample_weight``), the train split's kept as :attr:`Dataset.w_train`.
    """
    train, val = split_rows(y, task, val_fraction, split_seed)
    plan = None
    if columns is not None:
        x, plan = columns(train)
        names = {**(names or {}), "feature_names": plan.feature_names}  # the encoded columns, as the CLI's
    binary = None if plan is None else plan.binary()  # the plan's 0/1 columns: kept 0/1 in every mode
    if w is None:
        norm = norm or normalization(method, x[train], seed=split_seed, binary=binary)
    else:  # the statistics of the rows repeated w times (sample_weight.train_normalization)
        norm = norm or train_normalization(method, x[train], w[train], seed=split_seed, binary=binary)
    ts = None if w is None or task != "regression" else standardise(y[train], w[train])  # weighted, as the inputs
    ys = [y[rows] if ts is None else ts.apply(y[rows]) for rows in (train, val)]  # (scaled as preprocess scales)
    none = np.zeros((0, x.shape[1]), np.float32)  # no test split: the caller scores what it holds out
    return Dataset(
        "sklearn",
        norm.apply(x[train]),
        ys[0],
        norm.apply(x[val]),
        ys[1],
        none,
        ys[0][:0],
        outputs,
        task=task,
        normalization=norm,
        columns=None if plan is None else plan.to_meta(),
        target_scaling=ts,
        w_train=None if w is None else w[train],  # the training loss's weights; the held-out rows': FitSetup.w_val
        **(names or {}),
    )


def ensemble_memory(name: str, params: dict[str, Any], cfg: TrainConfig, ds: Dataset) -> None:
    """Raise ResourceError where an estimator's ``ensemble_size`` members (``cfg.ensemble.size``) cannot fit in the
    host's memory (:func:`check_members_memory`); one model is not checked."""
    if cfg.ensemble.size > 1:
        per = member_host_bytes(params, [ds.num_features, *cfg.model.hidden, ds.num_classes], cfg.data.batch_size)
        check_members_memory(f"{name}(ensemble_size={cfg.ensemble.size})", cfg.ensemble.size, per, "lower it")


def folds_memory(estimator: Any, X: Any, splits: list[Any]) -> None:
    """Cross-validation (:mod:`mlptrain.sklearn.crossval`): raise ResourceError before the folds' fits are prepared
    where their K copies of the training rows and K networks cannot fit in the host's memory (LeaveOneOut on many
    rows: K = N folds of N - 1 rows each). ``splits``: the folds' ``(train, test)`` row indices."""
    name, p = type(estimator).__name__, estimator.get_params()
    check(name, p)
    rows = max(len(train) for train, _ in splits)
    shape = np.shape(X)
    widths = [int(shape[1]) if len(shape) == 2 else 1, *hidden_sizes(name, p["hidden_layer_sizes"]), 1]
    per = member_host_bytes(p, widths, batch_rows(name, p["batch_size"], rows), rows)
    advice = "use fewer folds, or sklearn.model_selection's own function (one fold's fit at a time)"
    check_members_memory(f"cross-validation of {name} in {len(splits)} folds", len(splits), per, advice)


def split_rows(y: np.ndarray, task: str, val_fraction: float, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``(train, val)`` row indices of :func:`make_dataset`'s split (stratified by class for a classification)."""
    strata = y if task == "classification" else np.zeros(len(y), np.int64)
    return stratified_split(strata, val_fraction, np.random.default_rng([split_seed, SPLIT_STREAM]))


def val_weights(
    w: np.ndarray | None, y: np.ndarray, task: str, val_fraction: float, split_seed: int
) -> np.ndarray | None:
    """The held-out rows' ``sample_weight`` ``(V,)`` in :func:`make_dataset`'s order (None: no weights, or none held
    out): the weights of early stopping's validation score, as scikit-learn's MLP takes them."""
    if w is None or val_fraction == 0:
        return None
    held = w[split_rows(y, task, val_fraction, split_seed)[1]]  # (V,)
    if not held.sum() > 0:  # scikit-learn's SGDClassifier's words; its MLP would divide by 0
        raise ConfigError(
            f"The sample weights for validation set are all zero ({len(held)} rows held out by early_stopping=True, "
            f"validation_fraction={val_fraction}), consider using a different random state"
        )
    return held


def run_epoch(tr: Trainer, interval: Interval, epoch: int) -> tuple[np.ndarray, float]:
    """The steps of ``epoch`` on ``tr`` (:meth:`Interval.steps`, the CLI's); returns each step's loss ``(S,)`` and
    the epoch's mean loss.

    The CPU checks every step for inf/NaN (as the CLI: the error names the step); the GPU once per
    log interval, when the interval's metrics are read back.
    """
    each_step = not tr.backend.is_gpu
    losses: list[np.ndarray] = []
    rows = 0
    for step in interval.steps(epoch):
        rows += step.rows
        if each_step:
            _check(tr, np.array([float(np.max(step.loss))]), np.array([step.lr]), epoch, None)  # (K,): an ensemble
        if interval.full:
            losses.append(_read(tr, interval.close(), epoch))
    if interval.pending:
        losses.append(_read(tr, interval.close(), epoch))
    return np.concatenate(losses), float(tr.log.epoch_loss) / max(rows, 1)  # float() syncs the device


def _read(tr: Trainer, closed: Closed, epoch: int) -> np.ndarray:
    """The losses of a closed interval's steps (one host sync); the GPU checks them here."""
    got = closed.read.result()["loss"]
    if tr.backend.is_gpu:
        _check(tr, got, closed.lr, epoch, closed)
    faults.check_scaler(tr, closed.checks, closed.last)  # fp16: too many overflowing steps in a row
    return np.asarray(got, dtype=np.float64)


def _check(tr: Trainer, losses: np.ndarray, lrs: np.ndarray, epoch: int, closed: Closed | None) -> None:
    """Raise the inf/NaN error of the last step (``closed`` None: the CPU checks each) or of a closed interval."""
    checks, last = (None, None) if closed is None else (closed.checks, closed.last)
    each = closed is None
    error = faults.nonfinite_error(tr, losses, lrs, epoch, each_step=each, saved="", checks=checks, last_step=last)
    if error is not None:
        raise error


def outputs(tr: Trainer, split: str) -> np.ndarray:
    """The model's outputs ``(N, C)`` float64 on an evaluation split (the logits of a classification)."""
    tr.runtime.finish_precompile()
    model = (
        tr.model if tr.members == 1 else MemberMean(tr.model, mean_of_probabilities(tr.dataset.task, tr.cfg.model.loss))
    )  # the mean
    out = [tr.backend.to_host(model.forward(x, keep=False)) for x, _ in tr.eval_loaders[split].epoch(0)]
    if tr.backend.is_gpu:
        tr.gemm.release_operands()  # the plans forget the last batch
    return np.concatenate(out).astype(np.float64)


def split_score(tr: Trainer, task: str, w: np.ndarray | None = None) -> float:
    """scikit-learn's ``score`` on the held-out ``val`` split: accuracy, or R^2 (averaged over the targets), weighted
    by the held-out rows' ``w (V,)`` where the fit has ``sample_weight`` (as scikit-learn's MLP scores them)."""
    z, y = outputs(tr, "val"), tr.dataset.y_val
    if task == "classification":
        return float(accuracy_score(y, z.argmax(axis=1), sample_weight=w))
    return float(r2_score(y, z, sample_weight=w))


def held_out(tr: Any, ds: Any) -> tuple[Any, np.ndarray]:
    """A fold's held-out rows (``early_stopping=True``) on the device, as its own fit's loader holds them, and their
    targets (a regressor's scaled as its fit scales them)."""
    return tr.xp.asarray(ds.x_val, dtype=tr.precision.compute_dtype), np.asarray(ds.y_val)


def member_scores(tr: Any, held: list[tuple[Any, np.ndarray]], classification: bool) -> list[float]:
    """Cross-validation (:mod:`mlptrain.sklearn.crossval`): each member's ``score`` (accuracy, or R^2) on its own
    held-out rows ``held[k]`` (:func:`held_out`): one batched forward per batch of ``eval_batch_size`` rows, member
    k's rows in slice k (its own fit's batches where the sets have one size, as :func:`split_score` takes them)."""
    xp, b = tr.xp, tr.cfg.data.eval_batch_size
    outputs: list[list[np.ndarray]] = [[] for _ in held]
    for start in range(0, max(len(y) for _, y in held), b):
        parts = [x[start : start + b] for x, _ in held]
        rows = max(len(p) for p in parts)
        pad = [xp.zeros((rows - len(p), p.shape[1]), dtype=p.dtype) for p in parts]  # (a shorter set: zero rows)
        stack = xp.stack([xp.concatenate([p, z]) for p, z in zip(parts, pad, strict=True)])  # (K, B, F)
        z = tr.model.forward(stack, keep=False)  # (K, B, C): every member on its own rows
        for k, p in enumerate(parts):
            outputs[k].append(tr.backend.to_host(z[k, : len(p)]).astype(np.float64))
    tr.gemm.release_operands()
    out = []
    for (_, y), found in zip(held, outputs, strict=True):
        z = np.concatenate(found)
        out.append(float(accuracy_score(y, z.argmax(axis=1)) if classification else r2_score(y, z)))
    return out


@dataclass
class FitSetup:
    """What a fit trains (:meth:`mlptrain.sklearn.estimators.MLPClassifier.fit_setup`): the config, the split and
    normalised dataset, whether the fit is fresh (not a continued one), whether it stops early, the epochs
    done before it and the epochs it may take, and the held-out rows' ``sample_weight`` ``(V,)`` (None: unweighted)."""

    cfg: TrainConfig
    dataset: Dataset
    fresh: bool
    early: bool
    done: int
    epochs: int
    w_val: np.ndarray | None = None


@dataclass
class Stopping:
    """scikit-learn's MLP convergence rule, epoch by epoch.

    Without early stopping, an epoch counts as no improvement when its training loss is not below
    the best by more than ``tol``; with it, when the validation score (accuracy, or R^2) is not above
    the best by ``tol``, and the parameters of the best score are kept for the end. The fit has
    converged after more than ``n_iter_no_change`` such epochs in a row.
    """

    tol: float
    n_iter_no_change: int
    early_stopping: bool
    best_loss: float = np.inf
    best_score: float = -np.inf
    no_improvement: int = 0
    best_params: dict[str, np.ndarray] | None = field(default=None, repr=False)

    def update(self, tr: Any, loss: float, score: float | None) -> bool:
        """Record the epoch's training loss (and validation score); returns whether the fit has converged. ``tr``:
        the trainer (or what gives one member's parameters as ``tr.model.state_dict()``)."""
        if self.early_stopping:
            assert score is not None
            self.no_improvement = self.no_improvement + 1 if score < self.best_score + self.tol else 0
            if score > self.best_score:
                self.best_score, self.best_params = score, tr.model.state_dict()
        else:
            self.no_improvement = self.no_improvement + 1 if loss > self.best_loss - self.tol else 0
        self.best_loss = min(self.best_loss, loss)
        return self.no_improvement > self.n_iter_no_change

    def said(self) -> str:
        """scikit-learn's ``verbose`` line when the rule has stopped the fit."""
        what = "Validation score" if self.early_stopping else "Training loss"
        return (
            f"{what} did not improve more than tol={self.tol} for {self.n_iter_no_change} consecutive epochs. Stopping."
        )
