"""``python -m mlptrain.predict ckpt=PATH input=FILE output=FILE``: score a file of raw inputs.

The input is any file ``data=file`` reads (CSV/TSV with a header, ``.gz``, NPZ, Parquet). Its
feature columns are matched to the checkpoint's by name, in any order; a missing feature column is
an error naming it (and the file's other columns). A column the model does not take (an id) is
ignored, and named in one log line. A target column, if the file has one, is not a feature: its
labels are compared with the predictions and the accuracy is reported, over the rows that have a
label (a column with no values is no labels: one log line, no score). The output is

* ``.csv`` / ``.tsv`` (``.gz`` too): ``class_id,class_name`` per row, with ``p_<class>`` columns
  when ``probabilities=true``; a regression: one column per target; a text cell that a spreadsheet
  would run as a formula gets a leading ``'`` (:mod:`mlptrain.cli.predictions`);
* ``.npy``: the class ids ``(N,)`` (``probabilities=true``: the ``(N, C)`` probabilities; a
  regression: the ``(N, T)`` outputs);
* ``.npz``: ``class_id``, ``class_name`` and (when asked) ``probabilities``, or ``values``.

``keep=id,name`` copies input columns (an id; a feature too) into the output, before the
predictions (CSV and NPZ).

It is written atomically once every row is scored: a failed or interrupted run leaves any
previous output as it was. The output never replaces the input or a checkpoint, and an existing
file only when it is a predictions file (of this model: ``overwrite=true`` replaces any other
file); a killed run's temp file is removed at the next run (:mod:`mlptrain.inference.outputs`).

In Python, ``mlptrain.predict(ckpt, x)`` scores an array (a function of the package:
:func:`mlptrain.inference.predictor.predict`).
"""

from __future__ import annotations

import csv
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.base.errors import ConfigError, DatasetError, OutputError
from mlptrain.cli import commands
from mlptrain.cli.commands import REQUIRED, arg
from mlptrain.cli.predictions import OUTPUT_SUFFIXES, is_predictions, output_kind, write_outputs
from mlptrain.data.files import labels
from mlptrain.data.files.cells import read_cells
from mlptrain.data.files.csv_reader import lines as file_lines
from mlptrain.data.files.readers import columns, file_kind, read_table
from mlptrain.inference import outputs
from mlptrain.inference.columns import listed
from mlptrain.inference.predictor import DEFAULT_BATCH, Predictor, predict

log = logging.getLogger(__name__)

__all__ = ["predict", "main", "PredictArgs", "read_inputs", "write_outputs"]


@dataclass
class PredictArgs:
    ckpt: str = arg(REQUIRED, "a checkpoint (.npz), or a run directory (its checkpoints/best.npz)")
    input: str = arg(REQUIRED, "raw inputs: CSV/TSV with a header (.gz too), NPZ or Parquet")
    output: str = arg(REQUIRED, f"where to write the predictions: {', '.join(OUTPUT_SUFFIXES)}")
    probabilities: bool = arg(False, "also write the class probabilities (softmax of the logits)")
    batch_size: int = arg(DEFAULT_BATCH, "rows per batch")
    device: str = arg("auto", "auto (the GPU when there is one), cpu or gpu")
    precision: str | None = arg(None, "GEMM precision; null: the checkpoint's (fp32 on the CPU)")
    progress: bool | None = arg(None, "progress bar; null: on a terminal only")
    autotune: bool = arg(False, "GPU: time cuBLASLt's candidate algorithms per GEMM once, keep the fastest")
    keep: str | None = arg(None, "input columns to copy into the output (not features), comma-separated: keep=id")
    overwrite: bool = arg(False, "replace an existing output that is not a predictions file (never an input)")


