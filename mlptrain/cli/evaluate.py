"""``python -m mlptrain.evaluate ckpt=PATH [data=FILE]``: a checkpoint's scores, without training.

Without ``data``, the checkpoint is scored on a split (``split=test`` by default) of its own
dataset, rebuilt from the config saved in it (the same files and ``split_seed`` give the same
split; a warning says so if the normalisation no longer matches). With ``data=FILE`` it is scored
on that file's rows, which must hold the target column: ``target=COLUMN`` (default: the column the
checkpoint was trained on, ``data.target`` of its config, else ``label``; a regression's, comma-separated,
in the model's order), with a value on every row (``predict`` scores files without one).

Writes ``evaluation.json`` into ``output`` (default ``<run dir>/evaluation/<checkpoint>-<split or
file>``): the loss (the log loss), accuracy, balanced accuracy and, for two classes, ROC AUC (of class
1), per class (by name) the precision, recall, F1 and support, their macro averages and the confusion
matrix (rows: the true class, columns: the predicted one); a regression gets the mean squared error,
RMSE, MAE and R² overall (the mean over the targets) and per target, in the targets' units. The
scores are :mod:`mlptrain.nn.scores`', as a run's ``metrics.jsonl`` has them. ``confusion.png`` shows the
matrix (with the ``plot`` extra, matplotlib). The two are written as one unit once the work is
done (:func:`mlptrain.inference.outputs.write_together`): the figure is drawn first, then the figure and the
report are renamed into place together, the report last, recording the figure's SHA-256 (``figure``).
An interrupt or a failure leaves both earlier files as they were. Neither replaces an input, a
checkpoint or a file of another kind (``overwrite=true`` replaces the latter).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.base.errors import CheckpointError, ConfigError, DatasetError, OutputError
from mlptrain.cli import commands
from mlptrain.cli.commands import REQUIRED, arg
from mlptrain.cli.predict import read_inputs
from mlptrain.inference import outputs
from mlptrain.inference.predictor import DEFAULT_BATCH, Predictor
from mlptrain.nn import scores
from mlptrain.run.checkpoint import CHECKPOINT_DIR

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
REPORT, FIGURE = "evaluation.json", "confusion.png"


@dataclass
class EvaluateArgs:
    ckpt: str = arg(REQUIRED, "a checkpoint (.npz), or a run directory (its checkpoints/best.npz)")
    data: str | None = arg(None, "a file of labelled rows to score; null: a split of the checkpoint's own dataset")
    target: str | None = arg(None, "with data: the column of the true labels; null: the checkpoint's (else label)")
    split: str = arg("test", "without data: the split of the checkpoint's dataset (train, val or test)")
    output: str | None = arg(None, "folder for evaluation.json and confusion.png; null: <run dir>/evaluation/...")
    batch_size: int = arg(DEFAULT_BATCH, "rows per batch")
    device: str = arg("auto", "auto (the GPU when there is one), cpu or gpu")
    precision: str | None = arg(None, "GEMM precision; null: the checkpoint's (fp32 on the CPU)")
    overwrite: bool = arg(False, "replace an evaluation.json or confusion.png that is not one (never an input)")


def classification_report(logits: np.ndarray, y: np.ndarray, names: list[str]) -> dict[str, Any]:
    """Loss (the log loss), accuracy, balanced accuracy, ROC AUC (two classes), per-class precision/recall/F1/
    support, their macro averages and the confusion matrix of ``logits (N, C)`` (:mod:`mlptrain.nn.scores`)."""
    z = logits.astype(np.float64)
    zmax = z.max(axis=1, keepdims=True)
    log_p = z - zmax - np.log(np.exp(z - zmax).sum(axis=1, keepdims=True))  # log-softmax, (N, C)
    pred = z.argmax(axis=1)
    c = len(names)
    confusion = np.zeros((c, c), dtype=np.int64)
    np.add.at(confusion, (y, pred), 1)  # rows: true class, columns: predicted
    loss = float(-log_p[np.arange(len(y)), y].mean()) if len(y) else float("nan")
    binary = np.stack([z[:, 1] - z[:, 0], y]) if c == 2 else None  # class 1's margin, the label
    found = scores.classification_scores(confusion, loss, binary)
    pc = scores.per_class(confusion)
    per_class = {
        name: {**{k: float(pc[k][i]) for k in ("precision", "recall", "f1")}, "support": int(pc["support"][i])}
        for i, name in enumerate(names)
    }
    return {
        "samples": int(len(y)),
        "loss": loss,
        "acc": float(np.trace(confusion) / max(len(y), 1)),
        **{k: found[k] for k in ("balanced_acc", "log_loss", "roc_auc") if k in found},
        "macro": {k: found[f"{k}_macro"] for k in ("precision", "recall", "f1")},
        "per_class": per_class,
        "class_names": names,
        "confusion": confusion.tolist(),
    }


def regression_report(outputs: np.ndarray, y: np.ndarray, names: list[str]) -> dict[str, Any]:
    """Mean squared error, RMSE, MAE and R² per target and over them (the mean over the targets), in the targets'
    units; a target whose column is all NaN (absent from the file) is left out, a row whose target is NaN too."""
    z, t = outputs.astype(np.float64), y.astype(np.float64)  # (N, T)
    per_target: dict[str, dict[str, float]] = {}
    for j, name in enumerate(names):
        rows = ~np.isnan(t[:, j]) if len(t) else np.zeros(0, bool)
        if len(t) and not rows.any():
            continue
        centre = float(t[rows, j].mean()) if rows.any() else 0.0  # centred: the sum of squares keeps its digits
        sums = scores.regression_sums(z[rows, j : j + 1] - centre, t[rows, j : j + 1] - centre)
        found = scores.regression_scores(sums, int(rows.sum()))
        per_target[name] = {"mse": found["rmse"] ** 2, **found}
    mean = {k: float(np.mean([v[k] for v in per_target.values()])) for k in ("mse", "mae", "r2")}
    return {
        "samples": int(len(y)),
        "loss": mean["mse"],
        "rmse": float(np.sqrt(mean["mse"])),
        "mae": mean["mae"],
        "r2": mean["r2"],
        "mse": {k: v["mse"] for k, v in per_target.items()},
        "per_target": per_target,
    }


def _own_split(p: Predictor, split: str) -> tuple[np.ndarray, np.ndarray, str]:
    """The rows of ``split`` of the checkpoint's dataset, normalised by the dataset (the check compares),
    and their labels or targets (a regression's in the targets' units)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from mlptrain.config.schema import DataConfig, Task
    from mlptrain.data import load_dataset
    from mlptrain.run.restore import literal

    if split not in SPLITS:
        raise DatasetError(f"split={split!r}; expected one of {', '.join(SPLITS)}")
    folds = ((p.meta.get("config") or {}).get("ensemble") or {}).get("folds") or 0
    if folds and split == "val":  # its validation rows joined the pool: K - 1 of the K members trained on each
        raise ConfigError(
            f"split=val of a cross-validation (ensemble.folds={folds}): its rows trained {folds - 1} of the {folds} "
            "fold models, so their score is no validation; the out-of-fold scores are the run's folds.json and "
            "oof_predictions.csv, and split=test (the default) scores rows no fold saw"
        )
    saved = (p.meta.get("config") or {}).get("data") or {}
    unknown = [k for k in saved if k not in {f.name for f in fields(DataConfig)}]
    if unknown:  # a checkpoint of another mlptrain version, or edited
        raise CheckpointError(
            f"checkpoint {p.path}: its data config has the key data.{unknown[0]}, which this mlptrain does not know; "
            "pass data=<a labelled file> to score the model on it"
        )
    try:  # literal: a stored config's values are resolved already; a ${...} in one is text (mlptrain.run.restore)
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), literal(saved)))
    except OmegaConfBaseException as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {p.path}: its data config cannot be read ({first}); use data=FILE") from exc
    if cfg.name == "file" and not cfg.path:  # type: ignore[union-attr]  # fitted from Python (mlptrain.sklearn)
        raise DatasetError(f"checkpoint {p.path} records no data file to split; pass data=<a labelled file>")
    if str(getattr(cfg.task, "value", cfg.task)) == "auto":  # type: ignore[union-attr]  # the task it was trained as
        cfg.task = Task(p.task)  # type: ignore[union-attr]  # (a regression loss makes whole numbers a regression)
    ds = load_dataset(cfg)  # type: ignore[arg-type]
    norm = ds.normalization
    saved = p.normalization.arrays()
    if norm is not None and not all(k in saved and np.array_equal(a, saved[k]) for k, a in norm.arrays().items()):
        log.warning("the dataset is normalised differently than when %s was saved (the data changed)", p.path.name)
    source = ds.name
    if ds.name == "file":  # the file the split came from
        source = Path(cfg.test_path if split == "test" and cfg.test_path else cfg.path).name  # type: ignore[union-attr]
    y = getattr(ds, f"y_{split}")
    if ds.target_scaling is not None:  # a regression: the targets in their own units, as the model's outputs are
        y = ds.target_scaling.undo(y)
    return getattr(ds, f"x_{split}"), y, f"{split} split of {source}"


