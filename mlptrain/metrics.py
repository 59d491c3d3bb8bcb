"""Metrics records: ``metrics.jsonl`` in the run directory, one JSON object per line.

Each record is flushed as it is written, so a crash leaves a readable prefix. Non-finite floats
are written as ``null`` with their keys listed under ``"nonfinite"`` (``NaN`` is not JSON).

Record kinds (the ``kind`` key):

* ``step``: one per optimizer step: ``step``, ``epoch``, ``train/loss``, ``train/acc`` (of the
  batch), ``lr``, ``loss_scale``, ``skipped``; the last step of each log interval also carries
  ``samples_per_s`` and ``step_time_ms`` measured over the interval.
* ``epoch``: ``epoch``, ``step``, ``train/loss``, ``train/acc`` (means over the epoch),
  ``val/loss``, ``val/acc``, ``test/loss``, ``test/acc``, ``time_s``.
* ``summary``: the final numbers of the run.
* ``interrupted``: Ctrl-C stopped the run at ``step``; ``checkpoint`` is where ``last`` was saved.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


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


class MetricsWriter:
    """Append-only JSONL writer. ``append=True`` continues an existing file (resume)."""

    def __init__(self, path: Path, append: bool = False) -> None:
        self.path = Path(path)
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, **record: Any) -> None:
        self._f.write(json.dumps(_clean(record), allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

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
