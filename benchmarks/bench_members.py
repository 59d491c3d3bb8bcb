"""The step time of an ensemble against one model: K members of one shape as one batched step (#50, #51 item 4).

Each case is a fresh ``python -m mlptrain`` run on the synthetic table (Gaussian clusters, random, seeded),
once with ``ensemble.size=1`` and once with ``ensemble.size=K``; the step time is the median ``step_time_ms``
of the run's step records after the first (the loop times its log intervals with CUDA events on the GPU),
so one number per run covers the whole step: the batched GEMMs with their epilogs, the members' loss, the
update and the step log. The targets of #50 on the GPU: 8 members of 256-1024-1024-10 at batch 256 in at
most 1.5x the step of one, 32 members of 64-256-256-2 in at most 2x.

Usage: python benchmarks/bench_members.py --out DIR [--cases big,small] [--precision bf16] [--epochs 3]
       [--set KEY=VALUE ...]   (settings of both runs: execution.epilogue_kernels=false, execution.autotune=true)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import record

# name: (features, hidden, classes, batch, members, samples)
CASES = {
    "big": (256, [1024, 1024], 10, 256, 8, 65_536),
    "small": (64, [256, 256], 2, 256, 32, 65_536),
}


def run(case: str, members: int, precision: str, epochs: int, work: Path, settings: list[str]) -> dict:
    """One fresh run of ``case`` with ``members`` members: its median step time and last losses."""
    features, hidden, classes, batch, _, samples = CASES[case]
    run_dir = work / f"{case}-{members}"
    overrides = [
        "data=synthetic",
        f"data.samples={samples}",
        f"data.features={features}",
        f"data.classes={classes}",
        f"data.batch_size={batch}",
        f"model.hidden=[{','.join(map(str, hidden))}]",
        f"precision={precision}",
        f"ensemble.size={members}",
        f"epochs={epochs}",
        "log_every=50",
        "progress=false",
        *settings,
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "MLPTRAIN_DATA": str(work / "cache")}
    proc = subprocess.run([sys.executable, "-m", "mlptrain", *overrides], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} K={members}: mlptrain exited {proc.returncode}: {proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_ms = [r["step_time_ms"] for r in records if r["kind"] == "step" and r.get("step_time_ms") is not None]
    summary = next(r for r in records if r["kind"] == "summary")
    return {
        "case": case,
        "members": members,
        "step_ms": statistics.median(step_ms[1:] or step_ms),
        "intervals": len(step_ms),
        "test_acc": summary.get("test/acc"),
        "command": "python -m mlptrain " + " ".join(overrides[:-1]),
    }


def where() -> str:
    """The GPU's name, or ``CPU`` on a machine without CuPy or a GPU."""
    try:
        return record.gpu_name()
    except Exception:  # no CuPy, or no device: the runs took the CPU
        return "CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", default="big,small")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting of both runs")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            one = run(case, 1, args.precision, args.epochs, Path(tmp), args.set)
            many = run(case, CASES[case][4], args.precision, args.epochs, Path(tmp), args.set)
            rows.append({"one": one, "many": many, "ratio": many["step_ms"] / one["step_ms"]})
    head = f"`{record.command()}`, {where()}, {record.today()}; median ms per step after the first interval"
    text = [head, "", "| model | batch | members | one model (ms) | members (ms) | ratio | test acc (ensemble) |"]
    text.append("|---|---|---|---|---|---|---|")
    for r in rows:
        f, hidden, c, b, k, _ = CASES[r["one"]["case"]]
        widths = "-".join(map(str, [f, *hidden, c]))
        text.append(
            f"| {widths} | {b} | {k} | {r['one']['step_ms']:.4f} | {r['many']['step_ms']:.4f} | {r['ratio']:.2f}x "
            f"| {r['many']['test_acc']} |"
        )
    record.write(args.out, "bench_members", {"rows": rows, "stack": record.versions("numpy", "cupy")}, "\n".join(text))


if __name__ == "__main__":
    main()
