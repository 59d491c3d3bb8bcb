"""benchmarks/probes/step_timeline.py: a profile's middle step, each kernel's start after the last update."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "step_timeline.py"


def _trace(path: Path, steps: int) -> None:
    """``steps`` steps of three kernels each, 1 us apart: a GEMM (stream 7), a weight gradient (stream 13, starting
    with the GEMM) and the update (stream 7), which starts 2 us after the GEMM ends."""

    def kernel(name: str, ts: float, dur: float, stream: int) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    events, t = [], 100.0
    for s in range(steps):
        events.append(kernel(f"gemm{s}", t, 5.0, 7))
        events.append(kernel(f"wgrad{s}", t, 3.0, 13))
        events.append({"ph": "X", "cat": "cpu_op", "name": "not a kernel", "ts": t, "dur": 50.0})
        events.append(kernel("mlptrain_adam_step_members", t + 7, 10.0, 7))
        events.append(kernel("mlptrain_end_step", t + 17, 0.5, 7))  # the step log's, not an update
        t += 20.0
    path.write_text(json.dumps({"traceEvents": events}))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True, check=False)


def test_the_middle_step_is_timed_from_the_last_update(tmp_path: Path) -> None:
    _trace(tmp_path / "t.json", steps=5)
    done = _run(str(tmp_path / "t.json"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "4 kernels in the middle step" in lines[0]
    rows = [line.split() for line in lines[1:5]]
    # step 2 of 0..4: the update before it ends at 100 + 20 + 17 = 137; the step log's kernel after it is the step's
    assert rows[0] == ["0.00", "0.50", "s7", "mlptrain_end_step"]
    assert rows[1] == ["3.00", "5.00", "s7", "gemm2"]
    assert rows[2] == ["3.00", "3.00", "s13", "wgrad2"]
    assert rows[3] == ["10.00", "10.00", "s7", "mlptrain_adam_step_members"]
    assert "span 20.00 us" in done.stdout
    assert "stream 7: 3 kernels, busy 15.50 us" in done.stdout


def test_a_trace_without_steps_is_refused_by_name(tmp_path: Path) -> None:
    _trace(tmp_path / "t.json", steps=2)
    done = _run(str(tmp_path / "t.json"))
    assert done.returncode != 0
    assert "found 2 optimizer updates" in done.stderr