def evaluate(args: EvaluateArgs, p: Predictor | None = None) -> tuple[dict[str, Any], Path]:
    """Score the checkpoint (``p``, loaded from ``args.ckpt`` if not given); returns the report and its folder."""
    p = p or Predictor(args.ckpt, device=args.device, precision=args.precision, batch_size=args.batch_size)
    log.info("%s", p.describe())
    if args.data is None:
        if args.target is not None:
            raise ConfigError(f"target={args.target} names a column of data=FILE; pass data=<a labelled file> with it")
        x, y, what = _own_split(p, args.split)
        logits = p.logits(x, normalised=True)
    else:
        path = Path(args.data).expanduser()
        x, y_read, _ = read_inputs(p, path, target=args.target, setting="data", need_targets=True)
        assert y_read is not None  # need_targets: read_inputs raised otherwise
        y, what = y_read, f"file {path}"
        logits = p.logits(x)
    if p.classification:
        report = classification_report(logits, np.asarray(y), p.class_name(np.arange(p.num_outputs)))
    else:
        report = regression_report(logits, np.asarray(y), p.target_names or [f"y{i}" for i in range(p.num_outputs)])
    report = {"checkpoint": str(p.path), "data": what, "task": p.task, **report}
    return report, output_folder(p, args)


def output_folder(p: Predictor, args: EvaluateArgs) -> Path:
    """``output``, or ``<run dir>/evaluation/<checkpoint>-<split>`` (``-<file name>-<digest of its path>``)."""
    if args.output:
        return Path(args.output).expanduser()
    stem = args.split
    if args.data is not None:  # the file's whole name and a digest of where it is: other files never share a folder
        path = Path(args.data).expanduser()
        stem = f"{path.name}-{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]}"
    run_dir = p.path.parent.parent if p.path.parent.name == CHECKPOINT_DIR else p.path.parent
    return run_dir / "evaluation" / f"{p.path.stem}-{stem}"


