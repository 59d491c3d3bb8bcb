"""Where a run's metrics records go besides ``metrics.jsonl``: ``metrics.csv`` and TensorBoard.

``metrics.jsonl`` is the record (:mod:`mlptrain.run.metrics`); the sinks are views of it that other
tools read. :class:`CsvSink` writes ``metrics.csv`` with a fixed set of columns (the way
Lightning's ``CSVLogger`` does), rebuilt from ``metrics.jsonl`` when a run starts, so that after a
resume the two files agree row for row. :class:`TensorBoardSink` (``logger=tensorboard``, the
``tensorboard`` extra) writes event files through tensorboardX: step records under ``train/...``
and ``lr``, epoch records under ``epoch/...``, at the optimizer step of the record.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from mlptrain.base.errors import ConfigError, OutputError
from mlptrain.base.fs import open_nofollow
from mlptrain.nn.scores import CLASSIFICATION_SCORES, REGRESSION_SCORES
from mlptrain.run.metrics import read_metrics
from mlptrain.run.rundir import CSV_NAME, METRICS, TENSORBOARD_DIR

log = logging.getLogger(__name__)

__all__ = ["CSV_NAME", "TENSORBOARD_DIR", "CsvSink", "TensorBoardSink", "csv_columns"]


def csv_columns(classification: bool, splits: list[str], loss_scale: bool, binary: bool = False) -> list[str]:
    """The columns of ``metrics.csv`` for a run: its splits, whether it has accuracies (and two classes: ROC AUC)
    and a loss scale; an evaluated split's scores (:mod:`mlptrain.nn.scores`) after its loss and accuracy."""
    cols = ["kind", "epoch", "step", "train/loss", *(["train/acc"] if classification else [])]
    found = [*CLASSIFICATION_SCORES, *(["roc_auc"] if binary else [])] if classification else list(REGRESSION_SCORES)
    for split in splits:
        cols += [f"{split}/loss", *([f"{split}/acc"] if classification else []), *(f"{split}/{k}" for k in found)]
    cols += ["lr", *(["loss_scale", "skipped"] if loss_scale else []), "samples_per_s", "step_time_ms", "time_s"]
    return cols


class CsvSink:
    """``metrics.csv`` beside ``metrics.jsonl``: one row per record, the ``columns`` of :func:`csv_columns`."""

    def __init__(self, path: Path, columns: list[str], jsonl: Path) -> None:
        self.path = Path(path)
        self.columns = columns
        self._f: Any = None
        try:
            rows = read_metrics(jsonl) if Path(jsonl).is_file() else []
            self._f = open_nofollow(self.path, "w", encoding="utf-8", newline="")  # rebuilt: it follows metrics.jsonl
            self._w = csv.DictWriter(self._f, fieldnames=columns, extrasaction="ignore")
            self._w.writeheader()
            for row in rows:
                self._w.writerow(_cells(row))
            self._f.flush()
        except (OSError, ValueError) as exc:
            if getattr(self, "_f", None) is not None:
                self._f.close()
            raise OutputError(f"cannot write {self.path} ({type(exc).__name__}: {exc})") from exc

    def write(self, record: dict[str, Any]) -> None:
        try:
            self._w.writerow(_cells(record))
            self._f.flush()
        except OSError as exc:
            raise OutputError(f"cannot write {self.path} ({type(exc).__name__}: {exc}); free disk space") from exc

    def flush(self) -> None:
        """Nothing to do: every row is flushed as it is written (and the file is rebuilt on resume)."""

    def close(self) -> None:
        try:
            self._f.close()
        except OSError as exc:
            log.warning("closing %s: %s", self.path, exc)


def _cells(record: dict[str, Any]) -> dict[str, Any]:
    return {k: ("" if v is None else v) for k, v in record.items() if not isinstance(v, (dict, list))}


class TensorBoardSink:
    """TensorBoard event files in ``folder``: scalars of the step and epoch records at their step.

    ``purge_step``: a resumed run's first step. The killed run may have logged steps past its
    checkpoint, which the resumed run logs again; TensorBoard drops the earlier events from that
    step on (tensorboardX's ``purge_step``, as PyTorch's SummaryWriter and Lightning do). An epoch
    record sits at the step count after its epoch, which is the resumed run's first step: the records
    of ``jsonl`` (the run's ``metrics.jsonl``, already cut back to the checkpoint) from the purge step
    on are written again, so that the epoch the checkpoint ends keeps its point.
    """

    def __init__(self, folder: Path, purge_step: int | None = None, jsonl: Path | None = None) -> None:
        try:
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import Event, SessionLog
            from tensorboardX.summary import scalar
        except ImportError as exc:
            raise ConfigError(
                "logger=tensorboard needs tensorboardX (pip install -e '.[tensorboard]'), or use logger=none"
            ) from exc
        self._event, self._scalar = Event, scalar
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        # tensorboardX names the file events.out.tfevents.<second>.<host><suffix>, and TensorBoard reads a
        # folder's files in the order of their names (a step lower than one read before drops the points
        # above it): the suffix keeps two files of one second apart and in the order they were opened
        suffix = f".{time.time_ns():020d}.{os.getpid()}"
        self.events = EventsWriter(str(self.folder / "events"), filename_suffix=suffix)
        if purge_step is not None:  # what SummaryWriter(purge_step=) writes: TensorBoard drops the points from here
            now = time.time()
            self.events.write_event(Event(wall_time=now, step=purge_step, file_version="brain.Event:2"))
            start = SessionLog(status=SessionLog.START)
            self.events.write_event(Event(wall_time=now, step=purge_step, session_log=start))
        jsonl = self.folder.parent / METRICS if jsonl is None else Path(jsonl)
        if purge_step is not None and jsonl.is_file():
            for record in read_metrics(jsonl):
                if (record.get("step") or 0) >= purge_step:
                    self.write(record)

    def flush(self) -> None:
        """Every record written so far on disk; the loop calls this before it writes ``last.npz``.

        A run killed after that checkpoint resumes from it and purges from its step: whatever the event
        file lacks below that step would be lost for good. The events are written as they come, into one
        file a run (tensorboardX's ``SummaryWriter`` queues them for a thread of its own, whose ``flush``
        writes only what that thread has taken, and whose ``close`` ends the file), so a flush of the
        file is all it takes.
        """
        self.events.flush()

    def write(self, record: dict[str, Any]) -> None:
        kind, step = record.get("kind"), record.get("step")
        if kind not in ("step", "epoch") or step is None:
            return
        prefix = "epoch/" if kind == "epoch" else ""
        for key, value in record.items():
            scalar = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if scalar and ("/" in key or key in ("lr", "loss_scale", "samples_per_s")):
                summary = self._scalar(prefix + key, value)
                self.events.write_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        self.events.close()
