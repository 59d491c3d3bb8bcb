"""Random interruption campaign: kill a training run at random moments, resume it, compare bit for bit.

Each campaign trains one run through ``python -m mlptrain`` (CPU, digits) into a fresh directory and
interrupts it again and again with SIGINT, SIGTERM or SIGKILL, at one of three moments: while
Python, Hydra and the data are still loading ("start-up", from the moment mlptrain's own code runs:
a signal during the interpreter's own start is Python's KeyboardInterrupt), at a random moment of training, or the
moment a checkpoint's temporary file appears (mid-write). Then it continues the run with
``resume=last`` (afresh, if it was stopped before its run started) until it finishes. Every
attempt is checked: the exit status is the promised one (130 for SIGINT, 143 for SIGTERM, killed
for SIGKILL), a stop request ends with one line and no traceback, and ``checkpoints/last.npz``
(when there is one) loads. At the end the run must equal an uninterrupted run of the same config
bit for bit: every ``metrics.jsonl`` record (timing keys aside), and the arrays and positions of
``last.npz`` and ``best.npz``; no ``.tmp`` or ``.corrupt`` file may be left.

Usage: python scripts/fault_campaign.py [--interruptions 100] [--seed 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mlptrain import checkpoint  # noqa: E402
from mlptrain.errors import CheckpointError  # noqa: E402

CONFIG = ["device=cpu", "progress=false", "model.hidden=[256,256]", "epochs=6", "checkpoint_steps=5", "log_every=5"]
TIMING = ("samples_per_s", "step_time_ms", "time_s", "wall_s")
SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}
EXPECTED = {"SIGINT": {130}, "SIGTERM": {143}, "SIGKILL": {-9}}


def start(run: Path, resume: bool) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HYDRA_FULL_ERROR", None)
    args = [sys.executable, "-m", "mlptrain", *CONFIG, f"hydra.run.dir={run}", *(["resume=last"] if resume else [])]
    return subprocess.Popen(args, cwd=run.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def records(run: Path) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def state(run: Path, name: str) -> tuple[Any, dict[str, np.ndarray]] | None:
    path = run / "checkpoints" / f"{name}.npz"
    if not path.exists():
        return None
    ckpt = checkpoint.load(path)
    return ckpt.meta["position"], ckpt.arrays


def run_record_stamp(run: Path) -> int | None:
    try:
        return (run / "run.json").stat().st_mtime_ns
    except FileNotFoundError:
        return None


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
    folder = run / "checkpoints"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if any(e.name.endswith(".tmp") for e in os.scandir(folder)):
                return True
        except FileNotFoundError:
            pass
        time.sleep(0.0002)
    return False


def attempt(run: Path, resume: bool, rng: np.random.Generator, log: list[dict[str, Any]]) -> str:
    """One start of the run, interrupted at a random moment: ``finished``, ``interrupted`` or ``failed``."""
    sig = str(rng.choice(list(SIGNALS)))
    moment = str(rng.choice(["start-up", "training", "training", "checkpoint write", "checkpoint write"]))
    before = run_record_stamp(run)
    proc = start(run, resume)
    if moment == "start-up":  # Python, Hydra and the data still loading, or the run being checked
        wait_for_handlers(proc)
        time.sleep(float(rng.uniform(0.0, 1.0)))
        hit = proc.poll() is None
    else:
        hit = wait_for_training(proc, run, before)
    if hit and moment == "checkpoint write":
        hit = wait_for_temp_file(proc, run)
    elif hit and moment == "training":
        time.sleep(float(rng.uniform(0.0, 0.5)))
        hit = proc.poll() is None
    if hit:
        proc.send_signal(SIGNALS[sig])
    out, err = proc.communicate(timeout=120)
    entry = {"signal": sig if hit else None, "moment": moment if hit else None, "exit": proc.returncode}
    # a signal that arrives once the run has printed its summary line finds nothing left to stop
    summary_printed = " steps in " in (out.strip().splitlines() or [""])[-1]
    if proc.returncode == 0 or (proc.returncode in EXPECTED[sig] and summary_printed):
        entry["finished"] = True
        log.append(entry)
        return "finished"
    problems = []
    if not hit or proc.returncode not in EXPECTED[sig]:
        problems.append(f"exit {proc.returncode}, expected {sorted(EXPECTED[sig])}: {err[-2000:]}")
    last_line = (err.strip().splitlines() or [""])[-1]
    if sig != "SIGKILL" and ("Traceback" in out + err or not last_line.startswith(("mlptrain: ", "error: stopped by"))):
        problems.append(f"exit {proc.returncode}, not one line: {out[-1000:]} {err[-2000:]}")
    try:
        state(run, "last")
    except CheckpointError as exc:
        problems.append(f"last.npz does not load: {exc}")
    entry["problems"] = problems
    log.append(entry)
    return "interrupted" if hit and proc.returncode in EXPECTED[sig] else "failed"


def campaign(root: Path, reference: Path, rng: np.random.Generator, log: list[dict[str, Any]]) -> list[str]:
    run = root / f"run{len(list(root.glob('run*')))}"
    run.mkdir()
    outcome, resume = "", False
    while outcome != "finished":
        outcome = attempt(run, resume, rng, log)
        if outcome == "failed":
            return [f"{run}: an attempt failed: {log[-1]}"]
        # killed before its run was accepted (no run.json): there is no run to resume, start it afresh
        resume = (run / "run.json").exists()
    problems = []
    if records(run) != records(reference):
        problems.append(f"{run}: metrics.jsonl differs from the uninterrupted run's")
    for name in ("last", "best"):
        a, b = state(run, name), state(reference, name)
        same = a is not None and b is not None and a[0] == b[0] and a[1].keys() == b[1].keys()
        if not same or not all(np.array_equal(a[1][k], b[1][k]) for k in b[1]):
            problems.append(f"{run}: {name}.npz differs from the uninterrupted run's")
    if (run / "metrics.jsonl.corrupt").exists() or list(run.rglob("*.tmp")):
        problems.append(f"{run}: a .corrupt or .tmp file is left")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interruptions", type=int, default=100, help="stop after at least this many")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for campaign.json and campaign.md")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    root = Path(tempfile.mkdtemp(prefix="mlptrain-faults-"))
    reference = root / "reference"
    reference.mkdir()
    proc = start(reference, resume=False)
    out, err = proc.communicate(timeout=300)
    if proc.returncode != 0:
        print(out + err, file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    log: list[dict[str, Any]] = []
    problems: list[str] = []
    campaigns = 0
    while sum(e["signal"] is not None for e in log) < args.interruptions:
        problems += campaign(root, reference, rng, log)
        campaigns += 1
        print(f"campaign {campaigns}: {sum(e['signal'] is not None for e in log)} interruptions so far", flush=True)
    problems += [p for e in log for p in e.get("problems", [])]
    counts = collections.Counter((e["signal"], e["moment"]) for e in log if e["signal"])
    exits = collections.Counter(e["exit"] for e in log)
    lines = [
        f"Command: `python scripts/fault_campaign.py --interruptions {args.interruptions} --seed {args.seed}`; "
        f"config `{' '.join(CONFIG)}`; {campaigns} runs, {len(log)} starts, "
        f"{sum(counts.values())} interruptions in {time.perf_counter() - t0:.0f} s.",
        "",
        "| signal | moment | interruptions |",
        "|---|---|---|",
        *[f"| {s} | {m} | {n} |" for (s, m), n in sorted(counts.items())],
        "",
        f"Exit statuses: {dict(sorted(exits.items()))}.",
        f"Every run equal to the uninterrupted run bit for bit (metrics records, last.npz, best.npz): "
        f"{'yes' if not problems else 'NO'}; problems: {len(problems)}.",
    ]
    print("\n".join(lines))
    for p in problems:
        print("PROBLEM:", p)
    if args.out:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "campaign.md").write_text("\n".join(lines) + "\n")
        (out_dir / "campaign.json").write_text(json.dumps({"log": log, "problems": problems}, indent=1) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
