"""The predictions file that ``python -m mlptrain.predict`` writes: its formats, writing it, and knowing one.

* ``.csv`` / ``.tsv`` (``.gz`` too): ``class_id,class_name`` per row, with ``p_<class>`` columns
  when asked for; a regression: one column per target. A text cell that a spreadsheet would run as
  a formula (one starting with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return: a class name
  ``=HYPERLINK(...)``, a kept id) is written with a leading single quote, as OWASP's advice on CSV
  injection says (:func:`spreadsheet_text`); numbers, negative ones included, are written as they are.
* ``.npy``: one array; ``.npz``: ``class_id``, ``class_name``, ``probabilities`` or ``values``, and
  the kept columns, as they are (NumPy files hold no formulas).

Written atomically (:func:`mlptrain.inference.outputs.write_together`); :func:`is_predictions` tells whether
an existing file is such a file (which predict may replace).
"""

from __future__ import annotations

import csv
import gzip
import io
import zipfile
from pathlib import Path
from typing import IO, Any

import numpy as np

from mlptrain.base.errors import ConfigError, OutputError
from mlptrain.base.fs import spreadsheet_text
from mlptrain.inference import outputs
from mlptrain.inference.predictor import Outputs, Predictor

OUTPUT_SUFFIXES = (".csv", ".csv.gz", ".tsv", ".tsv.gz", ".npy", ".npz")


def output_kind(path: Path) -> str:
    name = path.name.lower()
    for suffix in OUTPUT_SUFFIXES:
        if name.endswith(suffix):
            return suffix
    raise ConfigError(f"output={path}: unknown format; expected a file ending in {', '.join(OUTPUT_SUFFIXES)}")


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
    first = [spreadsheet_text(k) for k in kept]  # the kept input columns come first, row by row
    lead = (
        [[spreadsheet_text(c) for c in r] for r in zip(*(c.tolist() for c in kept.values()), strict=True)]
        if kept
        else None
    )
    if out.values is not None:
        w.writerow(first + [spreadsheet_text(t) for t in p.target_names or [f"y{i}" for i in range(p.num_outputs)]])
        rows: Any = out.values.tolist()
    else:
        given = p.class_name(np.arange(p.num_outputs))
        names = [spreadsheet_text(n) for n in given]
        probs = out.probabilities  # p_<name> starts with p: a spreadsheet shows it as text
        w.writerow(first + ["class_id", "class_name", *((f"p_{n}" for n in given) if probs is not None else ())])
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
    features = set(p.input_names or [])  # an input file has them all; a predictions file only those kept (keep=f0)
    return set(predicted) <= set(header) and not (features and features <= set(header))
