"""Learned embeddings of a table's categorical columns with many levels: the factorised first layer.

A categorical column of ``L`` levels reaches the network as ``L`` one-hot columns of ``X``
(:mod:`mlptrain.data.files.plan`, ``<col>=<level>``). Straight into the first layer, that is already an
embedding of width ``hidden[0]``: one row of ``W1`` per level, ``L x hidden[0]`` weights. With
``model.embedding_dim=d`` a column of at least ``model.embedding_min_levels`` one-hot columns goes through
a table ``E (L, d)`` of its own first (RealMLP in pytabkit and PyTorch Frame do the same), ``d << hidden[0]``::

    H_c = X_c @ E_c                       (B, L_c) @ (L_c, d) -> (B, d)   one plain GEMM (epilog DEFAULT)
    X'  = [X_other | H_1 | H_2 | ...]     (B, F_other + k d)              the first layer's input
    backward, given dX' = dZ_0 @ W_0      (B, F')                          layer 0's input-gradient GEMM
      dE_c = X_c^T @ dH_c                 (L_c, B) @ (B, d) -> (L_c, d)   one plain GEMM each

The data path does not change: ``X`` still holds every one-hot column (the loaders, host and stream
residency, predict's raw rows and the ONNX column plan see the same inputs), and the embedding takes its
blocks out of ``X`` on the device. ``E_c`` are :class:`~mlptrain.nn.layers.Param` like the weights: the
optimizer, weight decay, gradient clipping and checkpoints see them (``embed<i>.weight``).

What a block holds: the plan's one-hot columns stay 0/1 in every ``data.normalize`` mode (shift 0, scale 1:
:meth:`mlptrain.data.files.column_stats.ColumnStats.shift_scale`, as scikit-learn's ColumnTransformer leaves
them), so the block is read as it is and ``H_c`` is the row of ``E_c`` of the row's level (all zeros for a
level never seen in training), a lookup; only the levels present in a batch get a gradient. ``E_c`` starts
``N(0, s^2)`` with ``s = sqrt(F' / (d F))`` (:func:`start_std`): each level then adds to the first layer's
pre-activation what its one-hot column would under the same ``model.init``, not ``torch.nn.Embedding``'s
``N(0, 1)``, which made every level start as loud noise through the narrow layer.

Why GEMMs on the one-hot block, not a gather of rows by level index: keeping ``X`` as it is keeps every
consumer of the column plan unchanged, and with a 0/1 block the GEMM *is* the lookup (and its transpose the
scatter-add of ``dH`` rows into ``dE``), run by the same execution objects as the layers, so the NumPy engine
stays the GPU's oracle. The cost is ``2 B L_c d`` FLOPs each way per column, a ``d / hidden[0]`` share of what
the block cost one-hot, plus the first layer's input-gradient GEMM (``2 B H F'``), which a one-hot model
skips.

Inference needs no embedding: ``X_c E_c W_c^T = X_c (E_c W_c^T)``, so :func:`fold` turns a trained model
into a plain MLP whose first layer has, for block ``c``, the columns ``W_c E_c^T`` (``(H, L_c)``). The fold
reads no normalisation: training and predict both apply the checkpoint's (``data/shift``, ``data/scale``) to
the raw rows, and the embedding reads the normalised block as it is, as the folded layer does; whatever the
block holds, the two compute the same function. Predict, evaluate and the exports read the folded network;
the checkpoint keeps ``E_c`` and the narrow ``W_0`` for a resume.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlptrain.base.errors import CheckpointError
from mlptrain.nn.execution import FusedExecution, NaiveExecution
from mlptrain.nn.layers import Linear, Param

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Block:
    """One embedded column: its one-hot columns are ``X[:, start:stop]``."""

    name: str
    start: int
    stop: int

    @property
    def levels(self) -> int:
        return self.stop - self.start


def blocks(plan: dict[str, Any] | None, min_levels: int) -> list[Block]:
    """The categorical columns of the column plan ``plan`` (its meta, :meth:`ColumnPlan.to_meta`) with at least
    ``min_levels`` one-hot columns, in ``X``'s order. Each column's encoded width is that of
    :meth:`mlptrain.data.files.plan.Column.outputs`: a numeric column 1 (2 with its ``_missing`` indicator), a
    categorical one a column per level and one for the rare levels if any."""
    out, start = [], 0
    for c in (plan or {}).get("columns", []):
        if c["kind"] == "numeric":
            width = 2 if c.get("indicator") else 1
        else:
            width = len(c["levels"]) + (1 if c.get("rare") else 0)
            if width >= min_levels:
                out.append(Block(c["name"], start, start + width))
        start += width
    return out


def kept_columns(features: int, embedded: list[Block]) -> np.ndarray:
    """``(F_other,)`` int64: the columns of ``X`` not embedded, in order (the first layer reads them as they are)."""
    taken = np.zeros(features, bool)
    for b in embedded:
        taken[b.start : b.stop] = True
    return np.flatnonzero(~taken)


class ColumnEmbedding:
    """The embeddings of the blocks of ``X`` (see the module): ``x (B, F) -> x' (B, out_features)``.

    Args:
        embedded: the blocks (:func:`blocks`), at least one.
        features: ``F``, the columns of ``X``.
        dim: ``d``, the width of each embedding.
        rng: host Generator; each ``E_c`` starts ``N(0, s^2)``, ``s`` of :func:`start_std` (a level starts the
            first layer where one-hot starts it), drawn before the layers' weights.
    """

    def __init__(
        self,
        embedded: list[Block],
        features: int,
        dim: int,
        *,
        rng: np.random.Generator,
        xp: Any,
        param_dtype: Any,
        compute_dtype: Any,
    ) -> None:
        if not embedded or dim < 1:
            raise ValueError(f"an embedding needs blocks and dim >= 1; got {embedded}, {dim}")
        self.blocks, self.dim, self.xp = list(embedded), dim, xp
        self.in_features = features
        other = kept_columns(features, embedded)
        self.kept = len(other)
        # the kept columns as runs of X's columns between the blocks, (start, stop) each: one slice copy per run
        self.runs = _runs(other)
        self.out_features = self.kept + len(embedded) * dim
        self.std = start_std(features, self.out_features, dim)  # s = sqrt(F' / (d F)): see start_std
        self.tables = [
            Param(
                f"embed{i}.weight",
                xp.asarray(rng.standard_normal((b.levels, dim)) * self.std, dtype=param_dtype),
                compute_dtype,
            )
            for i, b in enumerate(embedded)
        ]  # (L_c, d) each, N(0, s^2)
        self.x: list[Any] = [None] * len(embedded)  # X_c (B, L_c) of the last forward, kept for dE_c

    @property
    def params(self) -> list[Param]:
        return list(self.tables)

    def forward(self, ex: FusedExecution | NaiveExecution, x: Any, keep: bool = True) -> Any:
        """``x (B, F) -> x' (B, F_other + k d)``: the kept columns, then ``H_c = X_c @ E_c`` of each block."""
        out = self.xp.empty((x.shape[0], self.out_features), dtype=x.dtype)  # (B, F')
        lo = 0
        for a, b in self.runs:  # (B, F_other): the columns that are not embedded, run by run
            out[:, lo : lo + b - a] = x[:, a:b]
            lo += b - a
        for i, blk in enumerate(self.blocks):
            xc = self.xp.ascontiguousarray(x[:, blk.start : blk.stop])  # (B, L_c) X_c, 0/1, C-contiguous
            lo = self.kept + i * self.dim
            out[:, lo : lo + self.dim] = ex.lookup(f"embed{i}", self.tables[i].for_gemm(), xc)  # (B, d)
            if keep:
                self.x[i] = xc
        return out

    def backward(self, ex: FusedExecution | NaiveExecution, first: Linear, dz: Any, cast: bool = True) -> None:
        """Fill each ``E_c.grad`` from ``dz (B, H)``, the first layer's pre-activation gradient.

        ``dX' (B, F') = dZ_0 @ W_0``: the first layer's input-gradient GEMM, plain (no activation below), which
        a model without embeddings never runs; then ``dE_c = X_c^T @ dH_c`` per block, ``dH_c`` its ``d``
        columns of ``dX'`` (copied contiguous, ``(B, d)``: the GEMM engines take whole matrices).
        ``cast=False``: the cast buffer still holds ``W_0`` (a model without hidden layers).
        """
        dx, _ = ex.input_grad(first.name, first.weight.for_gemm(cast), dz, None, False)  # (B, F')
        for i in range(len(self.blocks)):
            lo = self.kept + i * self.dim
            dh = self.xp.ascontiguousarray(dx[:, lo : lo + self.dim])  # (B, d)
            self.tables[i].grad = ex.lookup_grad(f"embed{i}", self.x[i], dh)  # (L_c, d)
            self.x[i] = None  # its last reader is enqueued: X_c goes, and the GEMM plans' references to it
            ex.release(f"embed{i}")

    def release_saved(self) -> None:
        self.x = [None] * len(self.blocks)

    def to_meta(self) -> dict[str, Any]:
        """What :func:`fold` needs besides the parameters, as a checkpoint's meta holds it (:func:`from_meta`)."""
        return {"dim": self.dim, "blocks": [[b.name, b.start, b.stop] for b in self.blocks]}


