"""``python -m mlptrain.evaluate ckpt=PATH [data=FILE]``: a checkpoint's scores, without training.

Without ``data``, the checkpoint is scored on a split (``split=test`` by default) of its own
dataset, rebuilt from the config saved in it (the same files and ``split_seed`` give the same
split; a warning says so if the normalisation no longer matches). With ``data=FILE`` it is scored
on that file's rows, which must hold the target column (``predict`` scores files without one).

Writes ``evaluation.json`` into ``output`` (default ``<run dir>/evaluation/<checkpoint>-<split or
file>``): the loss and accuracy, per class the precision, recall, F1 and support, the confusion
matrix (rows: the true class, columns: the predicted one), and their macro averages; a
regression gets the mean squared error overall and per target. ``confusion.png`` shows the
matrix (with the ``plot`` extra, matplotlib). Every file is written atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain import commands
from mlptrain.commands import REQUIRED, arg
from mlptrain.errors import CheckpointError, DatasetError, OutputError
from mlptrain.files import atomic_write
from mlptrain.inference import DEFAULT_BATCH, Predictor
from mlptrain.predict import read_inputs

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")


@dataclass
class EvaluateArgs:
    ckpt: str = arg(REQUIRED, "a checkpoint (.npz), or a run directory (its checkpoints/best.npz)")
    data: str | None = arg(None, "a file of labelled rows to score; null: a split of the checkpoint's own dataset")
    split: str = arg("test", "without data: the split of the checkpoint's dataset (train, val or test)")
    output: str | None = arg(None, "folder for evaluation.json and confusion.png; null: <run dir>/evaluation/...")
    batch_size: int = arg(DEFAULT_BATCH, "rows per batch")
    device: str = arg("auto", "auto (the GPU when there is one), cpu or gpu")
    precision: str | None = arg(None, "GEMM precision; null: the checkpoint's (fp32 on the CPU)")


def classification_report(logits: np.ndarray, y: np.ndarray, names: list[str]) -> dict[str, Any]:
    """Loss, accuracy, per-class precision/recall/F1/support and the confusion matrix of ``logits (N, C)``."""
    z = logits.astype(np.float64)
    zmax = z.max(axis=1, keepdims=True)
    log_p = z - zmax - np.log(np.exp(z - zmax).sum(axis=1, keepdims=True))  # log-softmax, (N, C)
    pred = z.argmax(axis=1)
    c = len(names)
    confusion = np.zeros((c, c), dtype=np.int64)
    np.add.at(confusion, (y, pred), 1)  # rows: true class, columns: predicted
    tp = np.diag(confusion).astype(np.float64)
    predicted, support = confusion.sum(axis=0), confusion.sum(axis=1)
    precision = np.divide(tp, predicted, out=np.zeros(c), where=predicted > 0)
    recall = np.divide(tp, support, out=np.zeros(c), where=support > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros(c), where=precision + recall > 0)
    per_class = {
        name: {"precision": precision[i], "recall": recall[i], "f1": f1[i], "support": int(support[i])}
        for i, name in enumerate(names)
    }
    present = support > 0
    return {
        "samples": int(len(y)),
        "loss": float(-log_p[np.arange(len(y)), y].mean()) if len(y) else float("nan"),
        "acc": float(tp.sum() / max(len(y), 1)),
        "macro": {
            k: float(v[present].mean()) if present.any() else float("nan")
            for k, v in (("precision", precision), ("recall", recall), ("f1", f1))
        },  # fmt: skip
        "per_class": {n: {k: (float(v) if k != "support" else v) for k, v in d.items()} for n, d in per_class.items()},
        "class_names": names,
        "confusion": confusion.tolist(),
    }


def regression_report(outputs: np.ndarray, y: np.ndarray, names: list[str]) -> dict[str, Any]:
    """Mean squared error per target and over them; a target whose column is all NaN (absent from the
    file) is left out."""
    err = outputs.astype(np.float64) - y.astype(np.float64)  # (N, T)
    present = np.asarray(~np.isnan(err).all(axis=0))  # (T,) bool
    mse = np.nanmean(err[:, present] ** 2, axis=0) if len(y) else np.full(int(present.sum()), np.nan)
    scored = [n for n, ok in zip(names, present.tolist(), strict=True) if ok]
    return {"samples": int(len(y)), "loss": float(mse.mean()), "mse": dict(zip(scored, map(float, mse), strict=True))}


def _own_split(p: Predictor, split: str) -> tuple[np.ndarray, np.ndarray, str]:
    """The rows of ``split`` of the checkpoint's dataset, normalised by the dataset (the check compares),
    and their labels or targets (a regression's in the targets' units)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from mlptrain.config import DataConfig
    from mlptrain.data import load_dataset

    if split not in SPLITS:
        raise DatasetError(f"split={split!r}; expected one of {', '.join(SPLITS)}")
    saved = (p.meta.get("config") or {}).get("data")
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), saved or {}))
    except OmegaConfBaseException as exc:
        raise CheckpointError(f"checkpoint {p.path}: its data config cannot be read ({exc}); use data=FILE") from exc
    ds = load_dataset(cfg)  # type: ignore[arg-type]
    norm = ds.normalization
    if norm is not None and not (np.array_equal(norm.shift, p.shift) and np.array_equal(norm.scale, p.scale)):
        log.warning("the dataset is normalised differently than when %s was saved (the data changed)", p.path.name)
    source = ds.name
    if ds.name == "file":  # the file the split came from
        source = Path(cfg.test_path if split == "test" and cfg.test_path else cfg.path).name  # type: ignore[union-attr]
    y = getattr(ds, f"y_{split}")
    if ds.target_scaling is not None:  # a regression: the targets in their own units, as the model's outputs are
        y = ds.target_scaling.undo(y)
    return getattr(ds, f"x_{split}"), y, f"{split} split of {source}"


