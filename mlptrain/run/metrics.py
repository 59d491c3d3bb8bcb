"""Metrics records: ``metrics.jsonl`` in the run directory, one JSON object per line.

Each record is flushed as it is written, so a crash leaves a readable prefix. Non-finite floats
are written as ``null`` with their keys listed under ``"nonfinite"`` (``NaN`` is not JSON).

Record kinds (the ``kind`` key):

* ``step``: one per optimizer step: ``step``, ``epoch``, ``train/loss``, ``train/acc`` (of the
  batch), ``lr``, ``loss_scale``, ``skipped``; the last step of each log interval also carries
  ``samples_per_s`` and ``step_time_ms`` measured over the interval.
* ``epoch``: ``epoch``, ``step``, ``train/loss``, ``train/acc`` (means over the epoch),
  ``val/loss``, ``val/acc``, ``test/loss``, ``test/acc``, ``time_s``; per evaluated split the scores of
  :mod:`mlptrain.nn.scores` (``val/balanced_acc``, ``val/precision_macro``, ``val/recall_macro``,
  ``val/f1_macro``, ``val/log_loss``, ``val/roc_auc`` for two classes; a regression's ``val/rmse``,
  ``val/mae``, ``val/r2``).
* ``summary``: the final numbers of the run.
* ``interrupted``: Ctrl-C stopped the run at ``step``; ``checkpoint`` is where ``last`` was saved.

Epochs count from 1 here, as in the log lines (``epoch 1/20``), the summary line and Keras's
``Epoch 1/20``: ``epoch`` of a step record is the epoch the step belongs to, of an epoch record the
epoch it ends; the summary's ``best.epoch`` and ``stopped_early`` too. The training loop and the
checkpoint's :class:`~mlptrain.run.checkpoint.Position` count from 0 (the next epoch to run); the writer
turns one into the other (:func:`epochs_from_one`), and a run written before (its first record says
``"epoch": 0``) has its records renumbered when it is resumed.

A resumed run continues the file from the records written up to its checkpoint
(:func:`plan_prefix`): the records after it are written again, identically. A line that is not a
JSON record (a damaged disk block, a hand edit) is never dropped: it is moved to
``metrics.jsonl.corrupt`` and the records on both sides of it are kept.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlptrain.base.errors import OutputError
from mlptrain.base.fs import atomic_write, open_nofollow

log = logging.getLogger(__name__)

CORRUPT_SUFFIX = ".corrupt"


def _clean(record: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    bad = []
    for k, v in record.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = None
            bad.append(k)
        else:
            out[k] = v
    if bad:
        out["nonfinite"] = bad
    return out


def epochs_from_one(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` (a copy) with its epochs counted from 1: ``epoch``, ``best.epoch``, ``best.improved`` and
    ``stopped_early`` of the loop's 0-based positions, plus one."""
    out = dict(record)
    if isinstance(out.get("epoch"), int):
        out["epoch"] += 1
    if isinstance(out.get("stopped_early"), int):
        out["stopped_early"] += 1
    if isinstance(out.get("best"), dict):
        out["best"] = {
            k: v + 1 if k in ("epoch", "improved") and isinstance(v, int) else v for k, v in out["best"].items()
        }
    return out


