"""Random interruption campaign: kill training at random moments, resume it, compare bit for bit.

Each trial trains one run through ``python -m mlptrain`` (CPU, digits) into a fresh directory and
interrupts it again and again with SIGINT, SIGTERM or SIGKILL at a random moment: while Python, Hydra
and the data load ("start-up", from the moment mlptrain's own code runs), during training, the moment
a checkpoint's temporary file appears ("checkpoint write"), while the final epoch trains ("last
epoch") or its summary is made ("summary"). Then it continues the run with the run directory alone
(``resume=last``; afresh if it was stopped before its run was accepted) until it finishes. Every
attempt is checked: the exit status is the promised one (130 for SIGINT, 143 for SIGTERM, killed for
SIGKILL), a stop request ends with one line and no traceback, and ``checkpoints/last.npz`` loads. At
the end the run must equal an uninterrupted run of the same config bit for bit: every
``metrics.jsonl`` record (timing keys aside: every step's loss), the arrays and positions of
``last.npz`` and ``best.npz``; no ``.tmp`` or ``.corrupt`` file may be left.

Scenarios (``--scenarios``, taken in turn, one trial each): ``plain`` (``model.hidden=[256,256]
epochs=6 checkpoint_steps=5 log_every=5``), ``early stopping`` (``early_stopping.patience=2``),
``tensorboard`` (the scalars TensorBoard would show are compared too), ``sweep`` (``-m seed=0,1``,
each job continued from its own folder); with a checkpoint after every step (``checkpoint_steps=1
log_every=1``): ``ckpt1``, ``fp8`` (``precision=fp8``, the CPU's emulation) and ``stream``
(``data.residency=stream`` over an uncompressed, memory-mapped NPZ of digits). After each SIGKILL of
these three, the steps lost are counted: the steps the run had done by its own account (its last step
record in ``metrics.jsonl``) minus the step of the ``last.npz`` that survived; the promise is at most
``checkpoint_steps`` (1). ``partial_fit``: a loop of ``MLPClassifier.partial_fit`` calls saved after
each, killed and restarted from its save (what is promised: ``fault_injection/partial.py``).

Each trial has its own random numbers (from ``--seed`` and its number): ``--replay N`` runs trial N
alone, with the same ``--seed`` and ``--scenarios``.

Usage: python benchmarks/fault_campaign --scenarios ckpt1,fp8,stream,partial_fit --trials 100 --seed 0 --out DIR
       python benchmarks/fault_campaign --smoke --scenarios ckpt1   (one trial, two interruptions: a test)

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# python benchmarks/fault_campaign puts this folder first on sys.path: its modules are fault_injection/
from fault_injection import partial, report, runs, trial

OLD = "plain,early stopping,tensorboard,sweep"


def references(root: Path, scenarios: list[str]) -> dict[str, tuple[Path, int, float]]:
    """Each scenario's uninterrupted run: its folder, final epoch, and its training's wall time (the
    range of the "training" moment). ``partial_fit``: the uninterrupted loop's save, 0, its calls' time."""
    out = {}
    for scenario in scenarios:
        if scenario == "partial_fit":
            save, span = partial.reference(root)
            out[scenario] = (save, 0, span)
            continue
        ref = root / f"reference-{scenario.replace(' ', '-')}"
        proc = runs.start(ref, None if scenario == "sweep" else runs.SCENARIOS[scenario], resume=False)
        out_text, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"the uninterrupted {scenario} run failed: {out_text}{err}")
        job = ref / "0" if scenario == "sweep" else ref
        recs = runs.records(job)
        final_epoch = max(r["epoch"] for r in recs if r["kind"] == "epoch")
        summary = runs.final_records(job)[-1]  # with its wall_s (records() drops the timing keys)
        span = max(0.05, float(summary.get("wall_s", 0.5))) if scenario in runs.COUNTED else 0.5
        out[scenario] = (ref, final_epoch, span)
    return out


def one_trial(root: Path, args: argparse.Namespace, number: int, refs: dict[str, Any]) -> dict[str, Any]:
    """Trial ``number``: its scenario (the scenarios in turn), its log and its problems."""
    scenarios = args.scenarios.split(",")
    scenario = scenarios[number % len(scenarios)]
    rng = np.random.default_rng([args.seed, number])
    ref, final_epoch, span = refs[scenario]
    run = root / f"t{number}"
    log: list[dict[str, Any]] = []
    if scenario == "partial_fit":
        problems = partial.one_run(run, ref, span, rng, args.budget, log)
    else:
        t = trial.Trial(scenario, ref, final_epoch, rng, span=span, budget=args.budget, log=log)
        problems, tb = trial.one_run(t, run)
        problems += [p for e in log for p in e.get("problems", []) if p not in problems]
        if tb and not all(tb):
            problems.append(f"{run}: TensorBoard would show other scalars than the uninterrupted run's")
    if args.lost == "check":
        problems += [f"{report.LOST}{e['lost']} steps" for e in log if e.get("lost", 0) > report.promise(scenario)]
    if not problems and not args.keep:
        shutil.rmtree(run, ignore_errors=True)
    return {"trial": number, "scenario": scenario, "seed": args.seed, "log": log, "problems": problems}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=OLD, help="comma-separated, taken in turn, one trial each")
    ap.add_argument("--trials", type=int, default=0, help="at least this many trials in all")
    ap.add_argument("--interruptions", type=int, default=0, help="and at least this many interruptions in all")
    ap.add_argument("--budget", type=int, default=3, help="interruptions per trial at most; then it runs to its end")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay", type=int, default=None, help="run this trial alone (same --seed and --scenarios)")
    ap.add_argument("--lost", choices=["check", "record"], default="check", help="steps lost beyond the promise")
    ap.add_argument("--smoke", action="store_true", help="one trial per scenario, two interruptions each")
    ap.add_argument("--keep", action="store_true", help="keep every trial's folder (failed ones are always kept)")
    ap.add_argument("--out", default=None, help="folder for campaign.json and campaign.md")
    ap.add_argument("--work", default=None, help="where the runs' folder is made (default: the temp folder)")
    ap.add_argument("--render", default=None, help="write campaign.md again from this campaign.json; run nothing")
    args = ap.parse_args(argv)
    unknown = set(args.scenarios.split(",")) - {*runs.SCENARIOS, "partial_fit"}
    if unknown:
        ap.error(f"--scenarios names {sorted(unknown)}; expected some of {[*runs.SCENARIOS, 'partial_fit']}")
    if args.smoke:
        args.trials, args.budget = max(args.trials, len(args.scenarios.split(","))), min(args.budget, 2)
    if not args.trials and not args.interruptions:
        args.interruptions = 100
    return args


def render(path: Path, out: str | None, lost_mode: str) -> int:
    """``campaign.md`` again from a ``campaign.json`` (its trials' logs): the report of a campaign already run."""
    doc = json.loads(path.read_text())
    scenarios = list(dict.fromkeys(t["scenario"] for t in doc["trials"]))
    summaries = [report.scenario_summary(s, [t for t in doc["trials"] if t["scenario"] == s]) for s in scenarios]
    lines = report.markdown(doc["command"], doc["tree"], summaries, doc.get("wall_s"), lost_mode)
    print("\n".join(lines))
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "campaign.md").write_text("\n".join(lines) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.render:
        return render(Path(args.render), args.out, args.lost)
    command = "python benchmarks/fault_campaign " + shlex.join(sys.argv[1:] if argv is None else argv)
    commit = report.tree()  # at the start: the tree that ran
    root = Path(tempfile.mkdtemp(prefix="mlptrain-faults-", dir=args.work))
    scenarios = args.scenarios.split(",")
    if "stream" in scenarios:
        runs.write_stream_table(root)
    refs = references(root, scenarios)
    t0, trials, number = time.perf_counter(), [], 0 if args.replay is None else args.replay
    while True:
        trials.append(one_trial(root, args, number, refs))
        hits = sum(e["signal"] is not None for t in trials for e in t["log"])
        print(f"trial {number} ({trials[-1]['scenario']}): {hits} interruptions so far", flush=True)
        number += 1
        if args.replay is not None or (len(trials) >= args.trials and hits >= args.interruptions):
            break
    summaries = [report.scenario_summary(s, [t for t in trials if t["scenario"] == s]) for s in scenarios]
    lines = report.markdown(command, commit, summaries, time.perf_counter() - t0, args.lost)
    print("\n".join(lines))
    if args.out:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "campaign.md").write_text("\n".join(lines) + "\n")
        doc = {"command": command, "tree": commit, "wall_s": time.perf_counter() - t0, "summaries": summaries}
        doc["trials"] = trials
        (out_dir / "campaign.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    failed = any(t["problems"] for t in trials)
    if not failed:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"the failed trials' folders are kept under {root}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
