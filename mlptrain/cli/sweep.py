"""A multirun's table: ``summary.md`` and ``summary.csv`` in the sweep folder, one row per job.

``python -m mlptrain -m optimizer.lr=0.01,0.05 model.hidden=[128],[256]`` runs four jobs; when the
last one ends, :class:`SweepSummary` (a Hydra callback listed in ``conf/config.yaml``) reads every
job folder of the sweep (its ``.hydra/overrides.yaml`` and the summary record of its
``metrics.jsonl``) and writes the table: the overrides that differ between the jobs (those they
share above it), the best checkpoint's metric and test scores, the last epoch's test scores and the
time. A job that did not finish has a row too, with its status; a job that failed with an error
(:func:`record_failure`: a refused config, a run stopped by inf/NaN) is ``failed``, and its message is
listed under the table. ``write_summary(sweep_dir)`` makes the same table from Python.

The table is made from the job folders alone, so it is the same whichever launcher ran the jobs and
in whatever order they ended: Hydra's basic launcher (one after the other, in this process) or its
joblib launcher (``hydra/launcher=joblib``: in parallel processes, docs/sweeps.md).

Job folders are named by :func:`job_folder` (``hydra.sweep.subdir`` in ``conf/config.yaml``): the
job's overrides, one path component whatever their values hold (``data.path=data/a.csv`` does not
nest folders, ``..`` does not climb out of the sweep), and without ``resume``, so that the same sweep
run again with ``resume=last`` continues every job in its own folder.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from mlptrain.base.fs import atomic_write
from mlptrain.config.schema import TrainConfig
from mlptrain.config.shell import command, override
from mlptrain.run.metrics import read_metrics

log = logging.getLogger(__name__)

COLUMNS = [
    "job",
    "overrides",
    "status",
    "best metric",
    "best",
    "best epoch",
    "best test acc",
    "best test loss",
    "test acc",
    "test loss",
    "epochs",
    "wall s",
]


FAILED = "failed.json"  # in a job folder: the error that ended the job (record_failure)

# A file name holds at most 255 bytes on the usual file systems; a longer name keeps its start and a hash.
_NAME_MAX = 200


def job_folder(override_dirname: str) -> str:
    """A job's folder name from Hydra's ``override_dirname`` (``optimizer.lr=0.01,seed=1``), as one path
    component: ``/``, ``%``, spaces and other characters a path or a shell treats specially are
    percent-encoded (``data.path=data%2Fa.csv``), so two jobs never share a folder and none leaves the
    sweep's. ``no-overrides`` for a job without any.

    >>> job_folder("data.path=../a.csv,seed=1")
    'data.path=..%2Fa.csv,seed=1'
    """
    name = urllib.parse.quote(override_dirname, safe="=,+[]:@") or "no-overrides"
    if len(name) > _NAME_MAX:
        name = name[: _NAME_MAX - 17] + "-" + hashlib.sha256(name.encode()).hexdigest()[:16]
    return name


def register_resolvers() -> None:
    """``${mlptrain_job_folder:...}``, which ``hydra.sweep.subdir`` uses (:func:`job_folder`)."""
    OmegaConf.register_new_resolver("mlptrain_job_folder", lambda dirname: job_folder(str(dirname)), replace=True)


class SweepSummary(Callback):
    """Writes the sweep's table when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if sweep_dir.is_dir():
            try:
                write_summary(sweep_dir)
            except OSError as exc:
                log.warning("could not write the sweep's summary in %s (%s)", sweep_dir, exc)


def record_failure(job: Path, message: str, overrides: list[str]) -> None:
    """Keep the error that ended a job of a multirun in its folder (``failed.json``), so that the summary names the
    job wherever it ran: a job of the joblib launcher runs in another process, whose printed error the sweep's
    own process does not see. Hydra made the folder for the job; a refused job leaves it with this file alone."""
    try:
        atomic_write(job / FAILED, json.dumps({"error": message, "overrides": overrides}) + "\n")
    except OSError as exc:
        log.warning("could not record the job's failure in %s (%s)", job, exc)


def clear_failure(job: Path) -> None:
    """A job starts (again, with ``resume=last``): an earlier attempt's failure no longer stands."""
    (job / FAILED).unlink(missing_ok=True)


def failed_jobs(sweep_dir: Path) -> list[str]:
    """The job folders of ``sweep_dir`` that hold a failure (:func:`record_failure`)."""
    return sorted(p.name for p in _job_folders(Path(sweep_dir)) if (p / FAILED).is_file())


def _job_folders(sweep_dir: Path) -> list[Path]:
    """The folders of the jobs that started: Hydra's files (``.hydra/``), or a failure recorded before them."""
    return sorted(p for p in sweep_dir.iterdir() if p.is_dir() and ((p / ".hydra").is_dir() or (p / FAILED).is_file()))


def job_state(job: Path) -> str:
    """Where a job of a sweep run again with ``resume=last`` stands: ``finished`` (its summary is written:
    kept as it is), ``started`` (a ``last`` checkpoint to continue from) or ``new`` (it never got that far:
    it starts from the beginning, as Lightning does for ``ckpt_path="last"`` without a checkpoint)."""
    metrics = job / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    if records and records[-1]["kind"] == "summary":
        return "finished"
    return "started" if (job / "checkpoints" / "last.npz").is_file() else "new"


