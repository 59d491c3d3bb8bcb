"""The checkpoint file: one ``.npz`` each, written atomically, read back with every check.

A checkpoint is ``<run dir>/checkpoints/last.npz`` (the latest state) or ``best.npz`` (the epoch
with the best validation accuracy), an uncompressed NumPy zip that is read with
``allow_pickle=False``:

========================= ============================================================
entry                     contents
========================= ============================================================
``param/<name>``          master copy of each parameter (``layer0.weight`` ...), param dtype
``optim/<name>/<state>``  optimizer state (``momentum``, ``exp_avg``, ``exp_avg_sq``), its dtype (bfloat16 as uint16)
``optim/t``               the optimizer's count of applied updates, float64, 0-d
``data/shift``, ``scale`` the normalisation of the raw features (``(x - shift) / scale``), float64
``data/quantiles``        ``data.normalize=quantile``: ``(Q, K)`` float64 training quantiles of the columns
``data/quantile_columns`` ``(K,)`` int64 that are mapped to a standard normal before the shift
``members/loss_sum``      an ensemble's ``(K,)`` training loss x rows and ``members/correct`` of the epoch so far
``folds/best/<name>``     ``ensemble.folds``: each member's best weights on its fold, stacked as ``param/``
``meta``                  UTF-8 JSON as a uint8 array (:data:`META_SCHEMA`)
========================= ============================================================

The state comes from its owners (:meth:`mlptrain.step.trainer.Trainer.state_dict`, the run's
:class:`Position` and :class:`Best`); this module is the file format only and knows nothing of
trainers. ``meta`` holds the format version and mlptrain version; the position in the data order
(``step``, ``epoch``, ``batch``: the next batch of that epoch, and the epoch's running sums); the
model (``widths``, dtypes, precision, execution mode, bgrad strategies, optimizer); the loss-scaler
state; the RNG state; the number of ``metrics.jsonl`` records written up to this position; the best
metric so far; the whole config; the data's preprocessing (``data``: task, feature, class and
target names, normalisation method), so that raw inputs can be scored; and ``sha256``, the
SHA-256 of every array (name, dtype, shape, bytes) and of the rest of the meta, so that neither
can change unnoticed. mlptrain draws random numbers after initialisation only for the data order,
and the order of epoch ``e`` is ``default_rng([data_seed, e]).permutation(N)``, so
``(data_seed, epoch, batch)`` is the whole RNG state.

Writing goes through :func:`mlptrain.base.fs.atomic_write` (a temp file of this writer's own,
fsync, rename, fsync the folder): a crash at any moment leaves the previous checkpoint or the new
one, never a torn file. A training run writes them on a thread of its own (:class:`mlptrain.run.saving.Writer`), so
that the steps go on while a checkpoint is hashed, zipped and synced to disk. Reading checks the
zip's CRCs, the JSON, the format version, the SHA-256 and every meta field's type and range
(:func:`check_meta`), and raises :class:`~mlptrain.base.errors.CheckpointError` naming the file and what
is wrong, whatever the bytes.
"""

from __future__ import annotations

import hashlib
import json
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain import __version__
from mlptrain.base.errors import CheckpointError
from mlptrain.base.fs import atomic_write

FORMAT = "mlptrain-checkpoint"
# 2: the SHA-256 covers the meta too, and the meta is checked against META_SCHEMA. Version 1 files
# (arrays only under the SHA-256) are still read.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
CHECKPOINT_DIR = "checkpoints"
META_KEY = "meta"


@dataclass
class Position:
    """Where a run stands: ``step`` optimizer steps done, next is batch ``batch`` of ``epoch``.

    ``loss_sum``, ``correct`` and ``samples`` are the running sums of the current epoch (its
    ``epoch`` record is their mean), so a run resumed mid-epoch writes the same epoch record.
    """

    epoch: int = 0
    batch: int = 0
    step: int = 0
    loss_sum: float = 0.0
    correct: int = 0
    samples: int = 0

    def describe(self) -> str:
        """Where the run stands, counted from 1 as the epoch lines count: ``epoch 16, after its batch 6``,
        ``after epoch 15`` (a whole epoch done), ``at the start``. The interrupt and the resume say it alike."""
        if self.batch:
            return f"epoch {self.epoch + 1}, after its batch {self.batch}"
        return f"after epoch {self.epoch}" if self.epoch else "at the start"


