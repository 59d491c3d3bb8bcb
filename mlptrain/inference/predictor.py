"""Scoring raw inputs with a trained model: :class:`Predictor`, and :func:`predict` on arrays.

A checkpoint holds what scoring needs besides the parameters (format 2, see
:mod:`mlptrain.run.checkpoint`): the widths and activation, the normalisation of the raw features
(``data/shift``, ``data/scale``), the feature names (columns are matched by name), and the class
names or regression targets. The :class:`Predictor` rebuilds the network on the CPU or the GPU and
runs, per batch::

    x (B, F) raw float32
      -> data.normalize=quantile: mapped columns through their     on the host, float64 (data/quantiles)
         training quantiles to a standard normal
      -> (x - shift) / scale, cast to the compute dtype           the training data's preprocessing
      -> hidden layers: relu(x @ W^T + b)                         RELU_BIAS (no relu_aux: no backward)
      -> output layer:  logits = h @ W^T + b                      BIAS
      -> classification: class id = argmax(logits), probabilities = softmax(logits)
         regression: outputs * target_scale + target_shift          the targets' units (standardised
                                                                   in training, data.target_scaling)

Training uses RELU_AUX_BIAS, whose bit-packed ReLU mask (``relu_aux``) exists for the backward
pass; inference needs no mask, so it uses the epilog that writes none (:meth:`MLP.forward` with
``keep=False``). On the GPU the forward pass and the argmax/softmax of a batch are one replayed
CUDA graph (:mod:`mlptrain.inference.cuda.predictor`), and nothing goes back to the host before the last batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.base.backend import Backend, get_backend
from mlptrain.base.errors import CheckpointError, ConfigError, DatasetError
from mlptrain.base.registry import joined
from mlptrain.data.dataset import Normalization, raw_rows_problem, saved_target_scaling
from mlptrain.data.files.plan import ColumnPlan
from mlptrain.inference import columns
from mlptrain.inference.consistency import check_for_scoring
from mlptrain.nn import embedding
from mlptrain.nn.batched import BatchedMLP, BatchedNumpyGemm
from mlptrain.nn.execution import ACTIVATIONS, FusedExecution, NumpyGemm
from mlptrain.nn.members import MemberMean, mean_of_probabilities
from mlptrain.nn.network import MLP
from mlptrain.run import checkpoint
from mlptrain.step.precision import Precision, get_precision

log = logging.getLogger(__name__)

DEFAULT_BATCH = 8192


@dataclass
class Outputs:
    """What a model says of ``N`` rows.

    Attributes:
        class_id: classification: ``(N,)`` int64, the argmax of the logits; regression: None.
        probabilities: classification, when asked for: ``(N, C)`` float32 softmax of the logits.
        values: regression: ``(N, T)`` float32 outputs; classification: None.
    """

    class_id: np.ndarray | None = None
    probabilities: np.ndarray | None = None
    values: np.ndarray | None = None


class Predictor:
    """A trained model, ready to score raw inputs (``mlptrain.predict``, ``python -m mlptrain.predict``).

    Args:
        ckpt: a checkpoint file (``<run dir>/checkpoints/best.npz``), a run directory (its
            ``best.npz``), or a loaded :class:`~mlptrain.run.checkpoint.Checkpoint`.
        device: ``auto`` (the GPU when there is one), ``cpu`` or ``gpu``.
        precision: the GEMMs' precision; default the checkpoint's where the device has it (on
            the CPU: fp32, or fp64 for an fp64 checkpoint).
        batch_size: rows per batch.
        autotune: GPU: time cuBLASLt's candidate algorithms for each GEMM once and keep the fastest.

    Raises:
        CheckpointError: the file is not a readable checkpoint, one without the preprocessing
            (format version 1), or one whose model and preprocessing do not fit together
            (:func:`mlptrain.inference.consistency.check_for_scoring`).
    """

    def __init__(
        self,
        ckpt: str | Path | checkpoint.Checkpoint,
        *,
        device: str = "auto",
        precision: str | None = None,
        batch_size: int = DEFAULT_BATCH,
        autotune: bool = False,
    ) -> None:
        if not isinstance(ckpt, checkpoint.Checkpoint):
            ckpt = checkpoint.load(_checkpoint_path(Path(ckpt).expanduser()))
        if ckpt.meta.get("data") is None or "data/shift" not in ckpt.arrays:
            raise CheckpointError(
                f"checkpoint {ckpt.path} (format version {ckpt.meta['format_version']}, mlptrain "
                f"{ckpt.meta['mlptrain']}) does not hold the data's preprocessing (normalisation, feature and class "
                "names), which scoring raw inputs needs; train it again with this mlptrain (format version "
                f"{checkpoint.FORMAT_VERSION})"
            )
        check_for_scoring(ckpt)  # the SHA-256 says the file is intact, not that its arrays fit together
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size}; expected a positive number of rows")
        self.path = ckpt.path
        self.meta = ckpt.meta
        data = ckpt.meta["data"]
        self.task: str = data["task"]
        self.widths: list[int] = list(ckpt.meta["widths"])
        self.feature_names: list[str] | None = data.get("feature_names")
        self.class_names: list[str] | None = data.get("class_names")
        self.target_names: list[str] | None = data.get("target_names")
        self.plan = ColumnPlan.from_meta(data.get("columns"))  # raw columns -> the model's inputs, or None
        self.normalization = Normalization.saved(str(data.get("normalize")), ckpt.arrays)
        self.shift = self.normalization.shift  # (F,) float64
        self.scale = self.normalization.scale  # (F,) float64, > 0
        self.targets = saved_target_scaling(ckpt.meta, ckpt.arrays)  # a regression's outputs -> the targets' units
        self.raw_rows_problem = raw_rows_problem(ckpt.meta, f"checkpoint {ckpt.path}")
        self.batch_size = batch_size
        self.backend: Backend = get_backend(device)
        self.precision = _precision(precision, ckpt.meta["precision"], self.backend)
        self.model = _model(ckpt, self.backend, self.precision, autotune)
        self.gpu_runner: Any = None  # the GPU runner, built on first use (mlptrain.inference.cuda.predictor)

    # --- what the model expects ------------------------------------------------------------

    @property
    def num_features(self) -> int:
        return self.widths[0]

    @property
    def num_outputs(self) -> int:
        return self.widths[-1]

    @property
    def classification(self) -> bool:
        return self.task == "classification"

    @property
    def target_columns(self) -> list[str]:
        """The columns that held the targets in training (an input file may have them: accuracy)."""
        if not self.classification:
            return list(self.target_names or [])
        target = (self.meta.get("config") or {}).get("data", {}).get("target", "label")
        if isinstance(target, list) and len(target) == 1:  # data.target=[animal]
            target = target[0]
        return [target] if isinstance(target, str) else ["label"]

    def class_name(self, ids: np.ndarray) -> list[str]:
        names = self.class_names or [str(i) for i in range(self.num_outputs)]
        return [names[i] for i in ids]

    def check_probabilities(self, probabilities: bool) -> None:
        """Refuse ``probabilities=true`` for a regression, which has none (rather than ignore it)."""
        if probabilities and not self.classification:
            raise ConfigError(
                f"probabilities=true: the model {self.path.name} is a regression (targets "
                f"{', '.join(self.target_names or [])}), which has no class probabilities; leave probabilities out"
            )

    def describe(self) -> str:
        what = f"{self.num_outputs} classes" if self.classification else f"targets {', '.join(self.target_names or [])}"
        return (
            f"{self.path}: model {'-'.join(map(str, self.widths))} ({what}), {self.precision.name} on "
            f"{self.backend.device}"
        )

    # --- scoring --------------------------------------------------------------------------------

    def run(self, x: Any, *, probabilities: bool = False, progress: Callable[[int], None] | None = None) -> Outputs:
        """Score raw rows ``x (N, F)`` (NumPy, or CuPy on the GPU), in the checkpoint's feature order.

        ``progress`` is called with the number of rows of each batch as it is queued.
        """
        self.check_probabilities(probabilities)
        x = self._mapped(self._check(x, raw=True))
        if self.backend.is_gpu and len(x):
            if self.gpu_runner is None:
                from mlptrain.inference.cuda.predictor import GraphedInference

                forward = lambda rows: self.model.forward(rows, keep=False)  # RELU_BIAS ... BIAS
                self.gpu_runner = GraphedInference(forward, self.shift, self.scale, self.precision.compute_dtype)
            host = self.gpu_runner.run(
                x, self.batch_size, classification=self.classification, probabilities=probabilities, progress=progress
            )
            if not self.classification:
                return Outputs(values=self.targets.undo(host[0]))
            return Outputs(class_id=host[0], probabilities=host[1] if probabilities else None)
        out = self._run_cpu(x, probabilities, progress)
        if out.values is not None:
            out.values = self.targets.undo(out.values)
        return out

    def logits(self, x: Any, *, normalised: bool = False) -> np.ndarray:
        """The model's outputs ``(N, out)`` float32 (CPU or GPU): a classification's logits, a regression's
        values in the targets' units.

        ``normalised``: ``x`` is normalised already (a :class:`~mlptrain.data.Dataset`'s split).
        """
        x = self._check(x, raw=not normalised)
        x = x if normalised else self._mapped(x)
        out = np.empty((len(x), self.num_outputs), dtype=np.float32)
        for s in range(0, len(x), self.batch_size):
            rows = x[s : s + self.batch_size]
            xb = self._cast(rows) if normalised else self._normalise(rows)
            z = self.model.forward(xb, keep=False)  # RELU_BIAS ... BIAS
            out[s : s + len(z)] = z.get() if self.backend.is_gpu else z
        return out if self.classification else self.targets.undo(out)

    def _run_cpu(self, x: np.ndarray, probabilities: bool, progress: Callable[[int], None] | None) -> Outputs:
        n = len(x)
        out = Outputs()
        if self.classification:
            out.class_id = np.empty(n, dtype=np.int64)
            if probabilities:
                out.probabilities = np.empty((n, self.num_outputs), dtype=np.float32)
        else:
            out.values = np.empty((n, self.num_outputs), dtype=np.float32)
        for s in range(0, n, self.batch_size):
            z = self.model.forward(self._normalise(x[s : s + self.batch_size]), keep=False)  # (b, out)
            e = s + len(z)
            if out.values is not None:
                out.values[s:e] = z
            else:
                out.class_id[s:e] = z.argmax(axis=1)  # type: ignore[index]
                if out.probabilities is not None:
                    out.probabilities[s:e] = softmax(z.astype(np.float32))
            if progress is not None:
                progress(e - s)
        return out

    def _normalise(self, x: Any) -> Any:
        """``(x - shift) / scale`` as the training data was normalised, in the compute dtype."""
        xp = self.backend.xp
        z = (xp.asarray(x, dtype=xp.float64) - xp.asarray(self.shift)) * xp.asarray(1.0 / self.scale)  # float64
        z = z.astype(xp.float32)  # rounded once, as mlptrain.data.files.chunks.normalise_into does
        return xp.ascontiguousarray(z.astype(self.precision.compute_dtype, copy=False))

    def _mapped(self, x: Any) -> Any:
        """``x (N, F)`` with ``data.normalize=quantile``'s columns mapped to a standard normal (a float64 copy on the
        host, where the GPU predictor takes it from), or ``x`` itself where the model has no such map."""
        if self.normalization.quantile is None:
            return x
        host = x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x  # a CuPy array: to the host
        return self.normalization.quantile.apply_(np.array(host, dtype=np.float64))

    def _cast(self, x: Any) -> Any:
        xp = self.backend.xp
        return xp.ascontiguousarray(xp.asarray(x).astype(self.precision.compute_dtype, copy=False))

    def _check(self, x: Any, raw: bool = False) -> Any:
        if raw and self.raw_rows_problem:
            raise CheckpointError(self.raw_rows_problem)
        if getattr(x, "ndim", None) != 2 or x.shape[1] != self.num_features:
            shape = getattr(x, "shape", type(x).__name__)
            raise DatasetError(
                f"inputs of shape {shape}; the model {self.path.name} takes (N, {self.num_features}) rows of "
                f"features{columns.names_hint(self.feature_names)}"
            )
        if not self.backend.is_gpu or type(x).__module__.startswith("numpy"):
            x = np.asarray(x)
            if not np.issubdtype(x.dtype, np.number):
                raise DatasetError(f"inputs of dtype {x.dtype}; expected numbers")
            if not np.isfinite(x).all():
                row, col = np.argwhere(~np.isfinite(x))[0]
                name = self.feature_names[col] if self.feature_names else f"column {col}"
                at = f"row {row} (0-based)"
                raise DatasetError(f"inputs {at}, {name} holds {x[row, col]}; features must be finite numbers")
        return x

    # --- files: matched to the model by mlptrain.inference.columns ----------------------------------------

    def arrange(self, names: list[str], x: np.ndarray, where: str, named: bool = True) -> np.ndarray:
        """The columns of a file (``names``, values ``x (N, len(names))``) in the model's feature order
        (:func:`mlptrain.inference.columns.arrange`)."""
        return columns.arrange(names, x, where, self.feature_names, self.num_features, self.target_columns, named=named)

    @property
    def input_names(self) -> list[str] | None:
        """The raw columns an input file holds: the column plan's (text and empty cells encoded by it), else the
        model's features (None: unnamed)."""
        return self.plan.names if self.plan is not None else self.feature_names

    def encode(self, cells: dict[str, np.ndarray], where: str, place: Callable[[int], str]) -> np.ndarray:
        """Raw cells (column -> ``(N,)`` text) as the model's features ``(N, F)`` by the column plan; levels never
        seen in training encode as zeros, counted in one log line."""
        assert self.plan is not None
        x, unknown = self.plan.encode(cells, place, where)
        if unknown:
            counts = ", ".join(f"{c} ({n})" for c, n in unknown.items())
            log.info("%s: levels never seen in training, scored as unknown (all zeros): %s", where, counts)
        return x

    def check_columns(self, names: list[str], where: str) -> None:
        """Raise DatasetError if the feature columns ``names`` are not the model's
        (:func:`mlptrain.inference.columns.check_columns`)."""
        columns.check_columns(names, where, self.input_names, self.target_columns)

    def labels(self, y: np.ndarray, where: str, place: Callable[[int], str] | None = None) -> np.ndarray:
        """Class indices of a target column: by class name, or an integer class index
        (:func:`mlptrain.inference.columns.labels`; ``place(row)`` names a row's place in its file)."""
        return columns.labels(y, where, self.class_names or [str(i) for i in range(self.num_outputs)], place)


def softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise softmax of ``z (N, C)``, shifted by the row maximum (no overflow)."""
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def predict(
    ckpt: str | Path | Predictor,
    x: Any,
    *,
    probabilities: bool = False,
    device: str = "auto",
    batch_size: int = DEFAULT_BATCH,
) -> np.ndarray:
    """Score raw rows ``x (N, F)`` with a checkpoint (``mlptrain.predict(ckpt, x)``).

    Returns the class ids ``(N,)`` (``probabilities=True``: the ``(N, C)`` probabilities), or a
    regression's outputs ``(N, T)``. ``x`` holds raw features in the training data's column order
    (a pandas DataFrame is matched by column name).
    """
    p = ckpt if isinstance(ckpt, Predictor) else Predictor(ckpt, device=device, batch_size=batch_size)
    columns = getattr(x, "columns", None)
    if columns is not None and p.plan is not None:  # raw columns: text, empty cells (NaN, None) encoded by the plan
        cells = {str(c): np.char.strip(np.asarray(x[c]).astype(str)) for c in columns if str(c) in p.plan.names}
        x = p.encode(cells, "the DataFrame", lambda row: f"row {row}")
    elif columns is not None:  # a DataFrame: by name, the target column ignored
        features = [c for c in columns if str(c) not in p.target_columns]  # selected before any conversion
        x = p.arrange([str(c) for c in features], np.asarray(x[features], dtype=np.float64), "the DataFrame")
    out = p.run(x, probabilities=probabilities)
    if out.values is not None:
        return out.values
    return out.probabilities if probabilities else out.class_id  # type: ignore[return-value]


def _checkpoint_path(path: Path) -> Path:
    if path.is_dir():
        for candidate in (path / checkpoint.CHECKPOINT_DIR / "best.npz", path / "best.npz"):
            if candidate.is_file():
                return candidate
        raise CheckpointError(f"{path} is a folder without checkpoints/best.npz; give a checkpoint file")
    return path


def _precision(name: str | None, saved: str, backend: Backend) -> Precision:
    if name is None:  # an FP8-trained model predicts in bf16 (its compute dtype) on any GPU
        name = ("bf16" if saved == "fp8" else saved) if backend.is_gpu else ("fp64" if saved == "fp64" else "fp32")
    return get_precision(name, backend)


def _model(ckpt: checkpoint.Checkpoint, backend: Backend, prec: Precision, autotune: bool = False) -> Any:
    """The network of the checkpoint, its parameters loaded, on ``backend``."""
    if backend.is_gpu:
        from mlptrain.nn.cuda.gemm import NvmathGemm

        gemm: Any = NvmathGemm(tf32=prec.tf32, autotune=autotune)
    else:
        gemm = NumpyGemm()
    config = ckpt.meta.get("config") or {}
    activation = config.get("model", {}).get("activation", "relu")
    if activation not in ACTIVATIONS:
        raise CheckpointError(
            f"checkpoint {ckpt.path}: model.activation={activation!r} is not {joined(ACTIVATIONS.names(), 'or')}"
        )
    members = ckpt.meta.get("members", 1)  # an ensemble: its members' mean (mlptrain.nn.members.MemberMean)
    common = dict(xp=backend.xp, param_dtype=prec.param_dtype, compute_dtype=prec.compute_dtype, activation=activation)
    if members == 1:
        model: Any = MLP(ckpt.meta["widths"], execution=FusedExecution(gemm), rng=np.random.default_rng(0), **common)
    else:
        engine = gemm if backend.is_gpu else BatchedNumpyGemm()  # nvmath takes the stacks as they are
        rngs = [np.random.default_rng(0)] * members
        model = BatchedMLP(ckpt.meta["widths"], execution=FusedExecution(engine), rngs=rngs, **common)
    params = {k[len("param/") :]: v for k, v in ckpt.arrays.items() if k.startswith("param/")}
    params = embedding.fold_checkpoint(params, ckpt.meta, ckpt.arrays, f"checkpoint {ckpt.path}")  # a plain MLP
    expected = {p.name: tuple(p.value.shape) for p in model.params}
    got = {k: tuple(v.shape) for k, v in params.items()}
    if got != expected:
        raise CheckpointError(f"checkpoint {ckpt.path}: parameters {got} do not fit the model {expected}")
    model.load_state_dict(params)
    loss = config.get("model", {}).get("loss", "cross_entropy")  # mse on one-hot classes: the mean output
    return model if members == 1 else MemberMean(model, mean_of_probabilities(ckpt.meta["data"]["task"], loss))
