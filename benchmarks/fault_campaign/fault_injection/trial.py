"""One trial of a CLI scenario: a run from its start to its end, interrupted at random, resumed, compared.

A trial starts the run, interrupts it at a random moment with a random signal, and continues it (with
the run directory alone once it was accepted, else afresh) until an attempt finishes; after ``budget``
interruptions the attempts run to their end. Every attempt is checked (exit status, one line, a
``last.npz`` that loads); after a SIGKILL in a ``COUNTED`` scenario (a checkpoint after every step) the
steps lost are measured (:func:`runs.steps_lost`). The finished run is compared with the uninterrupted
one bit for bit (:func:`check.compare`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fault_injection import check, runs
from mlptrain.base.errors import CheckpointError


@dataclass
class Trial:
    """What one trial needs: its scenario, the uninterrupted run, its random numbers and its log."""

    scenario: str
    reference: Path
    final_epoch: int
    rng: np.random.Generator
    span: float = 0.5  # the "training" moment: a random wait up to this many seconds once training
    budget: int = 1_000_000  # interruptions this trial may still make
    log: list[dict[str, Any]] = field(default_factory=list)

    @property
    def moments(self) -> list[str]:
        return runs.STEP_MOMENTS if self.scenario in runs.COUNTED else runs.MOMENTS


def reach(trial: Trial, proc: Any, run: Path, moment: str, before: Any) -> bool:
    """Wait until the attempt ``proc`` reaches ``moment``; False if it ended first."""
    if moment == "start-up":  # Python, Hydra and the data still loading, or the run being checked
        runs.wait_for_handlers(proc)
        time.sleep(float(trial.rng.uniform(0.0, 1.0)))
        return proc.poll() is None
    if not runs.wait_for_training(proc, run, before):
        return False
    if moment == "checkpoint write":
        if trial.scenario in runs.COUNTED:  # a checkpoint every step: a write at a random moment, not the first
            time.sleep(float(trial.rng.uniform(0.0, trial.span)))
        return runs.wait_for_temp_file(proc, run)
    if moment in ("last epoch", "summary"):
        return runs.wait_for_record(proc, run, trial.final_epoch, "step" if moment == "last epoch" else "epoch")
    time.sleep(float(trial.rng.uniform(0.0, trial.span)))
    return proc.poll() is None


def attempt(trial: Trial, run: Path, config: list[str] | None, resume: bool) -> str:
    """One start of the run (``config=None``: the sweep), interrupted at a random moment while the
    trial's budget lasts: ``finished``, ``interrupted`` or ``failed``."""
    sig = str(trial.rng.choice(list(runs.SIGNALS)))
    moment = str(trial.rng.choice(trial.moments))
    before = runs.run_record_stamp(run)
    proc = runs.start(run, config, resume)
    hit = trial.budget > 0 and reach(trial, proc, run, moment, before)
    if hit:
        proc.send_signal(runs.SIGNALS[sig])
        trial.budget -= 1
    out, err = proc.communicate(timeout=300)
    entry: dict[str, Any] = {
        "scenario": trial.scenario,
        "signal": sig if hit else None,
        "moment": moment if hit else None,
        "exit": proc.returncode,
    }
    trial.log.append(entry)
    # a signal that arrives once the run has printed its summary line finds nothing left to stop
    summary_printed = " steps in " in (out.strip().splitlines() or [""])[-1] and config is not None
    if proc.returncode == 0 or (hit and proc.returncode in runs.EXPECTED[sig] and summary_printed):
        entry["finished"] = True
        return "finished"
    if hit and sig == "SIGKILL" and moment != "start-up" and trial.scenario in runs.COUNTED:
        entry.update(runs.steps_lost(run))
    entry["problems"] = problems(run, config, sig, hit, proc.returncode, out, err)
    return "interrupted" if hit and proc.returncode in runs.EXPECTED[sig] else "failed"


def problems(run: Path, config: list[str] | None, sig: str, hit: bool, code: int, out: str, err: str) -> list[str]:
    """What is wrong with an attempt that did not finish: its exit status, its last line, its ``last.npz``."""
    found = []
    if not hit or code not in runs.EXPECTED[sig]:
        found.append(f"exit {code}, expected {sorted(runs.EXPECTED[sig]) if hit else [0]}: {err[-2000:]}")
    last_line = (err.strip().splitlines() or [""])[-1]
    if sig != "SIGKILL" and ("Traceback" in out + err or not last_line.startswith(("mlptrain: ", "error: stopped by"))):
        found.append(f"exit {code}, not one line: {out[-1000:]} {err[-2000:]}")
    if config is not None and sig != "SIGKILL" and "continue with: python -m mlptrain " in last_line:
        if f"hydra.run.dir={run} resume=last" not in last_line:
            found.append(f"the command to continue is not the run directory alone: {last_line}")
    try:
        for job in [run, *run.glob("*/")]:
            runs.state(job, "last")
    except CheckpointError as exc:
        found.append(f"last.npz does not load: {exc}")
    return found


def finish(trial: Trial, run: Path, config: list[str]) -> str | None:
    """Continue ``run`` until it finishes (each start interrupted at random): with the run directory
    alone once it was accepted (``run.json``), else afresh. Returns a problem, or None."""
    outcome, resume = "", (run / "run.json").exists()
    while outcome != "finished":
        outcome = attempt(trial, run, config, resume)
        if outcome == "failed":
            return f"{run}: an attempt failed: {trial.log[-1]}"
        # killed before its run was accepted (no run.json): there is no run to resume, start it afresh
        resume = (run / "run.json").exists()
    return None


def one_run(trial: Trial, run: Path) -> tuple[list[str], list[bool]]:
    """The trial of ``run`` (a sweep: its jobs) from its start to its end, compared with the reference:
    its problems and, with TensorBoard, whether it would show the same scalars."""
    if trial.scenario != "sweep":
        run.mkdir()
        problem = finish(trial, run, runs.SCENARIOS[trial.scenario])
        if problem:
            return [problem], []
        found, tb = check.compare(run, trial.reference)
        return found, [] if tb is None else [tb]
    if attempt(trial, run, None, False) == "failed":
        return [f"{run}: the sweep failed: {trial.log[-1]}"], []
    found = []
    for job in range(2):  # the jobs' folders: hydra.sweep.subdir=<job number>; job n has seed=n
        job_run = run / str(job)
        job_run.mkdir(parents=True, exist_ok=True)
        records = runs.records(job_run) if (job_run / "metrics.jsonl").exists() else []
        done = (records[-1:] or [{}])[0].get("kind") == "summary"
        problem = None if done else finish(trial, job_run, [*runs.SCENARIOS["sweep"], f"seed={job}"])
        found += [problem] if problem else check.compare(job_run, trial.reference / str(job))[0]
    return found, []