@dataclass
class Best:
    """The best value of ``metric`` seen at the end of an epoch; ``mode`` ``max`` (accuracy) or ``min`` (loss).

    ``epoch`` and ``step``: where ``best.npz`` was saved, the last epoch that reached ``value`` (a tie
    goes to the later epoch, trained longer: on a small validation split the accuracy moves in steps
    of one row and ties often, and the first of a tie is often an early, worse model, see
    docs/best_selection.md). ``improved``: the last epoch that beat the best by more than
    ``early_stopping.min_delta``; patience counts from it.
    """

    metric: str
    value: float | None = None
    epoch: int | None = None
    step: int | None = None
    mode: str = "max"
    improved: int | None = None

    def improves(self, value: float, min_delta: float = 0.0) -> bool:
        """Whether ``value`` beats the best so far by more than ``min_delta``."""
        if self.value is None:
            return True
        return value > self.value + min_delta if self.mode == "max" else value < self.value - min_delta

    def matches(self, value: float) -> bool:
        """Whether ``value`` is at least as good as the best so far (a tie: ``best.npz`` moves to it)."""
        if self.value is None:
            return True
        return value >= self.value if self.mode == "max" else value <= self.value


@dataclass
class Checkpoint:
    """A checkpoint as read from ``path``: host arrays by entry name, and the meta dict."""

    path: Path
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def position(self) -> Position:
        return Position(**self.meta["position"])

    @property
    def best(self) -> Best | None:
        return Best(**self.meta["best"]) if self.meta.get("best") else None


# --- the meta's schema ------------------------------------------------------------------------

_INT, _NUM, _STR = "int", "number", "str"
_POSITION = {"epoch": _INT, "batch": _INT, "step": _INT, "loss_sum": _NUM, "correct": _INT, "samples": _INT}
_SCALER = {"scale": _NUM, "growth_tracker": _INT, "consecutive_skips": _INT}
_BEST = {
    "metric": _STR,
    "value": (_NUM, None),
    "epoch": (_INT, None),
    "step": (_INT, None),
    "mode": _STR,
    "improved": (_INT, None),
}
# Cross-validation's tracking of each fold (mlptrain.run.folds.Folds.state_dict; its weights: folds/best/<name>)
# and what its folds were dealt from (Folds.deal: absent before it was kept)
_FOLDS = {"epoch": _INT, "best": [_BEST], "stopped": [(_INT, None)], "deal": ({"rows": _INT, "sha256": _STR}, None)}
# Every key a checkpoint's meta holds, with its type: a dict is a nested object of those keys,
# [t] a list of t, a tuple the types allowed (None: null). Counts and positions must be >= 0.
META_SCHEMA: dict[str, Any] = {
    "format": _STR,
    "format_version": _INT,
    "mlptrain": _STR,
    "position": _POSITION,
    "steps_per_epoch": _INT,
    "widths": [_INT],
    "param_dtype": _STR,
    "compute_dtype": _STR,
    "precision": _STR,
    "execution": _STR,
    "bgrad": [_STR],
    "optimizer": _STR,
    # the state's dtype (bfloat16: its arrays are uint16 bits); null or absent (before the setting): param_dtype
    "optimizer_state_dtype": (_STR, None),
    "scaler": (_SCALER, None),
    "rng": {"seed": _INT, "data_seed": _INT},
    "members": _INT,  # an ensemble's member count (ensemble.size); absent in one model's checkpoint: 1
    "folds": (_FOLDS, None),  # ensemble.folds: each fold's best (absent before it was kept, and outside folds)
    "metrics_records": _INT,
    "best": (_BEST, None),
    "config": dict,
    "data": (dict, None),  # the preprocessing of the data (names, task): mlptrain.data.Dataset.preprocessing
    "embedding": (dict, None),  # model.embedding_dim: mlptrain.nn.embedding.ColumnEmbedding.to_meta; absent: none
    "sha256": _STR,
}