def read_inputs(
    p: Predictor,
    path: Path,
    keep: list[str] | None = None,
    *,
    target: str | None = None,
    setting: str = "input",
    need_targets: bool = False,
) -> tuple[np.ndarray, np.ndarray | None, dict[str, np.ndarray]]:
    """What an input file holds for the model.

    Returns the raw feature rows in the model's column order; the targets if the file has them
    (class indices ``(N,)``, -1 where the label cell is empty; a regression's ``(N, T)`` float64, NaN
    where the file has no value for a target) or None (no target column, or one without a value);
    and the ``keep`` columns (an id, say, written beside the predictions) as the file has them, text
    as text. An NPZ file's targets are its ``y``. A column that is neither a feature, nor a target,
    nor kept is ignored, and named in one log line. A kept feature stays a feature.

    Args:
        target: the file's column(s) holding the targets (comma-separated for a regression's, in the
            model's order); default the checkpoint's (:attr:`Predictor.target_columns`).
        setting: the argument that named ``path`` (``input``, ``data``), for the messages.
        need_targets: every row must have its targets (``evaluate``): a missing or empty target column,
            or an empty cell, is an error.
    """
    keep = list(keep or [])
    where = f"{'input' if setting == 'input' else 'data'} file {path}"
    kind, _ = file_kind(path)
    names = columns(path, setting=setting)
    wanted = target_map(p, target, names, where, need_targets and kind != "npz")
    features = p.input_names or []
    present = [t for t in wanted if t in names and t not in features]
    others = [k for k in keep if k not in features and k not in present]  # kept, not read as features
    if kind == "npz":  # x, and y if the file has it; keep names other arrays of the file
        table, _ = read_table(path, [], setting=setting)
        cells = None if table.y is None else np.asarray(table.y).reshape(len(table.x), -1)
        present = list(wanted) if cells is not None else []
        if p.plan is not None:  # its numbers, as the column plan reads cells (NaN: an empty cell)
            texts = {n: np.array([repr(v) for v in table.x[:, j].tolist()]) for j, n in enumerate(table.feature_names)}
            table.x = p.encode(texts, where, table.where)
    else:  # the header first: a file of another model is named so, not by a cell that is not a number
        others += ignored_columns(p, names, present + others, where)
        p.check_columns([n for n in names if n not in present and n not in others], where)
        if p.plan is not None:  # text cells, encoded by the model's column plan
            table = read_cells(path, kind, file_kind(path)[1], present + others, "keep")
            assert table.cells is not None
            table.x = p.encode(table.cells, where, table.where)
        else:
            table, _ = read_table(path, present + others, setting=setting, target_setting="keep")
        cells = np.asarray(table.y).reshape(len(table.x), -1)[:, : len(present)] if present else None
    x = table.x if p.plan is not None else p.arrange(table.feature_names, table.x, where, named=table.named)
    check_finite(x, p.feature_names, table, where)
    y = None if cells is None else targets_of(p, table, cells, present, wanted, where, need_targets)
    if y is None and need_targets:
        raise DatasetError(
            f"{where} has no target column {', '.join(map(repr, wanted))}; evaluation needs the true "
            "labels (set target=COLUMN; python -m mlptrain.predict scores a file without them)"
        )
    return x, y, kept_columns(path, keep, len(x))


def target_map(p: Predictor, target: str | None, names: list[str], where: str, must_exist: bool) -> dict[str, int]:
    """The file's target columns, each with the index of the model's output it holds."""
    if target is None:
        return {t: i for i, t in enumerate(p.target_columns)}
    given = [t.strip() for t in target.split(",") if t.strip()]
    count = 1 if p.classification else p.num_outputs
    if len(given) != count:
        what = "the label column" if p.classification else f"{count} target columns, in the order {p.target_columns}"
        raise ConfigError(f"target={target}: the model {p.path.name} takes {what}; expected {count} column name(s)")
    features = [t for t in given if t in (p.input_names or [])]
    if features:
        raise ConfigError(f"target={target}: {features[0]!r} is a feature of the model; name the column of the labels")
    lacking = [t for t in given if t not in names]
    if lacking and must_exist:
        columns_are = f"its columns are {', '.join(map(repr, names))}"
        raise DatasetError(f"{where} has no column {', '.join(map(repr, lacking))} (target={target}); {columns_are}")
    return {t: i for i, t in enumerate(given)}


