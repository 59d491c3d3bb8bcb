"""Checkpoints: one ``.npz`` file each, written atomically, read back with every check.

A checkpoint is ``<run dir>/checkpoints/last.npz`` (the latest state) or ``best.npz`` (the epoch
with the best validation accuracy), an uncompressed NumPy zip that is read with
``allow_pickle=False``:

========================= ============================================================
entry                     contents
========================= ============================================================
``param/<name>``          master copy of each parameter (``layer0.weight`` ...), param dtype
``optim/<name>/<state>``  optimizer state (``momentum``, ``exp_avg``, ``exp_avg_sq``)
``optim/t``               the optimizer's count of applied steps, float64, 0-d
``meta``                  UTF-8 JSON as a uint8 array (below)
========================= ============================================================

``meta`` holds the format version and mlptrain version; the position in the data order
(``step``, ``epoch``, ``batch``: the next batch of that epoch, and the epoch's running sums);
the model (``widths``, dtypes, precision, execution mode, optimizer); the loss-scaler state;
the RNG state; the number of ``metrics.jsonl`` records written up to this position; the best
metric so far; the whole config; and the SHA-256 of the arrays. mlptrain draws random numbers
after initialisation only for the data order, and the order of epoch ``e`` is
``default_rng([data_seed, e]).permutation(N)``, so ``(data_seed, epoch, batch)`` is the whole RNG
state.

Writing goes to ``<name>.npz.tmp`` through an open file (``np.savez`` appends ``.npz`` to a
string path), which is flushed and fsynced, renamed over ``<name>.npz`` with :func:`os.replace`,
and the folder is fsynced: a crash at any moment leaves the previous checkpoint or the new one,
never a torn file. Reading checks the zip's CRCs, the JSON, the format version and the
arrays' SHA-256, and raises :class:`~mlptrain.errors.CheckpointError` naming the file and what
is wrong. :func:`restore` then checks that the checkpoint fits the model being trained.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mlptrain import __version__
from mlptrain.config import flatten, to_plain
from mlptrain.errors import CheckpointError, MlptrainError

if TYPE_CHECKING:
    from mlptrain.train import Trainer

log = logging.getLogger(__name__)

FORMAT = "mlptrain-checkpoint"
FORMAT_VERSION = 1
CHECKPOINT_DIR = "checkpoints"
META_KEY = "meta"
# What restore() reads from a checkpoint's meta.
_TRAINER_META = (
    "position",
    "steps_per_epoch",
    "widths",
    "param_dtype",
    "precision",
    "optimizer",
    "scaler",
    "metrics_records",
    "config",
)
# Config keys that may differ on resume without changing the numbers of the run.
_COSMETIC_KEYS = ("resume", "progress", "log_every", "checkpoint_every", "checkpoint_steps")


class OutputError(MlptrainError, OSError):
    """The run directory cannot be written, or holds a run that would be overwritten."""


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


@dataclass
class Best:
    """The best value of ``metric`` (higher is better) seen at the end of an epoch."""

    metric: str
    value: float | None = None
    epoch: int | None = None
    step: int | None = None

    def improves(self, value: float) -> bool:
        return self.value is None or value > self.value


@dataclass
class Checkpoint:
    """A checkpoint as read from ``path``: host arrays by entry name, and the meta dict."""

    path: Path
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def position(self) -> Position:
        return Position(**self.meta["position"])


# --- the file: atomic write, checked read ------------------------------------------------


def digest(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over every array's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def save(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Write ``arrays`` and ``meta`` to ``path`` atomically (tmp file, fsync, rename, fsync dir).

    Raises:
        CheckpointError: the file cannot be written (the previous ``path`` is left as it was).
    """
    path = Path(path)
    meta = {**meta, "sha256": digest(arrays)}
    blob = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to a str path
            np.savez(f, **arrays, **{META_KEY: blob})  # type: ignore[arg-type]  # (numpy's stubs type **kwds badly)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        raise CheckpointError(
            f"cannot write checkpoint {path} ({type(exc).__name__}: {exc}); the previous checkpoint there, if any, "
            "is unchanged; free disk space or choose a writable hydra.run.dir"
        ) from exc
    finally:
        tmp.unlink(missing_ok=True)  # only left behind by a failure


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that refuse fsync on folders
        pass
    finally:
        os.close(fd)


