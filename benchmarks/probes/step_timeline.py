"""One training step's kernels on a timeline: when each starts, how long it runs, on which stream (#50).

Reads the profile timelines ``benchmarks/probes/member_kernels.py`` writes with ``MEMBER_TRACES=1``
(``trace-<case>.json``, Chrome's trace format from PyTorch's profiler) and prints, for the middle step of each (a step
ends where its optimizer update, the ``mlptrain_<optimizer>_step`` kernel, ends), every kernel as

    start (us after the last step's update ended)   duration (us)   stream   name

then each stream's busy time and the step's span. A gap on the first stream, where no kernel runs, is time the step
waits (on the other stream, or on the launch of a kernel); what runs back to back there is the step's critical path.
Runs on any machine (no GPU needed).

Usage: python benchmarks/probes/step_timeline.py TRACE.json [TRACE.json ...]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def kernels(path: Path) -> list[dict]:
    """The trace's kernel events, in start order: ``{"name", "ts", "dur", "stream"}`` (microseconds)."""
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            stream = e.get("args", {}).get("stream", e.get("tid"))
            out.append({"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"]), "stream": stream})
    return sorted(out, key=lambda k: k["ts"])


def is_update(name: str) -> bool:
    """The optimizer's update kernel (``mlptrain_sgd_step``, ``mlptrain_adam_step_members`` ...: ``mlptrain.step.optim``
    names it after the optimizer), not the step log's ``mlptrain_end_step``."""
    return re.fullmatch(r"mlptrain_[a-z0-9]+_step(_members)?", name) is not None and name != "mlptrain_end_step"


def middle_step(ks: list[dict]) -> list[dict]:
    """The kernels of the middle step: those starting after one update ends and up to the next update's end."""
    ends = [i for i, k in enumerate(ks) if is_update(k["name"])]
    if len(ends) < 3:
        raise ValueError(f"found {len(ends)} optimizer updates in the trace; expected a profile of several steps")
    mid = len(ends) // 2
    return ks[ends[mid - 1] + 1 : ends[mid] + 1]


def report(path: Path) -> None:
    ks = kernels(path)
    step = middle_step(ks)
    # the previous update's end (middle_step starts right after one)
    origin = max(k["ts"] + k["dur"] for k in ks if is_update(k["name"]) and k["ts"] + k["dur"] <= step[0]["ts"])
    print(f"== {path.name}: {len(step)} kernels in the middle step")
    streams: dict = {}
    for k in step:
        start = k["ts"] - origin
        streams.setdefault(k["stream"], []).append(k)
        print(f"  {start:8.2f} {k['dur']:7.2f}  s{k['stream']}  {k['name'][:90]}")
    end = max(k["ts"] + k["dur"] for k in step)
    print(f"  span {end - origin:.2f} us from the last update's end to this step's")
    for s, ks_s in streams.items():
        busy = sum(k["dur"] for k in ks_s)
        print(f"  stream {s}: {len(ks_s)} kernels, busy {busy:.2f} us")


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    for p in sys.argv[1:]:
        report(Path(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