class MetricsWriter:
    """Appends records to ``path`` (it continues a file that holds ``records`` records), counting them.

    Raises:
        OutputError: the file cannot be opened or written (disk full, read-only); closing after a
            failed write never raises a second error over the first.
    """

    def __init__(self, path: Path, records: int = 0, sinks: list[Any] | None = None) -> None:
        self.path = Path(path)
        self.records = records
        self.sinks = list(sinks or [])  # metrics.csv, TensorBoard (mlptrain.run.sinks): they get every record too
        try:
            self._f = open_nofollow(self.path, "a", encoding="utf-8")
        except OSError as exc:
            raise OutputError(f"cannot open {self.path} for writing ({exc}); choose a writable hydra.run.dir") from exc

    def write(self, **record: Any) -> None:
        """Append one record (its epochs as the loop counts them, from 0: the file counts from 1)."""
        record = epochs_from_one(record)
        try:
            self._f.write(json.dumps(_clean(record), allow_nan=False) + "\n")
            self._f.flush()
        except OSError as exc:
            raise OutputError(
                f"cannot write {self.path} ({type(exc).__name__}: {exc}); free disk space or choose another "
                "hydra.run.dir"
            ) from exc
        self.records += 1
        for sink in self.sinks:
            sink.write(record)

    def flush_sinks(self) -> None:
        """Every record so far on disk in the sinks too (``metrics.jsonl`` is flushed line by line): before a
        checkpoint, so that a run killed after it, resumed from it, finds its views complete up to it."""
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        """Close the file and the sinks; a buffered line that cannot be written any more is given up (it was
        reported)."""
        try:
            self._f.close()
        except OSError as exc:
            log.warning("closing %s: %s", self.path, exc)
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl``; a torn last line (a killed run) is ignored."""
    records = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # the line being written when the process died
            raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
    return records


@dataclass
class MetricsPrefix:
    """The first records of a ``metrics.jsonl``, read (not yet written anywhere): see :func:`plan_prefix`.

    Attributes:
        lines: the record lines to keep, each ending in a newline.
        damaged: ``(line number, raw bytes)`` of the lines among them that are not JSON records.
        torn: a last line cut short (the process died while writing it); not a record.
        wanted: how many records the checkpoint counted; ``len(lines) + len(damaged)`` is less when
            the file lost some.
    """

    source: Path | None
    wanted: int
    lines: list[bytes] = field(default_factory=list)
    damaged: list[tuple[int, bytes]] = field(default_factory=list)
    torn: bytes = b""

    @property
    def records(self) -> int:
        """The records that will be in the file: its kept lines."""
        return len(self.lines)

    def apply(self, path: Path) -> None:
        """Make ``path`` hold the kept records (atomically); append the damaged lines to ``path.corrupt``.

        Raises:
            OutputError: a file cannot be written.
        """
        found = len(self.lines) + len(self.damaged)
        if found < self.wanted:
            log.warning(
                "%s holds %d of the %d records before the checkpoint; continuing after them",
                self.source,
                found,
                self.wanted,
            )
        path = Path(path)
        corrupt = path.with_name(path.name + CORRUPT_SUFFIX)
        try:
            if self.damaged:
                with open_nofollow(corrupt, "ab") as f:
                    f.writelines(raw.rstrip(b"\n") + b"\n" for _, raw in self.damaged)
                    f.flush()
                log.warning(
                    "%s: line(s) %s are not JSON records; moved to %s, the records around them are kept",
                    self.source,
                    ", ".join(str(n) for n, _ in self.damaged),
                    corrupt,
                )
            atomic_write(path, b"".join(self.lines))
        except OSError as exc:
            raise OutputError(
                f"cannot write {path} ({type(exc).__name__}: {exc}); choose a writable hydra.run.dir"
            ) from exc


def plan_prefix(source: Path | None, records: int) -> MetricsPrefix:
    """The first ``records`` lines of ``source`` (each was a record when it was written), read only.

    Lines that are not JSON objects are set aside as damaged (they count among the ``records``:
    they were records once); a torn last line (a killed run) is not a record and is left out.
    """
    plan = MetricsPrefix(source, records)
    if records <= 0 or source is None or not Path(source).is_file():
        return plan
    try:
        raw = Path(source).read_bytes()
    except OSError as exc:
        raise OutputError(f"cannot read {source} ({type(exc).__name__}: {exc})") from exc
    counted_from_zero: bool | None = None  # a run written before epochs counted from 1: renumbered
    for n, line in enumerate(raw.splitlines(keepends=True), start=1):
        if len(plan.lines) + len(plan.damaged) == records:
            break
        complete = line.endswith(b"\n")
        record: Any = None
        try:
            record = json.loads(line.decode("utf-8")) if complete else None
        except (UnicodeDecodeError, ValueError):
            pass
        if isinstance(record, dict):
            if counted_from_zero is None and isinstance(record.get("epoch"), int):
                counted_from_zero = record["epoch"] == 0
            if counted_from_zero:
                line = (json.dumps(epochs_from_one(record), allow_nan=False) + "\n").encode("utf-8")
            plan.lines.append(line)
        elif complete:
            plan.damaged.append((n, line))
        else:  # torn: the line being written when the process died (written again after the resume)
            plan.torn = line
    return plan


def kinds_after(path: Path, records: int) -> list[str]:
    """The ``kind`` of every readable record after the first ``records`` lines of ``path`` (none if it is missing)."""
    try:
        lines = Path(path).read_bytes().splitlines()[records:]
    except OSError:
        return []
    kinds = []
    for line in lines:
        try:
            kinds.append(str(json.loads(line.decode("utf-8")).get("kind")))
        except (UnicodeDecodeError, ValueError, AttributeError):
            continue
    return kinds