def load(path: Path) -> Checkpoint:
    """Read and verify the checkpoint at ``path``.

    Raises:
        CheckpointError: missing, unreadable, truncated or corrupt file, not an mlptrain
            checkpoint, a newer format, or arrays that fail their SHA-256.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path} does not exist" + ("" if path.parent.is_dir() else " (nor its folder)")
        )
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}  # reads every entry: the zip checks its CRC-32
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise CheckpointError(
            f"checkpoint {path} cannot be read: it is truncated, corrupt or not a checkpoint ({type(exc).__name__}: "
            f"{exc})"
        ) from exc
    if META_KEY not in arrays:
        raise CheckpointError(f"{path} is not an mlptrain checkpoint: it has no {META_KEY!r} entry")
    try:
        meta = json.loads(arrays.pop(META_KEY).tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt: its {META_KEY!r} entry is not JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an mlptrain checkpoint (its meta has no format {FORMAT!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {meta.get('format_version')} (written by mlptrain "
            f"{meta.get('mlptrain')}); this mlptrain {__version__} reads version {FORMAT_VERSION}"
        )
    found = digest(arrays)
    if found != meta.get("sha256"):
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its arrays have SHA-256 {found}, meta says {meta.get('sha256')}"
        )
    return Checkpoint(path, arrays, meta)


def resolve(resume: str, out_dir: Path) -> Path:
    """The file that ``resume=<value>`` names: ``last`` or ``best`` of ``out_dir``, a run directory, or a file.

    Raises:
        CheckpointError: no checkpoint there; the message says how to point at one. A run is
            never started fresh in place of a missing checkpoint.
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
    if not path.is_file():
        raise CheckpointError(f"resume={resume!r}: no checkpoint at {path}; {hint}")
    return path


# --- a Trainer's state --------------------------------------------------------------------


def capture(tr: Trainer, pos: Position, *, metrics_records: int, best: Best) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and meta of ``tr`` at ``pos`` (copies them to the host: syncs the device)."""
    to_host = tr.backend.to_host
    arrays = {f"param/{p.name}": to_host(p.value) for p in tr.model.params}
    arrays.update({f"optim/{k}": np.asarray(v) for k, v in tr.optimizer.state_dict().items()})
    cfg = tr.cfg
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mlptrain": __version__,
        "position": pos.__dict__,
        "steps_per_epoch": tr.steps_per_epoch,
        "widths": tr.widths,
        "param_dtype": np.dtype(tr.precision.param_dtype).name,
        "compute_dtype": np.dtype(tr.precision.compute_dtype).name,
        "precision": tr.precision.name,
        "execution": cfg.execution.mode.value,
        "bgrad": tr.model.bgrad,
        "optimizer": cfg.optimizer.name.value,
        "scaler": tr.scaler.state_dict() if tr.scaler.enabled else None,
        "rng": {"seed": cfg.seed, "data_seed": tr.train_loader.seed},
        "metrics_records": metrics_records,
        "best": best.__dict__,
        "config": to_plain(cfg),
    }
    return arrays, meta


def restore(tr: Trainer, ckpt: Checkpoint) -> tuple[Position, Best | None]:
    """Load ``ckpt`` into ``tr`` after checking that it fits; return its position and best metric.

    Raises:
        CheckpointError: another architecture, parameter dtype or optimizer, missing or
            misshapen arrays, or a position that does not fit this run's batches per epoch.
    """
    m, where = ckpt.meta, f"checkpoint {ckpt.path}"
    missing = [k for k in _TRAINER_META if k not in m]
    if missing:
        raise CheckpointError(f"{where} is incomplete: its meta lacks {', '.join(missing)}")
    if m["widths"] != tr.widths:
        raise CheckpointError(
            f"{where} is for model {_w(m['widths'])} but this run builds {_w(tr.widths)}; "
            f"resume with model.hidden={m['widths'][1:-1]} or start a new run"
        )
    want_dtype = np.dtype(tr.precision.param_dtype).name
    if m["param_dtype"] != want_dtype:
        raise CheckpointError(
            f"{where} holds {m['param_dtype']} parameters (precision={m['precision']}) but this run uses "
            f"precision={tr.precision.name} with {want_dtype} parameters; resume with precision={m['precision']}"
        )
    if m["optimizer"] != tr.cfg.optimizer.name.value:
        raise CheckpointError(
            f"{where} holds {m['optimizer']} optimizer state but this run uses "
            f"optimizer={tr.cfg.optimizer.name.value}; resume with optimizer={m['optimizer']}"
        )
    expected = {f"param/{p.name}": (tuple(p.value.shape), want_dtype) for p in tr.model.params}
    expected.update({f"optim/{k}": (tuple(v.shape), None) for k, v in tr.optimizer.state_dict().items()})
    for key, (shape, dtype) in expected.items():
        a = ckpt.arrays.get(key)
        if a is None:
            raise CheckpointError(f"{where} has no {key!r} (optimizer settings such as momentum changed?)")
        if a.shape != shape or (dtype is not None and a.dtype.name != dtype):
            raise CheckpointError(
                f"{where}: {key!r} is {a.dtype.name}{list(a.shape)}, expected {dtype or a.dtype.name}{list(shape)}"
            )
    extra = sorted(set(ckpt.arrays) - set(expected))
    if extra:
        raise CheckpointError(
            f"{where} has state this run does not use: {', '.join(extra)} (optimizer settings changed?)"
        )
    pos = ckpt.position
    spe = tr.steps_per_epoch
    if m["steps_per_epoch"] != spe or not 0 <= pos.batch <= spe or pos.step != pos.epoch * spe + pos.batch:
        raise CheckpointError(
            f"{where} stands at epoch {pos.epoch}, batch {pos.batch}, step {pos.step} of {m['steps_per_epoch']} "
            f"batches per epoch, but this run has {spe} (data.batch_size={tr.cfg.data.batch_size}, the checkpoint's "
            f"{m['config']['data']['batch_size']}); resume with the checkpoint's data settings"
        )
    _warn_differences(m["config"], to_plain(tr.cfg), where)

    xp = tr.xp
    for p in tr.model.params:
        p.value[...] = xp.asarray(ckpt.arrays[f"param/{p.name}"])
        p.sync_compute()
    tr.optimizer.load_state_dict({k[len("optim/") :]: v for k, v in ckpt.arrays.items() if k.startswith("optim/")})
    if tr.scaler.enabled and m["scaler"] is not None:
        tr.scaler.load_state_dict(m["scaler"])
    tr.set_step(pos.step)
    if m.get("bgrad") and m["bgrad"] != tr.model.bgrad:
        # The strategies round differently: continue with the one the run was trained with.
        log.info("%s: using the checkpoint's bgrad strategies %s", where, m["bgrad"])
        tr.model.set_bgrad(m["bgrad"])
    best = Best(**m["best"]) if m.get("best") else None
    return pos, best


def _w(widths: list[int]) -> str:
    return "-".join(map(str, widths))


def _warn_differences(saved: dict[str, Any], now: dict[str, Any], where: str) -> None:
    """Log every setting that differs from the checkpoint's: the run will not match an uninterrupted one."""
    a, b = flatten(saved), flatten(now)
    keys = sorted((set(a) | set(b)) - set(_COSMETIC_KEYS))
    diff = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]
    if diff:
        log.warning(
            "resuming from %s with settings that differ from its run (%s); the result may differ from an "
            "uninterrupted run's",
            where,
            "; ".join(diff),
        )


