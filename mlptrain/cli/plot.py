"""Figures: the curves of a run or a sweep, and a confusion matrix (matplotlib, the ``plot`` extra).

``python -m mlptrain.plot RUN_OR_SWEEP [--out FILE]`` (also ``scripts/plot.py`` in a source checkout)
draws ``curves.png``: the training loss per step and, per epoch, the validation and test loss and
accuracy, one line per run. Given a run directory it draws that run; given a sweep folder (a
multirun), every job in it, labelled by the overrides that differ between the jobs. A run that is
still going is drawn as far as it got.

A run of many models (``ensemble.size``, ``ensemble.folds``, ``ensemble.lr``: docs/ensembles.md) has each
member's validation and test scores in its records (``member<k>/val/loss``): they are drawn as thin lines
beside the ensemble's (for folds, the out-of-fold scores), so that a member that lags or stopped early is
seen. One such run labels each member (its fold, and its learning rate or weight decay where the members'
differ) up to :data:`MEMBER_LABELS` members; in a sweep's figure they take their run's colour, unlabelled.

``--out`` names an image: a ``.png``, ``.svg`` or ``.pdf`` file (drawn in that format). It never
replaces an input of the figure (a run's ``metrics.jsonl`` or overrides), a checkpoint, or an existing
file that is not an image (:func:`check_out`): a data file, a log, a run's records stay as they were.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.base.errors import OutputError
from mlptrain.base.fs import atomic_write
from mlptrain.inference import outputs
from mlptrain.run.metrics import read_metrics
from mlptrain.run.rundir import FOLDS_REPORT, RUN_RECORD

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
MEMBER_LABELS = 10  # members of one run labelled one by one; more are one legend entry
IMAGE_SUFFIXES = (".png", ".svg", ".pdf")
# The first bytes of each format (an SVG written by matplotlib starts with its XML declaration).
_MAGIC = {".png": (b"\x89PNG\r\n\x1a\n",), ".pdf": (b"%PDF-",), ".svg": (b"<?xml", b"<svg")}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # headless, whatever the environment says
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any, fmt: str = "png") -> bytes:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=120, bbox_inches="tight")
    return buf.getvalue()


def _save(fig: Any, path: Path) -> None:
    try:
        atomic_write(path, _png(fig, path.suffix.lower().lstrip(".")))
    except OSError as exc:
        raise OutputError(f"cannot write {path} ({exc})") from exc


def is_image(path: Path) -> bool:
    """Whether ``path`` starts as a PNG, PDF or SVG file does (what ``--out`` may replace)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64).lstrip()
    except OSError:
        return False
    return any(head.startswith(m) for magics in _MAGIC.values() for m in magics)


def check_out(out: Path, runs: list[Path]) -> None:
    """Refuse ``--out`` before drawing: not an image name, an input of the figure, a checkpoint, or an
    existing file that is not an image (:func:`mlptrain.inference.outputs.check_output`).

    Raises:
        OutputError: one sentence naming ``out`` and what was expected.
    """
    if out.suffix.lower() not in IMAGE_SUFFIXES:
        raise OutputError(
            f"--out={out}: expected the name of an image file ending in .png, .svg or .pdf (plot writes an image "
            "only, never over a data file, a checkpoint or a run's records)"
        )
    inputs = {}
    for run in runs:  # what the figure reads
        inputs[f"the metrics of the run {run}:"] = run / METRICS
        inputs[f"the overrides of the run {run}:"] = run / ".hydra" / "overrides.yaml"
    # overwrite=True: the rule on files of another kind is this command's own (plot has no overwrite=)
    outputs.check_output(out, inputs=inputs, kind="an image", same_kind=is_image, overwrite=True, key="--out")
    real = out.resolve()
    if real.is_file() and real.stat().st_size and not is_image(real):
        raise OutputError(
            f"--out={out} exists and is not an image ({', '.join(IMAGE_SUFFIXES)}); plot replaces only an image it "
            "could have drawn: choose another --out"
        )


def plain(text: str) -> str:
    """``text`` as matplotlib draws it literally: a ``$`` would start its math mode (``$x^$`` fails to parse)."""
    return text.replace("$", r"\$")


