"""``MLPClassifier`` and ``MLPRegressor``: scikit-learn's MLP estimators, trained by mlptrain's :class:`Trainer`.

``fit(X, y)`` takes raw rows: it checks them as scikit-learn does (``validate_data``: shapes,
NaN/inf, the number and names of the features; a DataFrame with text, ``category`` or empty cells is encoded
by the CLI's column plan, :mod:`mlptrain.sklearn.frames`), splits and normalises them as the CLI's
``data=file`` does (:mod:`mlptrain.sklearn.fitting`), and trains the network the CLI would build
(:mod:`mlptrain.sklearn.params`) on the GPU when there is one, writing nothing to disk. The fitted
state is a checkpoint held in memory (:mod:`mlptrain.sklearn.persist`): ``predict`` scores raw rows
through a :class:`~mlptrain.inference.predictor.Predictor` of it, with the train split's normalisation, and
``save(path)`` writes it as a checkpoint file that ``python -m mlptrain.predict``, ``.evaluate`` and
``.export`` read.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils import check_random_state
from sklearn.utils.multiclass import check_classification_targets, unique_labels
from sklearn.utils.validation import check_is_fitted, validate_data

from mlptrain.base.errors import ConfigError, DatasetError
from mlptrain.data.dataset import check_real
from mlptrain.data.files.plan import ColumnPlan
from mlptrain.inference.predictor import Predictor, softmax
from mlptrain.run.checkpoint import Checkpoint
from mlptrain.run.ensemble import EnsembleTrainer
from mlptrain.run.interval import Interval
from mlptrain.sklearn import fitting, frames, persist
from mlptrain.sklearn.fitting import FitSetup, Stopping, make_dataset, run_epoch, split_score, val_weights
from mlptrain.sklearn.params import batch_rows, check, check_continuation, train_config
from mlptrain.sklearn.sample_weight import check_sample_weight, decay_scale
from mlptrain.step import build
from mlptrain.step.trainer import Trainer


class TargetError(DatasetError, ValueError):
    """The targets ``y`` cannot be learnt as given (one class, classes unknown to a continued fit)."""


class _BaseMLP(BaseEstimator):
    """What both estimators share: the parameters, ``fit`` / ``partial_fit``, the fitted state, ``save``."""

    _task = ""
    # the fitted attributes a checkpoint keeps besides the trainer's state (load sets these and no others)
    FITTED: tuple[str, ...] = (
        "n_iter_",
        "t_",
        "loss_curve_",
        "best_loss_",
        "best_validation_score_",
        "validation_scores_",
    )
    # fitted attributes (set by fit: an unfitted estimator has none of them)
    state_: Checkpoint
    predictor_: Predictor
    seed_: int
    n_iter_: int
    t_: int
    loss_curve_: list[float]
    step_losses_: list[float]

    def __init__(
        self,
        hidden_layer_sizes: Any = (100,),
        activation: str = "relu",
        *,
        solver: str = "adam",
        alpha: float = 1e-4,
        batch_size: Any = "auto",
        learning_rate: str = "constant",
        learning_rate_init: float = 1e-3,
        max_iter: int = 200,
        shuffle: bool = True,
        random_state: Any = None,
        tol: float = 1e-4,
        verbose: bool = False,
        warm_start: bool = False,
        momentum: float = 0.9,
        nesterovs_momentum: bool = True,
        early_stopping: bool = False,
        validation_fraction: float = 0.1,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-8,
        n_iter_no_change: int = 10,
        categorical_features: Any = "from_dtype",
        min_frequency: int = 1,
        normalize: str = "standard",
        execution: str = "fused",
        precision: str = "fp32",
        device: str = "auto",
        graph: bool | None = None,
        ensemble_size: int = 1,
    ) -> None:
        self.hidden_layer_sizes = hidden_layer_sizes
        self.activation = activation
        self.solver = solver
        self.alpha = alpha
        self.batch_size = batch_size
        self.learning_rate = learning_rate
        self.learning_rate_init = learning_rate_init
        self.max_iter = max_iter
        self.shuffle = shuffle
        self.random_state = random_state
        self.tol = tol
        self.verbose = verbose
        self.warm_start = warm_start
        self.momentum = momentum
        self.nesterovs_momentum = nesterovs_momentum
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon
        self.n_iter_no_change = n_iter_no_change
        self.categorical_features = categorical_features
        self.min_frequency = min_frequency
        self.normalize = normalize
        self.execution = execution
        self.precision = precision
        self.device = device
        self.graph = graph
        self.ensemble_size = ensemble_size

    # --- fitting ------------------------------------------------------------------------------

    def fit(self, X: Any, y: Any, sample_weight: Any = None) -> Any:
        """Train on raw rows ``X (N, F)`` and targets ``y`` for up to ``max_iter`` epochs; returns ``self``.
        ``sample_weight``: ``(N,)`` row weights in the training loss (:mod:`mlptrain.sklearn.sample_weight`)."""
        return self._fit(X, y, incremental=False, sample_weight=sample_weight)

    def _fit(self, X: Any, y: Any, *, incremental: bool, classes: Any = None, sample_weight: Any = None) -> Any:
        setup = self.fit_setup(X, y, incremental=incremental, classes=classes, sample_weight=sample_weight)
        cfg, ds, name = setup.cfg, setup.dataset, type(self).__name__
        fitting.ensemble_memory(name, self.get_params(), cfg, ds)  # K members that cannot fit: refused, not built
        tr = Trainer(cfg, ds) if cfg.ensemble.size == 1 else EnsembleTrainer(cfg, ds)  # docs/ensembles.md
        if not setup.fresh:
            arrays, meta = self.state_.arrays, self.state_.meta
            tr.load_state_dict(arrays, meta, step=meta["position"]["step"], where=f"the fitted {name}")
        tr.train_loader.shuffle = bool(self.shuffle)
        stop = Stopping(self.tol, self.n_iter_no_change, setup.early)
        with tr.backend.blas_threads(build.step_flops(tr.widths, cfg.data.batch_size)):  # the CLI's thread policy
            self._train(tr, setup, stop, converge=not incremental)
        self.state_ = persist.state(tr, self.n_iter_, self.fitted_attributes())
        self.predictor_ = persist.predictor(self.state_, self.device)
        return self

    def fit_setup(
        self, X: Any, y: Any, *, incremental: bool = False, classes: Any = None, sample_weight: Any = None
    ) -> FitSetup:
        """What ``fit`` trains: ``X`` and ``y`` checked, the seed drawn, the config and the split, normalised
        dataset (:func:`~mlptrain.sklearn.fitting.make_dataset`); sets ``classes_`` or ``n_outputs_``,
        ``n_features_in_``, ``seed_``. :func:`mlptrain.sklearn.crossval.cross_val_predict` takes it for each fold."""
        name = type(self).__name__
        params = self.get_params()
        check(name, params)
        fresh = not hasattr(self, "state_") or not (incremental or self.warm_start)
        regression = self._task == "regression"
        for name_, a in (("X", X), ("y", y)):  # complex numbers: refused, not cast to real with a warning
            check_real(a, name_, ConfigError)
        if not fresh:  # before anything changes: the fitted network and optimizer state must fit the parameters
            check_continuation(name, "partial_fit" if incremental else "warm_start=True", params, self.state_)
        columns = persist.target_columns(y)
        X, y, encoder = frames.fit_input(self, X, y, fresh=fresh, regression=regression)  # a frame: its plan
        w = check_sample_weight(name, sample_weight, len(y), self.ensemble_size)  # (N,) float64, or None
        targets, width = self._targets(y, fresh, classes)
        if self.batch_size != "auto" and not 1 <= self.batch_size <= len(y):
            warnings.warn(
                "Got `batch_size` less than 1 or larger than sample size. It is going to be clipped", stacklevel=4
            )
        early = self.early_stopping and not incremental
        if fresh:
            self.seed_ = int(check_random_state(self.random_state).randint(np.iinfo(np.int32).max))
            if isinstance(self.random_state, (int, np.integer)):
                self.seed_ = int(self.random_state)  # the CLI's seed=random_state
            self.n_iter_, self.t_, self.loss_curve_ = 0, 0, []
        done, epochs = self.n_iter_, 1 if incremental else self.max_iter
        cfg = train_config(
            params,
            task=self._task,
            batch=batch_rows(name, self.batch_size, len(y)),
            seed=self.seed_,
            epochs=done + epochs,
            val_fraction=self.validation_fraction if early else 0.0,
        )
        count = 1 if targets.ndim == 1 else targets.shape[1]  # target columns (a classification's one)
        if columns is None or len(columns) != count:  # unnamed: the CLI's default column, or y0, y1, ...
            columns = ["label"] if count == 1 else [f"y{i}" for i in range(count)]
        cfg.data.target = columns[0] if len(columns) == 1 else columns  # what evaluate reads as the target column
        names = {**self._names(), **({"target_names": columns} if regression else {})}
        norm = None if fresh else persist.normalization(self.state_)
        kw: dict[str, Any] = {"val_fraction": cfg.data.val_fraction, "split_seed": self.seed_, "method": self.normalize}
        ds = make_dataset(
            X, targets, task=self._task, outputs=width, norm=norm, names=names, columns=encoder, w=w, **kw
        )
        cfg.log_every = -(-len(ds.y_train) // cfg.data.batch_size)  # the epoch's steps: one host sync an epoch
        cfg.optimizer.weight_decay /= decay_scale(ds.w_train)  # alpha over a step's weight, as scikit-learn's
        w_val = val_weights(w, targets, self._task, cfg.data.val_fraction, self.seed_)  # early stopping's scores
        return FitSetup(cfg, ds, fresh, early, done, epochs, w_val)

    def _train(self, tr: Trainer, setup: FitSetup, stop: Stopping, *, converge: bool) -> None:
        """Epochs ``done .. done + epochs`` (fewer once converged, as scikit-learn's rule says)."""
        done, epochs = setup.done, setup.epochs
        self.step_losses_ = [] if not hasattr(self, "step_losses_") or done == 0 else self.step_losses_
        scores: list[float] = []
        converged = False
        interval = Interval(tr, tr.cfg.log_every)  # the steps' host side, as the CLI's loop keeps it
        with tr.stream, np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for epoch in range(done, done + epochs):
                steps, loss = run_epoch(tr, interval, epoch)
                self.step_losses_.extend(steps.tolist())
                self.loss_curve_.append(loss)
                self.n_iter_, self.t_ = epoch + 1, self.t_ + len(tr.dataset.y_train)
                score = split_score(tr, self._task, setup.w_val) if stop.early_stopping else None
                if self.verbose:
                    print(f"Iteration {epoch + 1}, loss = {loss:.8f}", flush=True)
                    if score is not None:
                        print(f"Validation score: {score:f}", flush=True)
                if score is not None:
                    scores.append(score)
                if converge and stop.update(tr, loss, score):
                    converged = True
                    if self.verbose:
                        print(stop.said(), flush=True)
                    break
        if converge and not converged:
            warnings.warn(
                f"Stochastic Optimizer: Maximum iterations ({self.max_iter}) reached and the optimization "
                "hasn't converged yet.",
                ConvergenceWarning,
                stacklevel=4,
            )
        if stop.early_stopping and stop.best_params is not None:
            tr.model.load_state_dict(stop.best_params)  # scikit-learn keeps the best validation score's weights
        self.best_loss_ = None if stop.early_stopping else stop.best_loss
        self.validation_scores_ = scores if stop.early_stopping else None
        self.best_validation_score_ = stop.best_score if stop.early_stopping else None

    def _names(self) -> dict[str, Any]:
        features = getattr(self, "feature_names_in_", None)
        return {"feature_names": None if features is None else [str(f) for f in features]}

    def fitted_attributes(self) -> dict[str, Any]:
        """What the checkpoint keeps besides the trainer's state, so that :meth:`load` restores the estimator."""
        return {"params": self.get_params(), **{k: getattr(self, k) for k in self.FITTED}}

    # --- the fitted model ---------------------------------------------------------------------

    def _outputs(self, X: Any) -> np.ndarray:
        """The network's outputs ``(N, C)`` float32 for raw rows ``X (N, F)`` (normalised as the train split)."""
        check_is_fitted(self)
        check_real(X, "X", ConfigError)
        p = self.predictor_
        X = frames.predict_input(self, X, p.plan) if p.plan else validate_data(self, X, reset=False, dtype=np.float64)
        flops = build.step_flops(p.widths, min(len(X), p.batch_size)) // 3  # a chunk's forward: one GEMM per layer
        with p.backend.blas_threads(flops):  # the CLI's thread policy, sized to the forward's GEMMs
            return p.logits(X)

    @property
    def column_plan_(self) -> ColumnPlan | None:
        """What each column of a DataFrame became (:mod:`mlptrain.sklearn.frames`); None: numeric input."""
        check_is_fitted(self)
        return self.predictor_.plan

    @property
    def n_layers_(self) -> int:
        """Layers counted as scikit-learn does: the input, the hidden layers and the output."""
        check_is_fitted(self)
        return len(self.state_.meta["widths"])

    @property
    def out_activation_(self) -> str:
        """``softmax`` (a classifier, two classes included) or ``identity`` (a regressor)."""
        check_is_fitted(self)
        return "softmax" if self._task == "classification" else "identity"

    @property
    def coefs_(self) -> list[np.ndarray]:
        """Each layer's weight matrix ``(in, out)`` as scikit-learn lays them out (views of the ``(out, in)``
        arrays of the checkpoint; an ensemble's ``(K, in, out)``); the first acts on the normalised features."""
        check_is_fitted(self)
        return [np.swapaxes(W, -1, -2) for W in persist.layers(self.state_, "weight")]

    @property
    def intercepts_(self) -> list[np.ndarray]:
        """Each layer's bias ``(out,)`` (an ensemble's ``(K, out)``)."""
        check_is_fitted(self)
        return persist.layers(self.state_, "bias")

    def save(self, path: Any) -> Any:
        """Write the fitted model as an mlptrain checkpoint (``.npz``): ``python -m mlptrain.predict ckpt=<path>``,
        ``.evaluate`` and ``.export`` read it, and :meth:`load` makes the estimator again. Returns the path."""
        check_is_fitted(self)
        return persist.save(self.state_, path)

    @classmethod
    def load(cls, path: Any) -> Any:
        """The estimator of a checkpoint that :meth:`save` wrote (or a CLI run's ``best.npz``)."""
        return persist.load(cls, path)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())  # type: ignore[misc]  # a copy: object's is __dict__ itself
        state.pop("predictor_", None)  # rebuilt from state_ (it may hold GPU arrays)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        if "state_" in state:
            self.predictor_ = persist.predictor(self.state_, self.device)