def check_outputs(p: Predictor, args: EvaluateArgs, folder: Path) -> None:
    """Refuse the report's folder before any work: the rules of :func:`mlptrain.inference.outputs.check_output`."""
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"output={folder} is a file; expected a folder for {REPORT} and {FIGURE}")
    inputs = {"the checkpoint": p.path, **({"the data file": Path(args.data).expanduser()} if args.data else {})}
    for name, kind, same_kind in ((REPORT, "an evaluation report", _is_report), (FIGURE, "a PNG image", _is_png)):
        outputs.check_output(folder / name, inputs=inputs, kind=kind, same_kind=same_kind, overwrite=args.overwrite)


def _is_report(path: Path) -> bool:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(report, dict) and {"checkpoint", "data", "task"} <= set(report)


def _is_png(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == b"\x89PNG\r\n\x1a\n"
    except OSError:
        return False


def write_report(report: dict[str, Any], folder: Path) -> list[Path]:
    """``evaluation.json`` (and ``confusion.png`` where matplotlib is installed) in ``folder``, as one unit.

    The figure is drawn before anything is written; the report names the figure's SHA-256 (``figure``),
    so that a reader can tell the two belong together.
    """
    png = None
    if "confusion" in report:
        from mlptrain.cli.plot import confusion_png

        title = f"{Path(report['checkpoint']).name} on the {report['data']}: acc {report['acc']:.4f}"
        png = confusion_png(np.array(report["confusion"]), report["class_names"], title)
    figure = {"file": FIGURE, "sha256": hashlib.sha256(png).hexdigest()} if png else None
    items: list[tuple[Path, outputs.Content]] = [(folder / FIGURE, png)] if png else []
    items.append((folder / REPORT, json.dumps({**report, "figure": figure}, indent=1) + "\n"))  # the report last
    try:
        folder.mkdir(parents=True, exist_ok=True)
        outputs.write_together(items)
    except OSError as exc:
        hint = "choose output=<a writable folder>"
        raise OutputError(f"cannot write the evaluation into {folder} ({exc}); {hint}") from exc
    return [path for path, _ in reversed(items)]


def run(args: EvaluateArgs) -> int:
    p = Predictor(args.ckpt, device=args.device, precision=args.precision, batch_size=args.batch_size)
    folder = output_folder(p, args)
    check_outputs(p, args, folder)
    outputs.prepare([folder / REPORT, folder / FIGURE])
    report, _ = evaluate(args, p)
    written = write_report(report, folder)
    if "acc" in report:
        found = f"loss {report['loss']:.4f} acc {report['acc']:.4f} balanced {report['balanced_acc']:.4f}"
    else:
        found = f"loss {report['loss']:.4f} rmse {report['rmse']:.4g} r2 {report['r2']:.4f}"
    print(
        f"{Path(report['checkpoint']).name} on the {report['data']} ({report['samples']:,} rows): {found} -> "
        f"{', '.join(map(str, written))}"
    )
    return 0


ABOUT = "Score a trained mlptrain checkpoint on its test split or a labelled file: evaluation.json, confusion.png."


def main(argv: list[str] | None = None) -> int:
    return commands.main(EvaluateArgs, "mlptrain.evaluate", ABOUT, run, argv)


if __name__ == "__main__":
    sys.exit(main())