def resumed_job(config: TrainConfig, out_dir: Path) -> dict[str, Any] | None:
    """A job of a sweep run again with ``resume=last`` (:func:`job_state`): a finished job is kept (its summary
    returned), one that never saved a checkpoint starts afresh (``config.resume`` cleared), the others continue."""
    state = job_state(out_dir)
    if state == "finished":
        log.info("%s finished already: kept as it is (resume=last)", out_dir)
        return read_metrics(out_dir / "metrics.jsonl")[-1]
    if state == "new":
        log.info("%s has no checkpoint to resume: the job starts from the beginning", out_dir)
        config.resume = None
    return None


def stopped_sweep(sweep_dir: Path, argv: list[str]) -> None:
    """Write the summary of a sweep that a stop request ended, and say how to continue it (``argv``: the sweep's
    command line after ``python -m mlptrain``)."""
    again = continue_command(argv, sweep_dir.absolute())
    try:
        write_summary(sweep_dir, continue_with=again)
    except OSError as exc:
        log.warning("could not write the sweep's summary in %s (%s)", sweep_dir, exc)
    print(f"mlptrain: the sweep was stopped; continue every job with: {again}", file=sys.stderr, flush=True)


def continue_command(argv: list[str], sweep_dir: Path) -> str:
    """The sweep's own command line (``argv``: what followed ``python -m mlptrain``) with its folder and
    ``resume=last``: it continues every job where it stopped, each in its folder (:func:`job_folder`)."""
    kept = [a for a in argv if not a.startswith(("resume=", "hydra.sweep.dir=", "+resume="))]
    if not any(a in ("-m", "--multirun") for a in kept):
        kept.insert(0, "-m")
    return command(["python -m mlptrain"], kept) + " " + override("hydra.sweep.dir", str(sweep_dir)) + " resume=last"


def job_row(job: Path) -> dict[str, Any]:
    """The row of one job folder."""
    overrides_file = job / ".hydra" / "overrides.yaml"
    failure = _failure(job)
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else failure.get("overrides")
    overrides = [o for o in overrides or [] if not str(o).startswith("resume=")]  # a resumed sweep's jobs alike
    row: dict[str, Any] = {"job": job.name, "overrides": overrides, "status": "did not start"}
    metrics = job / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    if records:
        row["status"] = {"summary": "finished", "interrupted": "interrupted"}.get(records[-1]["kind"], "stopped")
    summary = records[-1] if records and records[-1]["kind"] == "summary" else {}
    best = summary.get("best") or {}
    row.update(
        {
            "best metric": best.get("metric"),
            "best": best.get("value"),
            "best epoch": best.get("epoch"),  # counted from 1, as metrics.jsonl counts epochs
            "best test acc": summary.get("best/test/acc"),
            "best test loss": summary.get("best/test/loss"),
            "test acc": summary.get("test/acc"),
            "test loss": summary.get("test/loss"),
            "epochs": summary.get("epochs"),
            "wall s": summary.get("wall_s"),
        }
    )
    if "stopped_early" in summary:
        row["status"] = f"stopped early (epoch {summary['stopped_early']})"
    if failure:
        row["status"], row["error"] = "failed", failure.get("error", "")
    return row


def _failure(job: Path) -> dict[str, Any]:
    """The failure recorded in ``job`` ({} when none, or when the file cannot be read: the row then says what the
    metrics say)."""
    try:
        record = json.loads((job / FAILED).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_summary(sweep_dir: Path, continue_with: str | None = None) -> list[dict[str, Any]]:
    """Write ``summary.md`` and ``summary.csv`` for the job folders of ``sweep_dir``; returns the rows.

    ``continue_with``: the sweep was stopped (Ctrl-C, SIGTERM); ``summary.md`` names the jobs that did not
    finish and gives this command to continue them."""
    rows = [job_row(j) for j in _job_folders(Path(sweep_dir))]
    # The overrides every job shares go above the table; each row shows what differs.
    lists = [r["overrides"] for r in rows]  # as Hydra recorded them (a value may hold spaces)
    common = [o for o in lists[0] if all(o in other for other in lists)] if rows else []
    for row, overrides in zip(rows, lists, strict=True):
        row["overrides"] = " ".join(o for o in overrides if o not in common)
    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows({k: ("" if r.get(k) is None else r[k]) for k in COLUMNS} for r in rows)
    atomic_write(Path(sweep_dir) / "summary.csv", text.getvalue())
    md = [
        f"# Sweep {Path(sweep_dir).name}: {len(rows)} jobs",
        "",
        f"Every job: {' '.join(common) or 'no common overrides'}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    md += ["| " + " | ".join(_cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    failed = [f"- {r['job']}: {r['error']}" for r in rows if r["status"] == "failed"]
    if failed:
        md += ["", f"**{len(failed)} failed:**", *failed]
    if continue_with is not None:
        unfinished = [f"{r['job']} ({r['status']})" for r in rows if r["status"] in ("interrupted", "stopped")]
        stopped = f"Not finished: {', '.join(unfinished) or 'none'}; the jobs after them had not started (no row)."
        md += ["", f"**The sweep was stopped.** {stopped}", "", f"Continue every job with: `{continue_with}`"]
    atomic_write(Path(sweep_dir) / "summary.md", "\n".join(md) + "\n")
    log.info("sweep summary: %s (%d jobs)", Path(sweep_dir) / "summary.md", len(rows))
    return rows


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4f}" if isinstance(v, float) else str(v)
