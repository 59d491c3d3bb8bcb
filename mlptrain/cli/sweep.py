"""A multirun's table: ``summary.md`` and ``summary.csv`` in the sweep folder, one row per job.

``python -m mlptrain -m optimizer.lr=0.01,0.05 model.hidden=[128],[256]`` runs four jobs; when the
last one ends, :class:`SweepSummary` (a Hydra callback listed in ``conf/config.yaml``) reads every
job folder of the sweep (its ``.hydra/overrides.yaml`` and the summary record of its
``metrics.jsonl``) and writes the table: the overrides that differ between the jobs (those they
share above it), the best checkpoint's metric and test scores, the last epoch's test scores and the
time. A job that did not finish has a row too, with its status. ``write_summary(sweep_dir)``
makes the same table from Python.

Job folders are named by :func:`job_folder` (``hydra.sweep.subdir`` in ``conf/config.yaml``): the
job's overrides, one path component whatever their values hold (``data.path=data/a.csv`` does not
nest folders, ``..`` does not climb out of the sweep), and without ``resume``, so that the same sweep
run again with ``resume=last`` continues every job in its own folder.
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import urllib.parse
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from mlptrain.base.fs import atomic_write
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


def job_state(job: Path) -> str:
    """Where a job of a sweep run again with ``resume=last`` stands: ``finished`` (its summary is written:
    kept as it is), ``started`` (a ``last`` checkpoint to continue from) or ``new`` (it never got that far:
    it starts from the beginning, as Lightning does for ``ckpt_path="last"`` without a checkpoint)."""
    metrics = job / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    if records and records[-1]["kind"] == "summary":
        return "finished"
    return "started" if (job / "checkpoints" / "last.npz").is_file() else "new"


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
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
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
    return row


def write_summary(sweep_dir: Path, continue_with: str | None = None) -> list[dict[str, Any]]:
    """Write ``summary.md`` and ``summary.csv`` for the job folders of ``sweep_dir``; returns the rows.

    ``continue_with``: the sweep was stopped (Ctrl-C, SIGTERM); ``summary.md`` names the jobs that did not
    finish and gives this command to continue them."""
    jobs = sorted(p for p in Path(sweep_dir).iterdir() if p.is_dir() and (p / ".hydra").is_dir())
    rows = [job_row(j) for j in jobs]
    # The overrides every job shares go above the table; each row shows what differs.
    lists = [r["overrides"] for r in rows]  # as Hydra recorded them (a value may hold spaces)
    common = [o for o in lists[0] if all(o in other for other in lists)] if rows else []
    for row, overrides in zip(rows, lists, strict=True):
        row["overrides"] = " ".join(o for o in overrides if o not in common)
    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
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