def start_std(features: int, narrow: int, dim: int) -> float:
    """``s``, the standard deviation of ``E_c``'s start: ``sqrt(F' / (d F))``, ``F`` the columns of ``X`` (one-hot's
    first-layer fan-in), ``F'`` the narrow first layer's (``F_other + k d``), ``d`` the width.

    The rule: a level starts the first layer's pre-activation as it does one-hot. Every ``model.init`` draws a
    first-layer weight of variance ``g / fan_in`` (``he`` g=2, ``lecun`` g=1, ``torch`` ``U(+-1/sqrt(fan_in))``
    g=1/3), so one-hot adds, for level ``l`` and hidden unit ``j``, ``W_0[j, l]`` of variance ``g / F``. Embedded,
    it adds ``(E_c W_c^T)[l, j] = sum_k E_c[l, k] W_c[j, k]``, ``d`` independent products of variance
    ``s^2 g / F'`` each: ``d s^2 g / F'``. Equal when ``s^2 = F' / (d F)``, whatever ``g``. At d=16 on the
    benchmark tables ``s`` is about 0.05, where a sweep of fixed values measured best (docs/benchmarks.md);
    ``N(0, 1)`` (``torch.nn.Embedding``'s) started each level ``1/s``, about 20x, louder than one-hot, noise that
    a rare level's few updates did not undo.
    """
    return math.sqrt(narrow / (dim * features))


