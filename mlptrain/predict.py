"""``python -m mlptrain.predict ckpt=PATH input=FILE output=FILE``: score a file of raw inputs.

The input is any file ``data=file`` reads (CSV/TSV with a header, ``.gz``, NPZ, Parquet). Its
feature columns are matched to the checkpoint's by name, in any order; a missing or unknown
feature column is an error naming both. A target column, if the file has one, is not a feature:
its labels are compared with the predictions and the accuracy is reported. The output is

* ``.csv`` / ``.tsv`` (``.gz`` too): ``class_id,class_name`` per row, with ``p_<class>`` columns
  when ``probabilities=true``; a regression: one column per target;
* ``.npy``: the class ids ``(N,)`` (``probabilities=true``: the ``(N, C)`` probabilities; a
  regression: the ``(N, T)`` outputs);
* ``.npz``: ``class_id``, ``class_name`` and (when asked) ``probabilities``, or ``values``.

``keep=id,name`` copies input columns that are not features (an id) into the output, before the
predictions (CSV and NPZ).

It is written atomically once every row is scored: a failed or interrupted run leaves any
previous output as it was. The output never replaces the input or a checkpoint, and an existing
file only when it is a predictions file (of this model: ``overwrite=true`` replaces any other
file); a killed run's temp file is removed at the next run (:mod:`mlptrain.outputs`).

In Python, ``mlptrain.predict(ckpt, x)`` scores an array (this module is callable:
:func:`mlptrain.inference.predict`).
"""

from __future__ import annotations

import csv
import gzip
import io
import logging
import sys
import time
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from mlptrain import commands, outputs
from mlptrain.commands import REQUIRED, arg
from mlptrain.data.csv_reader import lines as file_lines
from mlptrain.data.files import columns, file_kind, read_table
from mlptrain.errors import ConfigError, DatasetError, OutputError
from mlptrain.inference import DEFAULT_BATCH, Outputs, Predictor, predict

log = logging.getLogger(__name__)

__all__ = ["predict", "main", "PredictArgs", "read_inputs", "write_outputs"]

OUTPUT_SUFFIXES = (".csv", ".csv.gz", ".tsv", ".tsv.gz", ".npy", ".npz")


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


def output_kind(path: Path) -> str:
    name = path.name.lower()
    for suffix in OUTPUT_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    raise ConfigError(f"output={path}: unknown format; expected a file ending in {', '.join(OUTPUT_SUFFIXES)}")


def read_inputs(
    p: Predictor, path: Path, keep: list[str] | None = None
) -> tuple[np.ndarray, np.ndarray | None, dict[str, np.ndarray]]:
    """What an input file holds for the model.

    Returns the raw feature rows in the model's column order; the targets if the file has them
    (class indices ``(N,)``; a regression's ``(N, T)`` float64, NaN in the columns of targets the
    file lacks) or None; and the ``keep`` columns (an id, say: not features, written beside the
    predictions) as the file has them, text as text. An NPZ file's targets are its ``y``.
    """
    keep = list(keep or [])
    where = f"input file {path}"
    kind, _ = file_kind(path)
    names = columns(path, setting="input")
    present = [t for t in p.target_columns if t in names and t not in keep]
    if kind == "npz":  # x, and y if the file has it; keep names other arrays of the file
        table, _ = read_table(path, [], setting="input")
        cells = None if table.y is None else np.asarray(table.y).reshape(len(table.x), -1)
        present = list(p.target_columns) if cells is not None else []
    else:  # the header first: a file of another model is named so, not by a cell that is not a number
        p.check_columns([n for n in names if n not in present and n not in keep], where)
        table, _ = read_table(path, present + keep, setting="input", target_setting="keep")
        cells = np.asarray(table.y).reshape(len(table.x), -1) if present else None
    x = p.arrange(table.feature_names, table.x, where, named=table.named)
    y = None
    if cells is not None and p.classification:
        y = p.labels(cells[:, 0], where)
    elif cells is not None:
        y = np.full((len(x), p.num_outputs), np.nan)
        for i, t in enumerate(present[: cells.shape[1]]):
            try:
                y[:, p.target_columns.index(t)] = cells[:, i].astype(np.float64)
            except ValueError:
                raise DatasetError(f"{where}: the target column {t!r} holds values that are not numbers") from None
    return x, y, kept_columns(path, keep, len(x))


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


def write_outputs(p: Predictor, out: Outputs, path: Path, kept: dict[str, np.ndarray] | None = None) -> None:
    """Write ``out`` (and the ``kept`` input columns before it) to ``path`` (format by suffix), atomically."""
    try:
        _write(p, out, path, kept or {})
    except OSError as exc:
        raise OutputError(f"cannot write {path} ({type(exc).__name__}: {exc}); nothing was written there") from exc


