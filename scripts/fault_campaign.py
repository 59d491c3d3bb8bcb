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

Four scenarios, taken in turn (``--scenarios``): ``plain`` (the config below), ``early stopping``
(``early_stopping.patience=2``: it stops after 7 of 12 epochs), ``tensorboard`` (``logger=tensorboard``)
and ``sweep`` (``-m seed=0,1``: the multirun is interrupted, then each job is continued from its own
folder with ``hydra.run.dir=<job dir> resume=last`` alone, or started afresh if it never started, and
compared with the same job of an uninterrupted sweep). Two more moments aim at the end of a run: "last
epoch" (a step record of the final epoch is written) and "summary" (the final epoch record is
written: the summary is being made). With ``logger=tensorboard`` the scalars TensorBoard would show
(events read back, earlier ones purged from a resumed writer's ``purge_step`` on, as TensorBoard does)
are compared with the uninterrupted run's too, reported on their own line, and a difference is a problem.

Usage: python scripts/fault_campaign.py [--interruptions 100] [--seed 0] [--scenarios plain,sweep] [--out DIR]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain import checkpoint
from mlptrain.errors import CheckpointError

REPO = Path(__file__).resolve().parent.parent

CONFIG = ["device=cpu", "progress=false", "model.hidden=[256,256]", "epochs=6", "checkpoint_steps=5", "log_every=5"]
SCENARIOS = {
    "plain": CONFIG,
    "early stopping": [*CONFIG[:3], "epochs=12", "early_stopping.patience=2", *CONFIG[4:]],
    "tensorboard": [*CONFIG, "logger=tensorboard"],
    "sweep": CONFIG,  # run as -m seed=0,1
}
SWEEP = ["seed=0,1"]
MOMENTS = ["start-up", "training", "training", "checkpoint write", "checkpoint write", "last epoch", "summary"]
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


def attempt(
    run: Path,
    config: list[str] | None,
    resume: bool,
    rng: np.random.Generator,
    log: list[dict[str, Any]],
    final_epoch: int,
    scenario: str,
) -> str:
    """One start of the run (``config=None``: the sweep), interrupted at a random moment: ``finished``,
    ``interrupted`` or ``failed``."""
    sig = str(rng.choice(list(SIGNALS)))
    moment = str(rng.choice(MOMENTS))
    before = run_record_stamp(run)
    proc = start(run, config, resume)
    if moment == "start-up":  # Python, Hydra and the data still loading, or the run being checked
        wait_for_handlers(proc)
        time.sleep(float(rng.uniform(0.0, 1.0)))
        hit = proc.poll() is None
    else:
        hit = wait_for_training(proc, run, before)
    if hit and moment == "checkpoint write":
        hit = wait_for_temp_file(proc, run)
    elif hit and moment in ("last epoch", "summary"):
        hit = wait_for_record(proc, run, final_epoch, "step" if moment == "last epoch" else "epoch")
    elif hit and moment == "training":
        time.sleep(float(rng.uniform(0.0, 0.5)))
        hit = proc.poll() is None
    if hit:
        proc.send_signal(SIGNALS[sig])
    out, err = proc.communicate(timeout=300)
    entry = {
        "scenario": scenario,
        "signal": sig if hit else None,
        "moment": moment if hit else None,
        "exit": proc.returncode,
    }
    # a signal that arrives once the run has printed its summary line finds nothing left to stop
    summary_printed = " steps in " in (out.strip().splitlines() or [""])[-1] and config is not None
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
    if config is not None and sig != "SIGKILL" and "continue with: python -m mlptrain " in last_line:
        if f"hydra.run.dir={run} resume=last" not in last_line:
            problems.append(f"the command to continue is not the run directory alone: {last_line}")
    try:
        for job in [run, *run.glob("*/")]:
            state(job, "last")
    except CheckpointError as exc:
        problems.append(f"last.npz does not load: {exc}")
    entry["problems"] = problems
    log.append(entry)
    return "interrupted" if hit and proc.returncode in EXPECTED[sig] else "failed"


def finish(
    run: Path, config: list[str], rng: np.random.Generator, log: list[dict[str, Any]], final_epoch: int, scenario: str
) -> str | None:
    """Continue ``run`` until it finishes (each start interrupted at random): with the run directory
    alone once it was accepted (``run.json``), else afresh. Returns a problem, or None."""
    outcome, resume = "", (run / "run.json").exists()
    while outcome != "finished":
        outcome = attempt(run, config, resume, rng, log, final_epoch, scenario)
        if outcome == "failed":
            return f"{run}: an attempt failed: {log[-1]}"
        # killed before its run was accepted (no run.json): there is no run to resume, start it afresh
        resume = (run / "run.json").exists()
    return None


def compare(run: Path, reference: Path) -> tuple[list[str], bool | None]:
    """Problems of a finished run against the uninterrupted one, and whether TensorBoard would show the
    same scalars (None without TensorBoard files)."""
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
    if not (reference / "tensorboard").is_dir():
        return problems, None
    same = tensorboard_scalars(run) == tensorboard_scalars(reference)
    if not same:
        problems.append(f"{run}: the TensorBoard scalars differ from the uninterrupted run's")
    return problems, same


def tensorboard_scalars(run: Path) -> dict[tuple[str, int], float]:
    """The scalars TensorBoard shows for ``run``: its event files read in the order they were started,
    a writer's ``purge_step`` (a START session log) dropping the earlier events from that step on."""
    from tensorboardX.proto import event_pb2

    files = []
    for path in (run / "tensorboard").glob("events.out.tfevents.*"):
        data, i, events = path.read_bytes(), 0, []
        while i + 12 <= len(data):  # TFRecord: length (8), its CRC (4), the record, its CRC (4)
            (n,) = struct.unpack("<Q", data[i : i + 8])
            if i + 16 + n > len(data):  # torn by a kill
                break
            events.append(event_pb2.Event.FromString(data[i + 12 : i + 12 + n]))
            i += 16 + n
        files.append(events)
    scalars: dict[tuple[str, int], float] = {}
    for events in sorted(files, key=lambda evs: evs[0].wall_time if evs else 0.0):
        for ev in events:
            if ev.HasField("session_log") and ev.session_log.status == event_pb2.SessionLog.START:
                scalars = {k: v for k, v in scalars.items() if k[1] < ev.step}
            for v in ev.summary.value:
                if not v.tag.endswith("samples_per_s"):  # a timing
                    scalars[(v.tag, ev.step)] = v.simple_value
    return scalars


def campaign(
    root: Path, scenario: str, reference: Path, final_epoch: int, rng: np.random.Generator, log: list[dict[str, Any]]
) -> tuple[list[str], list[bool]]:
    """One run of ``scenario`` (a sweep: its jobs) from its start to its end, compared with ``reference``."""
    n = len(list(root.glob("c*")))
    if scenario != "sweep":
        run = root / f"c{n}"
        run.mkdir()
        problem = finish(run, SCENARIOS[scenario], rng, log, final_epoch, scenario)
        if problem:
            return [problem], []
        problems, tb = compare(run, reference)
        return problems, [] if tb is None else [tb]
    sweep = root / f"c{n}"
    if attempt(sweep, None, False, rng, log, final_epoch, scenario) == "failed":
        return [f"{sweep}: the sweep failed: {log[-1]}"], []
    problems: list[str] = []
    for job in range(2):  # the jobs' folders: hydra.sweep.subdir=<job number>; job n has seed=n
        run = sweep / str(job)
        run.mkdir(parents=True, exist_ok=True)
        done = (run / "metrics.jsonl").exists() and (records(run)[-1:] or [{}])[0].get("kind") == "summary"
        config = [*SCENARIOS["sweep"], f"seed={job}"]
        problem = None if done else finish(run, config, rng, log, final_epoch, scenario)
        problems += [problem] if problem else compare(run, reference / str(job))[0]
    return problems, []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interruptions", type=int, default=100, help="stop after at least this many")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="taken in turn, one run each")
    ap.add_argument("--out", default=None, help="folder for campaign.json and campaign.md")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    scenarios = args.scenarios.split(",")
    root = Path(tempfile.mkdtemp(prefix="mlptrain-faults-"))
    references, final_epochs = {}, {}
    for scenario in scenarios:
        ref = root / f"reference-{scenario.replace(' ', '-')}"
        proc = start(ref, None if scenario == "sweep" else SCENARIOS[scenario], resume=False)
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            print(out + err, file=sys.stderr)
            return 1
        references[scenario] = ref
        job = ref / "0" if scenario == "sweep" else ref
        final_epochs[scenario] = max(r["epoch"] for r in records(job) if r["kind"] == "epoch")
    t0 = time.perf_counter()
    log: list[dict[str, Any]] = []
    problems: list[str] = []
    tensorboard: list[bool] = []
    runs = 0
    while sum(e["signal"] is not None for e in log) < args.interruptions:
        scenario = scenarios[runs % len(scenarios)]
        found, tb = campaign(root, scenario, references[scenario], final_epochs[scenario], rng, log)
        problems, tensorboard, runs = problems + found, tensorboard + tb, runs + 1
        print(f"run {runs} ({scenario}): {sum(e['signal'] is not None for e in log)} interruptions so far", flush=True)
    problems += [p for e in log for p in e.get("problems", [])]
    lines = report(args, scenarios, log, runs, time.perf_counter() - t0, problems, tensorboard)
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


def report(
    args: argparse.Namespace,
    scenarios: list[str],
    log: list[dict[str, Any]],
    runs: int,
    wall: float,
    problems: list[str],
    tensorboard: list[bool],
) -> list[str]:
    counts = collections.Counter((e["scenario"], e["signal"], e["moment"]) for e in log if e["signal"])
    exits = collections.Counter(e["exit"] for e in log)
    lines = [
        f"Command: `python scripts/fault_campaign.py --interruptions {args.interruptions} --seed {args.seed}"
        f"{'' if args.scenarios == ','.join(SCENARIOS) else f' --scenarios {args.scenarios!r}'}`; "
        f"config `{' '.join(CONFIG)}` (scenarios: {', '.join(scenarios)}); {runs} runs, {len(log)} starts, "
        f"{sum(counts.values())} interruptions in {wall:.0f} s.",
        "",
        "| scenario | signal | moment | interruptions |",
        "|---|---|---|---|",
        *[f"| {c} | {s} | {m} | {n} |" for (c, s, m), n in sorted(counts.items())],
        "",
        f"Exit statuses: {dict(sorted(exits.items()))}.",
        f"Every run equal to the uninterrupted run bit for bit (metrics records, last.npz, best.npz): "
        f"{'yes' if not problems else 'NO'}; problems: {len(problems)}.",
    ]
    if tensorboard:
        same = f"{sum(tensorboard)} of {len(tensorboard)}"
        lines.append(f"TensorBoard scalars equal to the uninterrupted run's (logger=tensorboard): {same} runs.")
    return lines


if __name__ == "__main__":
    sys.exit(main())