def fold_checkpoint(params: dict[str, Any], meta: dict[str, Any], arrays: dict[str, Any], where: str) -> dict:
    """:func:`fold` of a checkpoint's parameters, with its ``meta["embedding"]`` (:meth:`ColumnEmbedding.to_meta`);
    ``params`` as they are for a model without embeddings.

    A checkpoint of the day the embeddings came (never released) may say what its blocks read (``inputs``):
    ``standardized`` read them as they are, as now, and ``onehot`` compared them back to 0/1, which is reading
    them as they are where its normalisation (``data/shift``, ``data/scale``) left them 0/1; both fold as now.

    Raises:
        CheckpointError: the embedding meta or the parameters' shapes do not fit (``where`` names the file), or an
            ``onehot`` checkpoint whose blocks were standardised (the 0/1 read-back this code no longer has).
    """
    spec = meta.get("embedding")
    if not spec:
        return params
    try:
        embedded = [Block(str(n), int(a), int(b)) for n, a, b in spec["blocks"]]
        f, dim = int(meta["widths"][0]), int(spec["dim"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: its embedding meta {spec} is not dim and [name, start, stop] blocks") from e
    want = {f"embed{i}.weight": (b.levels, dim) for i, b in enumerate(embedded)}
    wide = int(meta["widths"][1]), f - sum(b.levels for b in embedded) + len(embedded) * dim
    want |= {"layer0.weight": wide}
    got = {k: tuple(params[k].shape) if k in params else None for k in want}
    if got != want:
        raise CheckpointError(
            f"{where}: its embeddings {spec['blocks']} of width {dim} need parameters {want}; it holds {got}"
        )
    if spec.get("inputs", "standardized") != "standardized":
        _read_as_they_are(spec["inputs"], embedded, arrays, f, where)
    return fold(params, embedded, f)


def _read_as_they_are(inputs: Any, embedded: list[Block], arrays: dict[str, Any], f: int, where: str) -> None:
    """Refuse an old checkpoint whose blocks were not read as they are: ``inputs`` not ``onehot``, or ``onehot``
    over blocks its normalisation does not leave 0/1 (shift 0, scale 1)."""
    shift, scale = (np.asarray(arrays.get(f"data/{k}", np.full(f, v))) for k, v in (("shift", 0.0), ("scale", 1.0)))
    off = [b.name for b in embedded if np.any(shift[b.start : b.stop] != 0) or np.any(scale[b.start : b.stop] != 1)]
    if inputs == "onehot" and not off:
        return
    what = f"compared back to 0/1 over the standardised columns of {off}" if inputs == "onehot" else "unknown"
    raise CheckpointError(
        f"{where}: its embeddings read their one-hot blocks as {inputs!r} ({what}: a model.embedding_inputs of the "
        "day before the one-hot columns stayed 0/1); expected blocks read as they are: train it again"
    )


def _runs(columns: np.ndarray) -> list[tuple[int, int]]:
    """The sorted ``columns`` as maximal runs ``[start, stop)`` of consecutive indices."""
    breaks = np.flatnonzero(np.diff(columns) != 1) + 1  # where a run ends
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(columns, breaks) if len(r)]


def fold(params: dict[str, np.ndarray], embedded: list[Block], features: int) -> dict[str, np.ndarray]:
    """A trained model's parameters (``embed<i>.weight`` and the narrow ``layer0``) as those of the plain MLP
    that computes the same function on ``X (B, F)``: ``layer0.weight (H, F)``, ``layer0.bias`` unchanged.

    The kept columns keep their columns of ``W_0``; block ``c``, read by the narrow layer through its columns
    ``W_c (H, d)``, gets ``W_c E_c^T (H, L_c)``. Exact whatever ``X_c`` holds (the map is linear in it), in
    float64, rounded once to the parameters' dtype.
    """
    w = params["layer0.weight"]  # (H, F')
    other = kept_columns(features, embedded)
    wide = np.zeros((w.shape[0], features), np.float64)  # (H, F)
    wide[:, other] = w[:, : len(other)]
    out = {k: v for k, v in params.items() if not k.startswith("embed")}
    for i, blk in enumerate(embedded):
        E = params[f"embed{i}.weight"].astype(np.float64)  # (L_c, d)
        lo = len(other) + i * E.shape[1]
        wide[:, blk.start : blk.stop] = w[:, lo : lo + E.shape[1]].astype(np.float64) @ E.T  # (H, d) @ (d, L_c)
    out["layer0.weight"] = wide.astype(w.dtype)
    return out


def describe(embedded: list[Block], dim: int) -> str:
    """The log line of a model's embeddings: which columns, how many levels, the width."""
    cols = ", ".join(f"{b.name} ({b.levels} levels)" for b in embedded)
    return f"embedding {len(embedded)} categorical column(s) in {dim} dimensions each: {cols}"


def from_config(cfg: Any, data: Any, rng: np.random.Generator, xp: Any, prec: Any) -> ColumnEmbedding | None:
    """The embedding that ``cfg`` (a ``ModelConfig``: ``embedding_dim``, ``embedding_min_levels``) asks for on
    ``data`` (a :class:`~mlptrain.data.dataset.Dataset`: its column plan; None: no table), in ``prec``'s
    ``param_dtype`` and ``compute_dtype``; None when it is off or no column has enough levels (logged)."""
    if not cfg.embedding_dim or data is None:
        return None
    embedded = blocks(data.columns, cfg.embedding_min_levels)
    if not embedded:
        log.info(
            "model.embedding_dim=%s: no categorical column has model.embedding_min_levels=%s one-hot columns; "
            "all go into the first layer",
            cfg.embedding_dim,
            cfg.embedding_min_levels,
        )
        return None
    log.info(describe(embedded, cfg.embedding_dim))
    kw = {"rng": rng, "xp": xp, "param_dtype": prec.param_dtype, "compute_dtype": prec.compute_dtype}
    return ColumnEmbedding(embedded, data.num_features, cfg.embedding_dim, **kw)


def problems(cfg: Any, data_parallel: bool) -> list[str]:
    """What is wrong with the embedding settings of ``cfg`` (a ``TrainConfig``), or what they do not run with:
    one sentence each, for :func:`mlptrain.step.checks.validate`'s ConfigError."""
    m = cfg.model
    dim, least = m.embedding_dim, m.embedding_min_levels
    out = []
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 0):
        out.append(f"model.embedding_dim={dim!r} must be a positive width, or 0 or null (off)")
    if isinstance(least, bool) or not isinstance(least, int) or least < 2:
        out.append(f"model.embedding_min_levels={least!r} must be an integer of at least 2")
    if not dim or out:
        return out
    refused = {
        "precision=fp8": cfg.precision.name == "fp8",
        "an ensemble (ensemble.size > 1 or ensemble.folds)": cfg.ensemble.size != 1 or bool(cfg.ensemble.folds),
        "data parallel (distributed.gpus > 1, torchrun, mpirun)": data_parallel or cfg.distributed.gpus > 1,
    }
    found = [name for name, on in refused.items() if on]
    if found:
        out.append(f"model.embedding_dim={dim} does not run with {', '.join(found)} yet; set model.embedding_dim=null")
    return out