def ignored_columns(p: Predictor, names: list[str], taken: list[str], where: str) -> list[str]:
    """The columns of a file that the model does not take (an id), once it has all of the model's: ignored,
    and named in one log line. None where a feature is missing (the columns' error names both)."""
    features = p.input_names
    if features is None or any(f not in names for f in features):
        return []
    extra = [n for n in names if n not in features and n not in taken]
    if extra:
        what = "%s: ignoring the column(s) %s, which are not features of the model; keep=%s copies them into the output"
        log.info(what, where, listed(extra), ",".join(extra))
    return extra


def check_finite(x: np.ndarray, names: list[str] | None, table: Any, where: str) -> None:
    """Refuse a feature cell that is NaN or infinite, naming the file's line (or its 1-based row) and column."""
    bad = ~np.isfinite(x)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        at = f"{table.where(row)} (the header is line 1)" if table.text else f"row {row + 1} (counting from 1)"
        name = repr(names[col]) if names else f"{col + 1} (counting from 1)"
        raise DatasetError(f"{where} {at}, column {name} holds {x[row, col]}; features must be finite numbers")


def targets_of(
    p: Predictor,
    table: Any,
    cells: np.ndarray,
    present: list[str],
    wanted: dict[str, int],
    where: str,
    need: bool,
) -> np.ndarray | None:
    """The targets of ``cells (N, len(present))``, as :func:`read_inputs` returns them; None where no cell
    has a value (an empty label column is no labels)."""
    empty = empty_cells(table, present)  # (N, len(present)) bool
    if empty.all():
        if need:
            raise DatasetError(
                f"{where}: the target column(s) {listed(present)} hold no values; evaluation needs labels"
            )
        log.info("%s: the column(s) %s hold no values: no labels, no score", where, listed(present))
        return None
    if need and empty.any():
        rows = np.flatnonzero(empty.any(axis=1))
        raise DatasetError(
            f"{where} {table.where_rows(rows)}: no value in the target column(s) {listed(present)}; evaluation "
            "needs a label on every row (fill or remove those rows)"
        )
    if p.classification:
        y = np.full(len(cells), -1, dtype=np.int64)
        rows = np.flatnonzero(~empty[:, 0])
        y[rows] = p.labels(cells[rows, 0], where, place=lambda r: table.where(int(rows[r])))
        return y
    y = np.full((len(cells), p.num_outputs), np.nan)
    for i, t in enumerate(present):
        try:
            y[:, wanted[t]] = np.where(empty[:, i], np.nan, cells[:, i].astype(np.float64))
        except ValueError:
            raise DatasetError(f"{where}: the target column {t!r} holds values that are not numbers") from None
    return y


def empty_cells(table: Any, present: list[str]) -> np.ndarray:
    """``(N, len(present))`` bool: the cells of the target columns that hold no value (empty, NA, NaN)."""
    n = len(table.x)
    if table.missing is None:
        return np.zeros((n, len(present)), dtype=bool)
    if len(present) == 1 and table.y.ndim == 1:  # the row mask is this column's
        return table.missing.reshape(n, 1)
    cells = kept_columns(table.path, present, n)  # the columns' own cells, as text
    return np.stack([labels.text_column(np.asarray(cells[t]).astype(str))[1] for t in present], axis=1)


