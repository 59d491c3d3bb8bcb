"""Starting ``python -m mlptrain`` runs and watching them: the moments a campaign interrupts them at.

The scenarios are configs of one run (``SCENARIOS``); a run is started afresh, resumed with its run
directory alone, or (``config=None``) run as the sweep. The waits return when the run reaches a moment
(its own code running, training, a checkpoint's temporary file, a record of its final epoch) or ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.run import checkpoint

REPO = Path(__file__).resolve().parents[3]  # benchmarks/fault_campaign/fault_injection/runs.py

CONFIG = ["device=cpu", "progress=false", "model.hidden=[256,256]", "epochs=6", "checkpoint_steps=5", "log_every=5"]
# a checkpoint after every step, every step logged: steps lost to a SIGKILL are counted from metrics.jsonl
CKPT1 = [*CONFIG[:3], "epochs=6", "checkpoint_steps=1", "log_every=1"]
STREAM_FILE = "digits.npz"  # written into the campaign's folder: an uncompressed NPZ, memory-mapped
SCENARIOS = {
    "plain": CONFIG,
    "early stopping": [*CONFIG[:3], "epochs=12", "early_stopping.patience=2", *CONFIG[4:]],
    "tensorboard": [*CONFIG, "logger=tensorboard"],
    "sweep": CONFIG,  # run as -m seed=0,1
    "ckpt1": CKPT1,
    "fp8": [*CKPT1, "precision=fp8"],  # the CPU's emulation of FP8
    "stream": [*CKPT1, "data=file", f"data.path={STREAM_FILE}", "data.residency=stream"],
}
# the scenarios whose lost steps are counted (a checkpoint after every step)
COUNTED = {"ckpt1", "fp8", "stream"}
SWEEP = ["seed=0,1"]
MOMENTS = ["start-up", "training", "training", "checkpoint write", "checkpoint write", "last epoch", "summary"]
# with a checkpoint after every step: mostly a random moment of training, and a write after a random wait
STEP_MOMENTS = ["start-up", "training", "training", "training", "checkpoint write", "checkpoint write", "last epoch"]
TIMING = ("samples_per_s", "step_time_ms", "time_s", "wall_s")
SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}
EXPECTED = {"SIGINT": {130}, "SIGTERM": {143}, "SIGKILL": {-9}}


def start(run: Path, config: list[str] | None, resume: bool) -> subprocess.Popen[str]:
    """``python -m mlptrain`` into ``run``: ``config`` afresh; a resume with the run directory alone (its
    settings are in its checkpoint); ``config=None`` with ``run`` a sweep folder: the sweep."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HYDRA_FULL_ERROR", None)
    if config is None:
        args = ["-m", *SCENARIOS["sweep"], *SWEEP, f"hydra.sweep.dir={run}", "hydra.sweep.subdir=${hydra.job.num}"]
    elif resume:
        args = [f"hydra.run.dir={run}", "resume=last", "device=cpu", "progress=false"]
    else:
        args = [*config, f"hydra.run.dir={run}"]
    return subprocess.Popen(
        [sys.executable, "-m", "mlptrain", *args],
        cwd=run.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def records(run: Path) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def state(run: Path, name: str) -> tuple[Any, dict[str, np.ndarray]] | None:
    path = run / "checkpoints" / f"{name}.npz"
    if not path.exists():
        return None
    ckpt = checkpoint.load(path)
    return ckpt.meta["position"], ckpt.arrays


def run_record_stamp(run: Path) -> tuple[int, ...] | None:
    """When the run.json files under ``run`` were last written (a sweep: of every job), or None."""
    stamps = []
    for record in [run / "run.json", *run.glob("*/run.json")]:
        try:
            stamps.append(record.stat().st_mtime_ns)
        except FileNotFoundError:
            pass
    return tuple(stamps) or None


def final_records(run: Path) -> list[dict[str, Any]]:
    """The metrics records under ``run`` (a sweep: of every job), as far as they are written."""
    out = []
    for path in [run / "metrics.jsonl", *run.glob("*/metrics.jsonl")]:
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written
                pass
    return out


def wait_for_handlers(proc: subprocess.Popen[str], timeout: float = 10) -> None:
    """Wait until the process runs mlptrain's own code (its SIGTERM handler is installed, as Linux's
    ``/proc/<pid>/status`` shows). Before that the interpreter itself is starting, and a Ctrl-C there
    is Python's KeyboardInterrupt, which no program can catch: not a moment the campaign can hold
    mlptrain to. Elsewhere than Linux, no wait."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            return
        caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), None)
        if caught is None or (int(caught, 16) >> (signal.SIGTERM - 1)) & 1:
            return
        time.sleep(0.002)


def wait_for_training(proc: subprocess.Popen[str], run: Path, before: int | None, timeout: float = 60) -> bool:
    """Until this attempt was accepted and trains (it rewrote run.json); False if it ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        stamp = run_record_stamp(run)
        if stamp is not None and stamp != before:
            return True
        time.sleep(0.002)
    raise RuntimeError("the run did not start training in time")


def wait_for_temp_file(proc: subprocess.Popen[str], run: Path, timeout: float = 30) -> bool:
    """Until a checkpoint's temporary file exists (a write in progress); False if the run ended first."""
    folders = [run / "checkpoints", *run.glob("*/checkpoints")]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        for folder in folders:
            try:
                if any(e.name.endswith(".tmp") for e in os.scandir(folder)):
                    return True
            except FileNotFoundError:
                pass
        if not folders[1:]:
            folders = [run / "checkpoints", *run.glob("*/checkpoints")]
        time.sleep(0.0002)
    return False


def wait_for_record(proc: subprocess.Popen[str], run: Path, final_epoch: int, kind: str, timeout: float = 60) -> bool:
    """Until a ``kind`` record (``step`` or ``epoch``) of the final epoch is written: the last epoch is
    training, or (an epoch record) the summary is being made. False if the run ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if any(r.get("kind") == kind and r.get("epoch") == final_epoch for r in final_records(run)):
            return True
        time.sleep(0.002)
    return False


def write_stream_table(root: Path) -> Path:
    """The ``stream`` scenario's table: digits as an uncompressed NPZ in ``root`` (its ``x`` memory-mapped
    where it lies in the zip), named in the scenario's config by its absolute path."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    path = root / STREAM_FILE
    np.savez(path, x=digits.data.astype(np.float32), y=digits.target.astype(np.int64))  # x (1797, 64)
    SCENARIOS["stream"] = [f"data.path={path}" if s.startswith("data.path=") else s for s in SCENARIOS["stream"]]
    return path


def steps_lost(run: Path) -> dict[str, int]:
    """After a SIGKILL: the steps the run had done by its own account (its last step record in
    ``metrics.jsonl``, written and flushed after each step with ``log_every=1``), the step of the
    ``last.npz`` that survived (0 without one), and the difference: the steps lost."""
    done = 0
    for record in final_records(run):
        if record.get("kind") == "step":
            done = max(done, int(record["step"]) + 1)  # a step record's step counts from 0
    kept = state(run, "last")
    at = 0 if kept is None else int(kept[0]["step"])
    return {"done": done, "kept": at, "lost": done - at}