def _type_problem(value: Any, spec: Any, key: str) -> str | None:
    """What is wrong with ``value`` against ``spec`` (None if nothing)."""
    if isinstance(spec, tuple):  # one of several types
        problems = [_type_problem(value, s, key) for s in spec]
        return None if None in problems else problems[0]
    if spec is None:
        return None if value is None else f"{key} is {value!r}, expected null"
    if spec is dict:
        return None if isinstance(value, dict) else f"{key} is {type(value).__name__}, expected an object"
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{key} is {type(value).__name__}, expected an object"
        missing, extra = sorted(set(spec) - set(value)), sorted(set(value) - set(spec))
        if missing or extra:
            return f"{key} has {'missing keys ' + ', '.join(missing) if missing else ''}" + (
                f"{'; ' if missing else ''}unknown keys {', '.join(extra)}" if extra else ""
            )
        for k, s in spec.items():
            problem = _type_problem(value[k], s, f"{key}.{k}")
            if problem:
                return problem
        return None
    if isinstance(spec, list):
        if not isinstance(value, list):
            return f"{key} is {type(value).__name__}, expected a list"
        return next((p for i, v in enumerate(value) if (p := _type_problem(v, spec[0], f"{key}[{i}]"))), None)
    ok = {
        _INT: isinstance(value, int) and not isinstance(value, bool) and value >= 0,
        _NUM: isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value),
        _STR: isinstance(value, str),
    }[spec]
    expected = {_INT: "a non-negative integer", _NUM: "a finite number", _STR: "a string"}[spec]
    return None if ok else f"{key} is {value!r}, expected {expected}"


def check_meta(meta: Any, path: Path) -> None:
    """Raise CheckpointError naming the first key of ``meta`` that does not fit :data:`META_SCHEMA`."""
    if isinstance(meta, dict) and "members" not in meta:  # one model (and every checkpoint before ensembles)
        meta = {**meta, "members": 1}
    if isinstance(meta, dict) and "folds" not in meta:  # no cross-validation, or a checkpoint before folds' bests
        meta = {**meta, "folds": None}
    if isinstance(meta, dict) and isinstance(meta["folds"], dict) and "deal" not in meta["folds"]:  # before the deal
        meta = {**meta, "folds": {**meta["folds"], "deal": None}}
    if isinstance(meta, dict) and "optimizer_state_dtype" not in meta:  # a checkpoint before optimizer.state_dtype
        meta = {**meta, "optimizer_state_dtype": None}
    if isinstance(meta, dict) and "embedding" not in meta:  # no embeddings (and every checkpoint before them)
        meta = {**meta, "embedding": None}
    problem = _type_problem(meta, META_SCHEMA, "meta")
    if problem is None:
        pos = Position(**meta["position"])
        if meta["steps_per_epoch"] < 1 or pos.step != pos.epoch * meta["steps_per_epoch"] + pos.batch:
            problem = f"meta.position {meta['position']} does not fit {meta['steps_per_epoch']} batches per epoch"
    if problem:
        raise CheckpointError(f"checkpoint {path} has a damaged meta: {problem}")


# --- the file: atomic write, checked read ------------------------------------------------------