def _write(p: Predictor, out: Outputs, path: Path, kept: dict[str, np.ndarray]) -> None:
    kind = output_kind(path)
    if kind == ".npy":
        array = next(a for a in (out.values, out.probabilities, out.class_id) if a is not None)
        outputs.write_together([(path, lambda f: np.save(f, array))])
    elif kind == ".npz":
        arrays: dict[str, Any] = dict(kept)
        arrays.update({"values": out.values} if out.values is not None else {"class_id": out.class_id})
        if out.class_id is not None:
            arrays["class_name"] = np.array(p.class_name(out.class_id))
        if out.probabilities is not None:
            arrays["probabilities"] = out.probabilities
        outputs.write_together([(path, lambda f: np.savez(f, **arrays))])
    else:
        delimiter = "\t" if kind.startswith(".tsv") else ","
        outputs.write_together([(path, lambda f: _write_csv(p, out, kept, f, delimiter, kind))])


def _write_csv(
    p: Predictor, out: Outputs, kept: dict[str, np.ndarray], f: IO[bytes], delimiter: str, kind: str
) -> None:
    # filename="": the header names no file (it would name the temp file, whose name is the writer's own)
    raw: Any = gzip.GzipFile(filename="", fileobj=f, mode="wb", mtime=0) if kind.endswith(".gz") else f
    text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
    w = csv.writer(text, delimiter=delimiter, lineterminator="\n")
    first = [list(kept)]  # the kept input columns come first, row by row
    lead = list(zip(*(c.tolist() for c in kept.values()), strict=True)) if kept else None
    if out.values is not None:
        w.writerow(first[0] + (p.target_names or [f"y{i}" for i in range(p.num_outputs)]))
        rows: Any = out.values.tolist()
    else:
        names = p.class_name(np.arange(p.num_outputs))
        probs = out.probabilities
        w.writerow(first[0] + ["class_id", "class_name", *((f"p_{n}" for n in names) if probs is not None else ())])
        ids = out.class_id.tolist()  # type: ignore[union-attr]
        if probs is None:
            rows = ([i, names[i]] for i in ids)
        else:
            rows = ([i, names[i], *(f"{v:.6g}" for v in row)] for i, row in zip(ids, probs.tolist(), strict=True))
    if lead is None:
        w.writerows(rows)
    else:
        w.writerows([*k, *r] for k, r in zip(lead, rows, strict=True))
    text.flush()
    text.detach()
    if raw is not f:
        raw.close()


def is_predictions(p: Predictor, path: Path) -> bool:
    """Whether ``path`` holds what this command writes for ``p``'s model (so it may be replaced)."""
    kind = output_kind(path)
    try:
        if kind == ".npy":  # class ids (N,) int64, or (N, outputs) float32 probabilities or values
            a = np.load(path, mmap_mode="r", allow_pickle=False)
            return (a.dtype == np.int64 and a.ndim == 1) or (a.dtype == np.float32 and a.shape[1:] == (p.num_outputs,))
        if kind == ".npz":
            with np.load(path, allow_pickle=False) as npz:  # the zip's names only
                names = set(npz.files)
            return bool(names & {"class_id", "values"}) and not names & {"x", "meta"}
        opened: Any = gzip.open(path, "rt", encoding="utf-8") if kind.endswith(".gz") else open(path, encoding="utf-8")
        with opened as f:
            header = next(csv.reader([f.readline()], delimiter="\t" if kind.startswith(".tsv") else ","), [])
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):  # not a file of its suffix's format
        return False
    predicted = ["class_id", "class_name"] if p.classification else p.target_names or ["y0"]
    return set(predicted) <= set(header) and not set(header) & set(p.feature_names or [])


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
        if out.class_id is not None:
            line += f" | accuracy {np.mean(out.class_id == y):.4f} against the file's {p.target_columns[0]!r} column"
        elif out.values is not None:  # over the targets the file has (the others are NaN in y)
            mse = float(np.nanmean((out.values - y) ** 2))
            line += f" | mse {mse:.6g} against the file's targets"
    print(line)
    return 0


ABOUT = "Score raw inputs with a trained mlptrain checkpoint (its normalisation and column names included)."


def main(argv: list[str] | None = None) -> int:
    return commands.main(PredictArgs, "mlptrain.predict", ABOUT, run, argv)


class _CallableModule(types.ModuleType):
    """``mlptrain.predict(ckpt, x)`` calls :func:`mlptrain.inference.predict`: the module is also the function."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return predict(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
