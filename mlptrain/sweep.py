"""A multirun's table: ``summary.md`` and ``summary.csv`` in the sweep folder, one row per job.

``python -m mlptrain -m optimizer.lr=0.01,0.05 model.hidden=[128],[256]`` runs four jobs; when the
last one ends, :class:`SweepSummary` (a Hydra callback listed in ``conf/config.yaml``) reads every
job folder of the sweep (its ``.hydra/overrides.yaml`` and the summary record of its
``metrics.jsonl``) and writes the table: the overrides that differ between the jobs (those they
share above it), the best checkpoint's metric and test scores, the last epoch's test scores and the
time. A job that did not finish has a row too, with its status. ``write_summary(sweep_dir)``
makes the same table from Python.
"""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from mlptrain.files import atomic_write
from mlptrain.metrics import read_metrics

log = logging.getLogger(__name__)

COLUMNS = ["job", "overrides", "status", "best metric", "best", "best epoch", "best test acc", "best test loss",
           "test acc", "test loss", "epochs", "wall s"]  # fmt: skip


class SweepSummary(Callback):
    """Writes the sweep's table when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if sweep_dir.is_dir():
            try:
                write_summary(sweep_dir)
            except OSError as exc:
                log.warning("could not write the sweep's summary in %s (%s)", sweep_dir, exc)


def job_row(job: Path) -> dict[str, Any]:
    """The row of one job folder."""
    overrides_file = job / ".hydra" / "overrides.yaml"
    overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
    row: dict[str, Any] = {"job": job.name, "overrides": list(overrides or []), "status": "did not start"}
    metrics = job / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else []
    if records:
        row["status"] = {"summary": "finished", "interrupted": "interrupted"}.get(records[-1]["kind"], "stopped")
    summary = records[-1] if records and records[-1]["kind"] == "summary" else {}
    best = summary.get("best") or {}
    row.update({
        "best metric": best.get("metric"), "best": best.get("value"),
        "best epoch": None if best.get("epoch") is None else best["epoch"] + 1,
        "best test acc": summary.get("best/test/acc"), "best test loss": summary.get("best/test/loss"),
        "test acc": summary.get("test/acc"), "test loss": summary.get("test/loss"),
        "epochs": summary.get("epochs"), "wall s": summary.get("wall_s"),
    })  # fmt: skip
    if "stopped_early" in summary:
        row["status"] = f"stopped early (epoch {summary['stopped_early'] + 1})"
    return row


def write_summary(sweep_dir: Path) -> list[dict[str, Any]]:
    """Write ``summary.md`` and ``summary.csv`` for the job folders of ``sweep_dir``; returns the rows."""
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
    md = [f"# Sweep {Path(sweep_dir).name}: {len(rows)} jobs", "",
          f"Every job: {' '.join(common) or 'no common overrides'}", "",
          "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]  # fmt: skip
    md += ["| " + " | ".join(_cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    atomic_write(Path(sweep_dir) / "summary.md", "\n".join(md) + "\n")
    log.info("sweep summary: %s (%d jobs)", Path(sweep_dir) / "summary.md", len(rows))
    return rows


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4f}" if isinstance(v, float) else str(v)