def digest(arrays: dict[str, np.ndarray], meta: dict[str, Any] | None = None) -> str:
    """SHA-256 over every array's name, dtype, shape and bytes, in name order, then the meta's JSON.

    ``meta`` (its ``sha256`` key left out) is hashed as sorted, compact JSON; ``None`` hashes the
    arrays alone (format version 1).
    """
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    if meta is not None:
        rest = {k: v for k, v in meta.items() if k != "sha256"}
        h.update(b"\0meta\0" + json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def save(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Write ``arrays`` and ``meta`` to ``path`` atomically (a temp file of this writer's, fsync, rename).

    ``meta`` gets the format, its version, mlptrain's version and the SHA-256 added.

    Raises:
        CheckpointError: the file cannot be written (the previous ``path`` is left as it was).
    """
    path = Path(path)
    meta = {**meta, "format": FORMAT, "format_version": FORMAT_VERSION, "mlptrain": __version__}
    meta["sha256"] = digest(arrays, meta)
    blob = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    try:
        # a file object: np.savez would append ".npz" to a str path
        atomic_write(path, lambda f: np.savez(f, **arrays, **{META_KEY: blob}))  # type: ignore[arg-type]
    except OSError as exc:
        raise CheckpointError(
            f"cannot write checkpoint {path} ({type(exc).__name__}: {exc}); the previous checkpoint there, if any, "
            "is unchanged; free disk space or choose a writable hydra.run.dir"
        ) from exc


def load(path: Path) -> Checkpoint:
    """Read and verify the checkpoint at ``path``.

    Raises:
        CheckpointError: missing, not a regular file, unreadable, truncated or corrupt, not an
            mlptrain checkpoint, another format version, a SHA-256 that does not match, or a meta
            that does not fit its schema. Never any other exception, whatever the file holds.
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError:
        raise CheckpointError(
            f"checkpoint {path} does not exist" + ("" if path.parent.is_dir() else " (nor its folder)")
        ) from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"checkpoint {path} is not a regular file; give the path of a .npz checkpoint")
    arrays = _read_arrays(path)
    meta = _read_meta(arrays.pop(META_KEY), path)
    version = meta.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"checkpoint {path} has format version {version} (written by mlptrain {meta.get('mlptrain')}); "
            f"this mlptrain {__version__} reads versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    found = digest(arrays, meta if version >= 2 else None)
    if found != meta.get("sha256"):
        what = "arrays and meta" if version >= 2 else "arrays"
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its {what} have SHA-256 {found}, the file says {meta.get('sha256')}"
        )
    if version == 1:  # what version 1 did not record
        meta.setdefault("data", None)
        if isinstance(meta.get("best"), dict):
            meta["best"].setdefault("mode", "max")
    if isinstance(meta.get("best"), dict):  # before best.improved: the best epoch was the last improvement
        meta["best"].setdefault("improved", meta["best"].get("epoch"))
    check_meta(meta, path)
    return Checkpoint(path, arrays, meta)


def _read_arrays(path: Path) -> dict[str, np.ndarray]:
    try:
        npz = np.load(path, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):  # a .npy file: one array, not a checkpoint
            raise ValueError(f"it holds one {type(npz).__name__} (a .npy file), not a zip of arrays")
        with npz:
            arrays = {name: npz[name] for name in npz.files}  # reads every entry: the zip checks its CRC-32
    except Exception as exc:  # whatever the bytes: a zip, npy or pickle error, a header too large
        raise CheckpointError(
            f"checkpoint {path} cannot be read: it is truncated, corrupt or not a checkpoint ({type(exc).__name__}: "
            f"{exc})"
        ) from exc
    if META_KEY not in arrays:
        raise CheckpointError(f"{path} is not an mlptrain checkpoint: it has no {META_KEY!r} entry")
    return arrays


def _read_meta(blob: np.ndarray, path: Path) -> dict[str, Any]:
    if blob.dtype != np.uint8 or blob.ndim != 1:
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its {META_KEY!r} entry is {blob.dtype} {blob.shape}, "
            "expected uint8 bytes of JSON"
        )
    try:
        meta = json.loads(blob.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt: its {META_KEY!r} entry is not JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an mlptrain checkpoint (its meta has no format {FORMAT!r})")
    return meta


def resolve(resume: str, out_dir: Path) -> Path:
    """The file that ``resume=<value>`` names: ``last`` or ``best`` of ``out_dir``, a run directory, or a file.

    Raises:
        CheckpointError: no checkpoint there; the message says how to point at one.
    """
    if resume in ("last", "best"):
        path = Path(out_dir) / CHECKPOINT_DIR / f"{resume}.npz"
        hint = (
            f"resume={resume} looks in this run's directory; with the CLI pass hydra.run.dir=<the run directory to "
            f"continue> resume={resume}, or resume=<path to a .npz checkpoint>"
        )
    else:
        path = Path(resume).expanduser()
        if path.is_dir():
            path = path / CHECKPOINT_DIR / "last.npz"
        hint = "give the path of a .npz checkpoint or of a run directory holding checkpoints/last.npz"
    if not path.exists():
        raise CheckpointError(f"resume={resume!r}: no checkpoint at {path}; {hint}")
    return path
