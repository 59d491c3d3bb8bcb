"""The campaign's report: per scenario its trials, interruptions, outcomes, steps lost and failures (Markdown, JSON)."""

from __future__ import annotations

import collections
import subprocess
from typing import Any

from fault_injection.runs import REPO

LOST = "a SIGKILL lost "  # the problem a kill that lost more than promised is, with --lost check
# What a SIGKILL may cost (docs/reliability.md, promise 3): 2 x checkpoint_steps steps (the write in flight and
# the one it waited for), checkpoint_steps=1 in these scenarios; partial_fit: no call a save reported.
PROMISE = 2


def promise(scenario: str) -> int:
    """Steps (calls, for partial_fit) a SIGKILL may lose in ``scenario``."""
    return 0 if scenario == "partial_fit" else PROMISE


def tree() -> str:
    """The commit the campaign ran on, ``+changes`` where the tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    return head.strip() + ("+changes" if dirty.strip() else "")


def scenario_summary(name: str, trials: list[dict[str, Any]]) -> dict[str, Any]:
    """One scenario's numbers from its trials (each: its seed, log entries and problems)."""
    entries = [e for t in trials for e in t["log"]]
    hits = [e for e in entries if e["signal"]]
    lost = [e["lost"] for e in hits if "lost" in e]
    return {
        "scenario": name,
        "trials": len(trials),
        "starts": len(entries),
        "interruptions": len(hits),
        "by_signal": dict(sorted(collections.Counter(e["signal"] for e in hits).items())),
        "by_moment": dict(sorted(collections.Counter(e["moment"] for e in hits).items())),
        "exits": dict(sorted(collections.Counter(str(e["exit"]) for e in entries).items())),
        # bit for bit at the end, every attempt as promised: no problem but the steps a SIGKILL lost
        "equal": sum(all(p.startswith(LOST) for p in t["problems"]) for t in trials),
        "kills_measured": len(lost),
        "max_lost": max(lost, default=None),
        "over_promise": sum(n > promise(name) for n in lost),
        "lost_counts": dict(sorted(collections.Counter(lost).items())),
        # each trial's temporary files beside its save (counted after each kill; nothing removes them)
        "stray_tmp": sum(max((e.get("stray", 0) for e in t["log"]), default=0) for t in trials),
        "over_trials": [[t["trial"], e["lost"]] for t in trials for e in t["log"] if e.get("lost", 0) > promise(name)],
        "failures": [{"trial": t["trial"], "problems": t["problems"]} for t in trials if t["problems"]],
    }


def markdown(
    command: str, commit: str, summaries: list[dict[str, Any]], wall: float | None, lost_mode: str
) -> list[str]:
    total = sum(s["interruptions"] for s in summaries)
    lines = [
        f"Command: `{command}` on tree {commit}; {sum(s['trials'] for s in summaries)} trials, "
        f"{sum(s['starts'] for s in summaries)} starts, {total} interruptions"
        + (f" in {wall:.0f} s." if wall is not None else "."),
        "",
        "| scenario | trials | starts | interruptions (SIGINT / SIGTERM / SIGKILL) | exit statuses | equal to "
        "uninterrupted (bit for bit) | SIGKILLs measured | worst steps lost | over the promise | steps lost: kills |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        sigs = " / ".join(str(s["by_signal"].get(k, 0)) for k in ("SIGINT", "SIGTERM", "SIGKILL"))
        lost = ", ".join(f"{k}: {n}" for k, n in s["lost_counts"].items()) or "-"
        worst = "-" if s["max_lost"] is None else s["max_lost"]
        lines.append(
            f"| {s['scenario']} | {s['trials']} | {s['starts']} | {s['interruptions']} ({sigs}) | {s['exits']} | "
            f"{s['equal']} of {s['trials']} | {s['kills_measured']} | {worst} | {s['over_promise']} | {lost} |"
        )
    lines += ["", "Moments: " + "; ".join(f"{s['scenario']} {s['by_moment']}" for s in summaries) + "."]
    stray = {s["scenario"]: s["stray_tmp"] for s in summaries if s["stray_tmp"]}
    if stray:
        lines.append(f"Temporary files left beside a save by a kill (the next save removes them): {stray}.")
    lines.append(
        f"Steps lost beyond the promise ({PROMISE} with checkpoint_steps=1; partial_fit: none of a reported save) are "
        + ("failures." if lost_mode == "check" else "recorded, not counted as failures (--lost record).")
    )
    for s in summaries:
        if s["over_trials"]:
            over = ", ".join(f"trial {t} lost {n}" for t, n in s["over_trials"])
            lines.append(f"- {s['scenario']}: SIGKILLs that lost more than the promise: {over}.")
    failures = [(s["scenario"], f) for s in summaries for f in s["failures"]]
    lines.append(f"Failures: {len(failures)}.")
    for scenario, f in failures:
        lines.append(f"- {scenario}, trial {f['trial']} (replay: `--replay {f['trial']}`): {' | '.join(f['problems'])}")
    if failures:
        lines.append("(A replay, with the same --seed and --scenarios, repeats the trial's draws: its signals, moments")
        lines.append("and waits; where a signal lands within a moment depends on the machine's timing.)")
    return lines