def confusion_png(confusion: np.ndarray, names: list[str], title: str) -> bytes | None:
    """The confusion matrix ``(C, C)`` (rows: true, columns: predicted) drawn as PNG bytes; None without matplotlib.

    Names and title are drawn as they are written (:func:`plain`), whatever characters they hold.
    """
    plt = _pyplot()
    if plt is None:
        log.warning("confusion.png needs matplotlib: pip install -e '.[plot]' (evaluation.json has the matrix)")
        return None
    c, names, title = len(names), [plain(n) for n in names], plain(title)
    rates = confusion / np.maximum(confusion.sum(axis=1, keepdims=True), 1)  # each true class's row sums to 1
    size = min(4 + 0.45 * c, 16)
    fig, ax = plt.subplots(figsize=(size + 1, size))
    im = ax.imshow(rates, cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    if c <= 30:
        ax.set_xticks(range(c), names, rotation=90 if max(map(len, names)) > 3 else 0)
        ax.set_yticks(range(c), names)
        if c <= 20:
            for i in range(c):
                for j in range(c):
                    if confusion[i, j]:
                        ax.text(
                            j,
                            i,
                            str(confusion[i, j]),
                            ha="center",
                            va="center",
                            fontsize=8,
                            color="white" if rates[i, j] > 0.5 else "black",
                        )
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title, fontsize=10)
    png = _png(fig)
    plt.close(fig)
    return png


def runs_of(path: Path) -> list[Path]:
    """The run directories of ``path``: itself if it is a run, else the jobs of a sweep folder."""
    path = Path(path)
    if (path / METRICS).is_file():
        return [path]
    if not path.is_dir():
        raise OutputError(f"{path} is not a run directory or a sweep folder")
    runs = sorted(p for p in path.iterdir() if (p / METRICS).is_file())
    if not runs:
        raise OutputError(f"{path} holds no run: no {METRICS} in it or in its subfolders")
    return runs


def labels_of(runs: list[Path]) -> list[str]:
    """Each run's label: the overrides that differ between the runs (the folder name otherwise)."""
    import yaml

    overrides = []
    for run in runs:
        f = run / ".hydra" / "overrides.yaml"
        overrides.append(list(yaml.safe_load(f.read_text()) or []) if f.is_file() else [])
    common = set.intersection(*(set(o) for o in overrides)) if overrides else set()
    return [" ".join(o for o in ov if o not in common) or run.name for run, ov in zip(runs, overrides, strict=True)]


def curves_figure(target: Path, out: Path | None = None) -> Path:
    """Draw ``curves.png`` for a run or a sweep (default: into ``target``); returns its path."""
    plt = _pyplot()
    if plt is None:
        raise OutputError("plotting needs matplotlib: pip install -e '.[plot]' in mlptrain's clone")
    runs = runs_of(target)
    path = Path(out) if out else Path(target) / "curves.png"
    check_out(path, runs)
    labels = [plain(label) for label in labels_of(runs)]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for run, label in zip(runs, labels, strict=True):
        records = _records(run / METRICS)
        steps = [r for r in records if r["kind"] == "step"]
        epochs = [r for r in records if r["kind"] == "epoch"]
        (line,) = axes[0].plot([r["step"] for r in steps], [r["train/loss"] for r in steps], lw=1, label=label)
        members = member_labels(run, epochs)
        colour = "black" if members and len(runs) == 1 else line.get_color()  # one run's members take the colours
        for ax, metric in ((axes[1], "loss"), (axes[2], "acc")):
            for split, style in (("val", "-"), ("test", ":")):
                pts = _points(epochs, f"{split}/{metric}")
                if pts:
                    ax.plot(
                        *zip(*pts, strict=True),
                        style,
                        marker=".",
                        lw=2 if members else 1.5,
                        color=colour,
                        label=f"{label} {split}" if len(runs) > 1 else _ensemble_label(run, members, split),
                    )
                _draw_members(
                    ax, epochs, members, f"{split}/{metric}", style, line.get_color() if len(runs) > 1 else None
                )
    axes[0].set(xlabel="optimizer step", ylabel="training loss (per step)", yscale="log", title="training loss")
    axes[1].set(xlabel="epoch", ylabel="loss", title="validation (solid) and test (dotted) loss")
    axes[2].set(xlabel="epoch", ylabel="accuracy", title="validation (solid) and test (dotted) accuracy")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if any(line.get_label().startswith(("member", "fold")) for line in axes[1].lines):
        axes[1].legend(fontsize=7)
    if not any(ax.lines for ax in axes[2:]):
        axes[2].set_visible(False)  # a regression has no accuracy
    each = ""  # one run of many models: how many, in the title
    if len(runs) == 1 and members:
        each = f", {len(members)} {'folds' if is_cross_validation(runs[0]) else 'members'}"
    fig.suptitle(f"{plain(str(target))} ({len(runs)} run{'s' if len(runs) > 1 else ''}{each})", fontsize=10)
    _save(fig, path)
    plt.close(fig)
    return path