class MLPClassifier(ClassifierMixin, _BaseMLP):
    """scikit-learn's ``MLPClassifier`` on mlptrain: softmax cross-entropy over ``classes_`` (multi-class)."""

    _task = "classification"
    FITTED = (*_BaseMLP.FITTED, "classes_")
    classes_: np.ndarray

    def _targets(self, y: Any, fresh: bool, classes: Any) -> tuple[np.ndarray, int]:
        """``y`` as class indices ``(N,)`` int64 into :attr:`classes_`, and the number of classes."""
        check_classification_targets(y)
        if fresh:
            self.classes_ = np.unique(y if classes is None else classes)
            if len(self.classes_) < 2:
                raise TargetError(
                    f"{type(self).__name__} needs at least 2 classes in y; got 1 class ({self.classes_[0]!r})"
                )
        unknown = np.setdiff1d(y, self.classes_)
        if len(unknown):
            raise TargetError(
                f"y contains classes not in classes_: {unknown.tolist()!r}; expected labels among "
                f"{self.classes_.tolist()!r} (a continued fit keeps the classes of the first)"
            )
        return np.searchsorted(self.classes_, y).astype(np.int64), len(self.classes_)

    def _names(self) -> dict[str, Any]:
        return {**super()._names(), "class_names": [str(c) for c in self.classes_]}

    def partial_fit(self, X: Any, y: Any, sample_weight: Any = None, classes: Any = None) -> MLPClassifier:
        """One epoch over ``X, y`` (rows weighted by ``sample_weight``), continuing the fitted model; the first call
        needs ``classes`` (all of them)."""
        if not hasattr(self, "state_") and classes is None:
            raise TargetError(f"{type(self).__name__}.partial_fit needs classes=<every class> on its first call")
        fitted = hasattr(self, "state_") and classes is not None
        if fitted and not np.array_equal(self.classes_, unique_labels(classes)):  # scikit-learn's words
            raise TargetError(
                f"`classes={classes!r}` is not the same as on last call to partial_fit, was: {self.classes_!r}"
            )
        return self._fit(X, y, incremental=True, classes=classes, sample_weight=sample_weight)

    def predict(self, X: Any) -> np.ndarray:
        """The class of each raw row ``X (N, F)``: ``(N,)`` labels of :attr:`classes_`."""
        z = self._outputs(X)  # (N, C); checks that the model is fitted first
        return self.classes_[z.argmax(axis=1)]

    def predict_proba(self, X: Any) -> np.ndarray:
        """``(N, C)`` float64 class probabilities (softmax of the outputs), columns in :attr:`classes_` order."""
        return softmax(self._outputs(X).astype(np.float64))

    def predict_log_proba(self, X: Any) -> np.ndarray:
        return np.log(self.predict_proba(X))