# --- the run directory: never overwrite what a run wrote ----------------------------------


def refuse_overwrite(out_dir: Path, *, hint: str) -> None:
    """Raise OutputError if ``out_dir`` holds a run's metrics or checkpoints (a new run would overwrite them)."""
    out_dir = Path(out_dir)
    metrics = out_dir / "metrics.jsonl"
    found = ["metrics.jsonl"] if metrics.is_file() and metrics.stat().st_size > 0 else []
    found += [f"{CHECKPOINT_DIR}/{p.name}" for p in sorted((out_dir / CHECKPOINT_DIR).glob("*.npz"))]
    if found:
        raise OutputError(
            f"output directory {out_dir} already holds a run ({', '.join(found)}); {hint}, or choose a new "
            "hydra.run.dir (nothing was changed)"
        )


def refuse_rollback(path: Path, pos: Position) -> None:
    """Raise CheckpointError if resuming from ``path`` would overwrite a newer ``last.npz`` beside it."""
    last = Path(path).parent / "last.npz"
    if Path(path).resolve() == last.resolve() or not last.is_file():
        return
    try:
        newer = load(last).position.step
    except CheckpointError:
        return  # an unreadable last.npz holds nothing to protect
    if newer > pos.step:
        raise CheckpointError(
            f"resuming from {path} (step {pos.step}) in its own run directory would overwrite {last} (step {newer}) "
            f"and the metrics after step {pos.step}; resume into a new directory instead: hydra.run.dir=<new "
            f"directory> resume={path}"
        )


def keep_metrics_prefix(path: Path, records: int, *, source: Path | None = None) -> int:
    """Make ``path`` hold exactly the first ``records`` records of ``source`` (default: ``path`` itself).

    Resuming truncates ``metrics.jsonl`` to the records written up to the checkpoint (the rest
    are written again, identically), so the file matches an uninterrupted run's. Written
    atomically; a torn last line (a killed run) is not a record. Returns the number of records
    kept, fewer than ``records`` when the source has fewer (logged).

    Raises:
        OutputError: the file cannot be written.
    """
    path = Path(path)
    source = path if source is None else Path(source)
    kept: list[str] = []
    if records > 0 and source.is_file():
        for line in source.read_text(encoding="utf-8").splitlines(keepends=True):
            if len(kept) == records or not line.endswith("\n"):
                break
            try:
                json.loads(line)
            except json.JSONDecodeError:
                break
            kept.append(line)
    if len(kept) < records:
        log.warning(
            "%s holds %d of the %d records before the checkpoint; continuing after them", source, len(kept), records
        )
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise OutputError(
            f"cannot write {path} ({type(exc).__name__}: {exc}); choose a writable hydra.run.dir"
        ) from exc
    finally:
        tmp.unlink(missing_ok=True)
    return len(kept)