def _points(epochs: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """``(epoch, value)`` of the epoch records that hold ``key``."""
    return [(r["epoch"], r[key]) for r in epochs if key in r]


def _ensemble_label(run: Path, members: dict[int, str], split: str) -> str:
    """The legend of one run's own line: the split, and for many models what scored it (a cross-validation's
    validation scores are the out-of-fold predictions', its test scores the fold models' ensemble's)."""
    if not members:
        return split
    return f"out-of-fold {split}" if split == "val" and is_cross_validation(run) else f"ensemble {split}"


def member_labels(run: Path, epochs: list[dict[str, Any]]) -> dict[int, str]:
    """The members a run's epoch records score (``member<k>/val/...``), each with its label: ``fold k`` in a
    cross-validation (:func:`is_cross_validation`), else ``member k``; then its learning rate and weight decay
    (``member<k>/lr``, ``member<k>/weight_decay`` of the last record) where the members' differ. ``{}``: one model."""
    ids = sorted(
        {
            int(head[6:])
            for r in epochs
            for head in (key.split("/")[0] for key in r)
            if head[6:].isdigit() and head.startswith("member")
        }
    )
    word = "fold" if is_cross_validation(run) else "member"
    labels = {k: f"{word} {k}" for k in ids}
    last = epochs[-1] if epochs else {}
    for setting in ("lr", "weight_decay"):
        values = {k: last.get(f"member{k}/{setting}") for k in ids}
        if len(set(values.values())) > 1:  # a value a record lacks is left out of that member's label
            for k, v in values.items():
                labels[k] += "" if v is None else f" {setting}={v:g}"
    return labels


def is_cross_validation(run: Path) -> bool:
    """Whether ``run`` is a cross-validation (``ensemble.folds``): its ``folds.json``, or while it runs (or after it
    failed) the config in its ``run.json``."""
    if (run / FOLDS_REPORT).is_file():
        return True
    try:
        config = json.loads((run / RUN_RECORD).read_text()).get("config") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return bool((config.get("ensemble") or {}).get("folds"))


def _draw_members(
    ax: Any, epochs: list[dict[str, Any]], members: dict[int, str], key: str, style: str, colour: str | None
) -> None:
    """Each member's ``key`` (``val/loss``) as a thin line: in ``colour`` (a sweep's run), unlabelled; else in a
    colour of its own, labelled on the solid (validation) lines up to :data:`MEMBER_LABELS` members."""
    for i, (k, label) in enumerate(members.items()):
        pts = _points(epochs, f"member{k}/{key}")
        if not pts:
            continue
        named = colour is None and style == "-" and (len(members) <= MEMBER_LABELS or i == 0)
        text = label if len(members) <= MEMBER_LABELS else f"members ({len(members)})"
        ax.plot(
            *zip(*pts, strict=True),
            style,
            lw=0.8,
            alpha=0.6 if colour is None and len(members) <= MEMBER_LABELS else 0.3,
            color=colour or (f"C{i % 10}" if len(members) <= MEMBER_LABELS else "grey"),
            label=text if named else None,
        )


def _records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a file that is not UTF-8 text is named, with its line."""
    try:
        return read_metrics(path)
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        raise OutputError(
            f"{path}: line {line} is not UTF-8 text (byte {exc.start}); expected the JSON lines of a run's metrics"
        ) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlptrain.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", type=Path, help="a run directory or a sweep folder")
    parser.add_argument("--out", type=Path, default=None, help="a .png, .svg or .pdf (default: TARGET/curves.png)")
    args = parser.parse_args(argv)
    try:
        path = curves_figure(args.target, args.out)
    except (OutputError, OSError, ValueError, KeyError) as exc:  # a damaged metrics.jsonl too: one line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
