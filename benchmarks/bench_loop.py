"""The training loop's step against the same step's graph replayed back to back (issue #31, GPU only).

For each model: a run through ``mlptrain.train`` (the loop as ``python -m mlptrain`` runs it: log
interval, progress bars off, checkpoints), whose step records give the loop's median ``step_time_ms``;
then, in the same process, a trainer of the same config whose captured step graph is replayed back to
back (CUDA events, median of ``--repeats`` chains of ``--steps`` replays). The ratio is what the loop
adds to the step: Python, the host's launches, the log interval's sync.

Usage: python benchmarks/bench_loop.py --out DIR [--epochs 5] [--samples 200000]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import cupy as cp
import record

from mlptrain.cli.main import compose_config
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train
from mlptrain.step.trainer import Trainer

MODELS = {  # name: (features, hidden, batch)
    "256-1024-1024-10, batch 1024": (256, [1024, 1024], 1024),
    "784-1024-1024-10, batch 256": (784, [1024, 1024], 256),
}


def overrides(features: int, hidden: list[int], batch: int, samples: int, epochs: int) -> list[str]:
    return [
        "data=synthetic",
        f"data.samples={samples}",
        f"data.features={features}",
        "data.classes=10",
        f"model.hidden=[{','.join(map(str, hidden))}]",
        f"data.batch_size={batch}",
        "precision=bf16",
        "optimizer=adam",
        f"epochs={epochs}",
        "progress=false",
        "device=gpu",
    ]


def loop_step_ms(cfg_overrides: list[str], run_dir: Path) -> tuple[float, dict]:
    summary = train(compose_config(cfg_overrides), run_dir)
    steps = [r["step_time_ms"] for r in read_metrics(run_dir / "metrics.jsonl") if "step_time_ms" in r]
    return statistics.median(steps), summary


def replay_ms(cfg_overrides: list[str], steps: int, repeats: int) -> float:
    tr = Trainer(compose_config(cfg_overrides))
    with tr.stream:
        batches = tr.train_batches(0)
        for _ in range(4):  # warm-up steps, then the capture
            tr.step(*next(batches))
        graph = next(iter(tr.graphed.graphs().values()))
        stream = cp.cuda.get_current_stream()
        times = []
        for _ in range(repeats):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            for _ in range(steps):
                graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / steps)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=11)
    args = p.parse_args()
    rows, lines = {}, []
    for name, (features, hidden, batch) in MODELS.items():
        ov = overrides(features, hidden, batch, args.samples, args.epochs)
        loop, summary = loop_step_ms(ov, Path(tempfile.mkdtemp(prefix="mlptrain-bench-loop-")))
        replay = replay_ms(ov, args.steps, args.repeats)
        rows[name] = {"loop_step_ms": loop, "replay_ms": replay, "ratio": loop / replay, "steps": summary["steps"]}
        lines.append(f"| {name} | {loop:.4f} | {replay:.4f} | {loop / replay:.2f}x | {summary['steps']} |")
        print(name, rows[name], flush=True)
    md = [
        f"# The loop's step against its graph replayed back to back ({record.today()})",
        "",
        f"Command: `python benchmarks/bench_loop.py --out DIR --epochs {args.epochs} --samples {args.samples}`; "
        "data=synthetic, bf16, Adam; the loop's median `step_time_ms` over its step records, the replay's median "
        f"of {args.repeats} chains of {args.steps} back-to-back launches (CUDA events).",
        "",
        "| model | loop step ms | graph replay ms | loop / replay | steps |",
        "|---|---|---|---|---|",
        *lines,
    ]
    record.write(args.out, "bench-loop", rows, "\n".join(md))


if __name__ == "__main__":
    main()