def kept_columns(path: Path, keep: list[str], rows: int) -> dict[str, np.ndarray]:
    """The ``keep`` columns of ``path``, each as the file holds it (CSV: the text of each cell)."""
    if not keep:
        return {}
    kind, delimiter = file_kind(path)
    out: dict[str, np.ndarray] = {}
    if kind == "csv":
        lines = (line for line in file_lines(path) if line.strip())  # blank lines are not rows, as read_table reads
        header = [n.strip() for n in next(csv.reader([next(lines)], delimiter=delimiter or ","))]
        where = [header.index(k) if k in header else -1 for k in keep]
        cells: list[list[str]] = [[] for _ in keep]
        if -1 not in where:
            for row in csv.reader(lines, delimiter=delimiter or ","):
                for j, i in enumerate(where):
                    cells[j].append(row[i].strip())
        out = {k: np.array(c, dtype=str) for k, c in zip(keep, cells, strict=True) if k in header}
    elif kind == "npz":
        with np.load(path, allow_pickle=False) as npz:
            out = {k: npz[k] for k in keep if k in npz.files and npz[k].shape[:1] == (rows,)}
    else:
        import pyarrow.parquet as pq

        schema = pq.read_schema(path).names
        table = pq.read_table(path, columns=[k for k in keep if k in schema])
        out = {k: table.column(k).to_numpy(zero_copy_only=False) for k in table.column_names}
    missing = [k for k in keep if k not in out]
    if missing:
        raise DatasetError(
            f"input file {path} has no column {', '.join(map(repr, missing))} of {rows} rows (keep); "
            f"its columns are {', '.join(columns(path))}"
        )
    return out


def run(args: PredictArgs) -> int:
    from tqdm import tqdm

    out_path, in_path = Path(args.output).expanduser(), Path(args.input).expanduser()
    keep = [k.strip() for k in args.keep.split(",") if k.strip()] if args.keep else []
    if output_kind(out_path) == ".npy" and keep:  # checked before the work, as is the folder it goes to
        raise ConfigError(f"keep={args.keep}: a .npy file holds one array; write .csv or .npz to keep columns")
    if not out_path.parent.is_dir():
        raise OutputError(f"output={out_path}: the folder {out_path.parent} does not exist")
    p = Predictor(
        args.ckpt, device=args.device, precision=args.precision, batch_size=args.batch_size, autotune=args.autotune
    )
    log.info("%s", p.describe())
    p.check_probabilities(args.probabilities)
    outputs.check_output(
        out_path,
        inputs={"the input file": in_path, "the checkpoint": p.path},
        kind="a predictions file",
        same_kind=lambda f: is_predictions(p, f),
        overwrite=args.overwrite,
    )
    outputs.prepare([out_path])
    x, y, kept = read_inputs(p, in_path, keep)
    t0 = time.perf_counter()
    with tqdm(
        total=len(x),
        unit="rows",
        desc="predict",
        disable=None if args.progress is None else not args.progress,
        unit_scale=True,
        dynamic_ncols=True,
    ) as bar:
        out = p.run(x, probabilities=args.probabilities, progress=bar.update)
    seconds = time.perf_counter() - t0
    write_outputs(p, out, out_path, kept)
    line = f"predicted {len(x):,} rows in {seconds:.2f} s ({len(x) / max(seconds, 1e-9):,.0f} rows/s) -> {out_path}"
    if y is not None:
        if out.class_id is not None:  # over the rows with a label (-1: an empty cell)
            labelled = y >= 0
            line += f" | accuracy {np.mean(out.class_id[labelled] == y[labelled]):.4f} against the file's "
            line += f"{p.target_columns[0]!r} column"
            if not labelled.all():
                line += f" ({int(labelled.sum()):,} rows with a label; {int((~labelled).sum()):,} empty)"
        elif out.values is not None:  # over the targets the file has (the others are NaN in y)
            mse = float(np.nanmean((out.values - y) ** 2))
            line += f" | mse {mse:.6g} against the file's targets"
    print(line)
    return 0


ABOUT = "Score raw inputs with a trained mlptrain checkpoint (its normalisation and column names included)."


def main(argv: list[str] | None = None) -> int:
    return commands.main(PredictArgs, "mlptrain.predict", ABOUT, run, argv)


if __name__ == "__main__":
    sys.exit(main())
