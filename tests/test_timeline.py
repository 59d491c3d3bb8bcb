"""Where a run's wall clock goes (mlptrain.base.timeline, #31): the phases in run.json, and what they add up to."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlptrain.base.timeline import Timeline, active, mark, part, timed
from mlptrain.run.run import train
from tests.helpers import make_cfg
from tests.test_cli import QUICK, output, run_cli

# The phases of python -m mlptrain, in the order they end (mlptrain/base/timeline.py's docstring).
CLI_PHASES = ["python", "imports", "config", "backend", "data", "model", "bgrad", "accept", "loop"]


class Clock:
    """A ``time.perf_counter`` that moves only when told: the timeline's arithmetic without sleeping."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr("mlptrain.base.timeline.time.perf_counter", c)
    return c


def test_phases_add_up_to_the_total_and_a_phase_marked_again_adds(clock: Clock) -> None:
    t = Timeline()
    clock.now += 2.0
    assert t.mark("a") == 2.0
    t.skip()  # what passes now belongs to no phase
    clock.now += 3.0
    t.skip()
    clock.now += 1.0
    t.mark("b")
    clock.now += 0.5
    t.mark("a")  # a multirun's second job: the phase grows
    rec = t.record()
    assert rec["phases_s"] == {"a": 2.5, "b": 1.0}
    assert rec["total_s"] == 6.5  # the skipped 3 s are in the total only
    assert rec["from_process_start"] is False
    assert Timeline(start=90.0).record()["from_process_start"] is True


def test_the_loops_parts_leave_training_as_the_rest(clock: Clock) -> None:
    t = Timeline()
    with active(t):
        with timed("evaluate"):
            clock.now += 2.0
        part("save", 1.0)
        part("save", 0.5)
        clock.now += 4.0
        mark("loop")
    mark("after")  # no timeline active: nothing
    part("save", 9.0)
    rec = t.record()
    assert rec["phases_s"] == {"loop": 6.0}
    assert rec["loop_s"] == {"evaluate": 2.0, "save": 1.5, "training": 2.5}
    assert t.describe() == "6.00 s: loop 6.00 s (evaluate 2.00 s, save 1.50 s, training 2.50 s)"


def check_phases(timeline: dict, phases: list[str]) -> None:
    """``phases`` in order, each non-negative, adding up to the total; the loop's parts adding up to the loop."""
    assert list(timeline["phases_s"]) == phases, timeline
    assert all(v >= 0 for v in timeline["phases_s"].values())
    assert sum(timeline["phases_s"].values()) == pytest.approx(timeline["total_s"], abs=2e-3)
    loop = timeline["loop_s"]
    assert set(loop) <= {"first steps", "evaluate", "save", "training"} and {"evaluate", "save", "training"} <= set(
        loop
    )
    assert sum(loop.values()) == pytest.approx(timeline["phases_s"]["loop"], abs=2e-3)
    assert loop["evaluate"] > 0 and loop["save"] > 0  # an epoch's evaluation and its checkpoints


def test_a_cli_run_records_its_phases_from_the_process_start(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    proc = run_cli(*QUICK, "data=digits", "hydra.run.dir=run", cwd=tmp_path)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, output(proc)
    timeline = json.loads((tmp_path / "run" / "run.json").read_text())["timeline"]
    check_phases(timeline, CLI_PHASES)
    assert timeline["from_process_start"] is (sys.platform == "linux")
    assert timeline["total_s"] < wall  # the process started after this test's clock did, and ended before it stopped
    assert any(line.startswith("[") and "time: " in line for line in proc.stderr.splitlines()), proc.stderr


def test_a_multiruns_second_job_starts_a_timeline_of_its_own(tmp_path: Path) -> None:
    proc = run_cli("-m", *QUICK, "data=digits", "seed=1,2", f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    jobs = [next((tmp_path / "sweep").glob(f"*seed={s}")) / "run.json" for s in (1, 2)]  # Hydra's override dirnames
    first, second = (json.loads(job.read_text())["timeline"] for job in jobs)
    check_phases(first, CLI_PHASES)
    check_phases(second, CLI_PHASES[2:])  # no interpreter, no imports: the first job paid them
    assert second["from_process_start"] is False


def test_train_from_python_times_from_its_call(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    train(make_cfg(epochs=1), tmp_path / "run")
    took = time.perf_counter() - t0
    timeline = json.loads((tmp_path / "run" / "run.json").read_text())["timeline"]
    check_phases(timeline, CLI_PHASES[3:])  # no interpreter, imports or Hydra config: the caller's
    assert timeline["from_process_start"] is False and timeline["total_s"] <= took


def test_the_process_start_is_before_the_interpreter_runs_any_line() -> None:
    """/proc/self/stat's start time, in this clock: a child that sleeps before importing mlptrain sees it."""
    if sys.platform != "linux":
        pytest.skip("the process start is read from /proc (Linux)")
    code = (
        "import time; time.sleep(0.3); from mlptrain.base.timeline import PROCESS; "
        "print(PROCESS.from_process_start, time.perf_counter() - PROCESS.start)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "True"
    assert 0.3 <= float(out[1]) < 5.0  # the sleep and the interpreter's start-up, at 10 ms ticks