def evaluate(args: EvaluateArgs) -> tuple[dict[str, Any], Path]:
    """Score the checkpoint; returns the report and the folder it belongs in."""
    p = Predictor(args.ckpt, device=args.device, precision=args.precision, batch_size=args.batch_size)
    log.info("%s", p.describe())
    if args.data is None:
        x, y, what = _own_split(p, args.split)
        logits = p.logits(x, normalised=True)
        stem = args.split
    else:
        path = Path(args.data).expanduser()
        x, y_read, _ = read_inputs(p, path)
        if y_read is None:
            raise DatasetError(
                f"data={path} has no target column {', '.join(map(repr, p.target_columns))}; evaluation needs the "
                "true labels (python -m mlptrain.predict scores a file without them)"
            )
        # the file's whole name and a digest of where it is: other files never share a folder
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
        y, what, stem = y_read, f"file {path}", f"{path.name}-{digest}"
        logits = p.logits(x)
    if p.classification:
        report = classification_report(logits, np.asarray(y), p.class_name(np.arange(p.num_outputs)))
    else:
        report = regression_report(logits, np.asarray(y), p.target_names or [f"y{i}" for i in range(p.num_outputs)])
    report = {"checkpoint": str(p.path), "data": what, "task": p.task, **report}
    run_dir = p.path.parent.parent if p.path.parent.name == "checkpoints" else p.path.parent
    folder = Path(args.output).expanduser() if args.output else run_dir / "evaluation" / f"{p.path.stem}-{stem}"
    return report, folder


def write_report(report: dict[str, Any], folder: Path) -> list[Path]:
    """``evaluation.json`` (and ``confusion.png`` where matplotlib is installed) in ``folder``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        written = [folder / "evaluation.json"]
        atomic_write(written[0], json.dumps(report, indent=1) + "\n")
    except OSError as exc:
        hint = "choose output=<a writable folder>"
        raise OutputError(f"cannot write the evaluation into {folder} ({exc}); {hint}") from exc
    if "confusion" in report:
        from mlptrain.plot import confusion_figure

        title = f"{Path(report['checkpoint']).name} on the {report['data']}: acc {report['acc']:.4f}"
        png = confusion_figure(np.array(report["confusion"]), report["class_names"], folder / "confusion.png", title)
        written += [png] if png else []
    return written


def run(args: EvaluateArgs) -> int:
    report, folder = evaluate(args)
    written = write_report(report, folder)
    scores = f"loss {report['loss']:.4f}" + (f" acc {report['acc']:.4f}" if "acc" in report else "")
    print(f"{Path(report['checkpoint']).name} on the {report['data']} ({report['samples']:,} rows): {scores} -> "
          f"{', '.join(map(str, written))}")  # fmt: skip
    return 0


ABOUT = "Score a trained mlptrain checkpoint on its test split or a labelled file: evaluation.json, confusion.png."


def main(argv: list[str] | None = None) -> int:
    return commands.main(EvaluateArgs, "mlptrain.evaluate", ABOUT, run, argv)


if __name__ == "__main__":
    sys.exit(main())