class MLPRegressor(RegressorMixin, _BaseMLP):
    """scikit-learn's ``MLPRegressor`` on mlptrain: mean squared error over one or more targets."""

    _task = "regression"
    FITTED = (*_BaseMLP.FITTED, "n_outputs_")
    n_outputs_: int

    def _targets(self, y: Any, fresh: bool, classes: Any) -> tuple[np.ndarray, int]:
        """``y`` as ``(N, T)`` float32."""
        y2 = np.asarray(y, dtype=np.float32).reshape(len(y), -1)
        if not fresh and y2.shape[1] != self.n_outputs_:
            raise TargetError(
                f"y has {y2.shape[1]} targets per row; the fitted {type(self).__name__} has {self.n_outputs_}"
            )
        self.n_outputs_ = y2.shape[1]
        return y2, y2.shape[1]

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.target_tags.multi_output = True
        return tags

    def partial_fit(self, X: Any, y: Any, sample_weight: Any = None) -> MLPRegressor:
        """One epoch over ``X, y`` (rows weighted by ``sample_weight``), continuing the fitted model (the first call
        fits a new one)."""
        return self._fit(X, y, incremental=True, sample_weight=sample_weight)

    def predict(self, X: Any) -> np.ndarray:
        """``(N,)`` predictions for raw rows ``X (N, F)``, or ``(N, T)`` for several targets."""
        z = self._outputs(X).astype(np.float64)
        return z.ravel() if z.shape[1] == 1 else z
