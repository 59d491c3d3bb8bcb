"""Host-resident data against resident data: the same run, its batches copied ahead of each step (#31, GPU only).

For each model, two runs of the same config through ``mlptrain.train`` in one process:
``data.residency=device`` (the splits copied to the GPU once, batches gathered there) and
``data.residency=host`` (the splits in host memory; each batch gathered on host threads into a
pinned slot and copied on a stream of its own, a few batches ahead: ``mlptrain/data/host_loader.py``).
Reported per model:

* the loop's median ``step_time_ms`` of each run and their ratio (the host run's step rate over the
  resident run's: the issue asks for at least 0.95x at 4096 x 4, where a step is compute-bound);
* whether the per-step losses of the two runs are equal (they must be: the same rows in the same order,
  cast once to the same dtype);
* the host run's input rate (bytes of a batch's features and labels over its step time) against two
  limits measured on the same machine at the same batch: one pinned host-to-device copy of that many
  bytes (``cudaMemcpyAsync``, CUDA events, median) and the host gather of that many rows
  (``take_rows`` on the loader's threads, median).

784-1024-1024-10 at batch 8192 is bandwidth-bound: its resident step is shorter than its batch's copy.

Usage: python benchmarks/bench_residency.py --out DIR [--quick]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cupy as cp
import ml_dtypes
import numpy as np
import record

from mlptrain.cli.main import compose_config
from mlptrain.data.cuda.host_loader import pinned_empty
from mlptrain.data.files import chunks
from mlptrain.data.host_loader import TAKE_THREADS, take_rows
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train

# name: (features, hidden, classes, batch, samples, epochs); 70% of the samples train (11 and 43 batches an epoch)
MODELS = {
    "4096 x 4, batch 8192": (4096, [4096] * 3, 4096, 8192, 128_000, 4),
    "784-1024-1024-10, batch 8192": (784, [1024, 1024], 10, 8192, 500_000, 4),
}
TIMING = {"samples_per_s", "step_time_ms", "time_s"}


def overrides(features: int, hidden: list[int], classes: int, batch: int, samples: int, epochs: int) -> list[str]:
    return [
        "data=synthetic",
        f"data.samples={samples}",
        f"data.features={features}",
        f"data.classes={classes}",
        f"model.hidden=[{','.join(map(str, hidden))}]",
        f"data.batch_size={batch}",
        "precision=bf16",
        "optimizer=adam",
        f"epochs={epochs}",
        "log_every=2",
        "progress=false",
        "device=gpu",
    ]


def run(ov: list[str], residency: str) -> tuple[float, list[dict], dict]:
    """The loop's median ``step_time_ms``, the step records without timing keys, the summary."""
    out = Path(tempfile.mkdtemp(prefix=f"mlptrain-bench-residency-{residency}-"))
    summary = train(compose_config([*ov, f"data.residency={residency}"]), out)
    recs = read_metrics(out / "metrics.jsonl")
    times = [r["step_time_ms"] for r in recs if r.get("kind") == "step" and "step_time_ms" in r]
    steps = [{k: v for k, v in r.items() if k not in TIMING} for r in recs if r.get("kind") == "step"]
    return statistics.median(times), steps, summary


def copy_limit_ms(nbytes: int, repeats: int = 50) -> float:
    """One pinned host-to-device copy of ``nbytes`` (CUDA events, median of ``repeats``)."""
    host = pinned_empty((nbytes,), np.dtype(np.uint8))
    host[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dev = cp.empty(nbytes, cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    times = []
    for i in range(repeats + 5):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        dev.set(host, stream=stream)
        end.record(stream)
        end.synchronize()
        if i >= 5:
            times.append(cp.cuda.get_elapsed_time(start, end))
    assert bytes(dev[:4096].get()) == bytes(host[:4096])  # the copy arrived
    return statistics.median(times)


def gather_limit_ms(features: int, rows: int, batch: int, repeats: int = 30) -> float:
    """``take_rows`` of ``batch`` random rows of a ``(rows, features)`` bfloat16 table into a pinned buffer."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, features), dtype=np.float32).astype(ml_dtypes.bfloat16)
    out = pinned_empty((batch, features), x.dtype)
    pool = ThreadPoolExecutor(min(TAKE_THREADS, chunks.threads()))
    times = []
    for _ in range(repeats):
        idx = rng.permutation(rows)[:batch]
        t = time.perf_counter()
        take_rows(x, idx, out, pool)
        times.append((time.perf_counter() - t) * 1e3)
    assert np.array_equal(out.view(np.uint16), x[idx].view(np.uint16))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="two epochs instead of four")
    args = p.parse_args()
    rows, lines = {}, []
    for name, (features, hidden, classes, batch, samples, epochs) in MODELS.items():
        ov = overrides(features, hidden, classes, batch, samples, 2 if args.quick else epochs)
        resident_ms, resident_steps, _ = run(ov, "device")
        host_ms, host_steps, summary = run(ov, "host")
        equal = bool(host_steps) and host_steps == resident_steps
        batch_bytes = batch * (features * 2 + 8)  # bf16 features, int64 labels
        copy_ms = copy_limit_ms(batch_bytes)
        gather_ms = gather_limit_ms(features, int(samples * 0.7), batch)
        row = {
            "resident_step_ms": resident_ms,
            "host_step_ms": host_ms,
            "host_rate_vs_resident": resident_ms / host_ms,
            "losses_equal": equal,
            "steps": summary["steps"],
            "batch_mb": batch_bytes / 1e6,
            "host_input_gb_s": batch_bytes / host_ms / 1e6,
            "copy_limit_ms": copy_ms,
            "copy_limit_gb_s": batch_bytes / copy_ms / 1e6,
            "gather_limit_ms": gather_ms,
        }
        rows[name] = row
        print(name, row, flush=True)
        lines.append(
            f"| {name} | {resident_ms:.3f} | {host_ms:.3f} | {resident_ms / host_ms:.3f}x "
            f"| {equal} ({summary['steps']}) "
            f"| {batch_bytes / 1e6:.1f} | {row['host_input_gb_s']:.1f} | {copy_ms:.3f} ({row['copy_limit_gb_s']:.1f}) "
            f"| {gather_ms:.3f} |"
        )
    md = [
        f"# Host-resident data against resident data ({record.today()})",
        "",
        f"Command: `python benchmarks/bench_residency.py --out DIR{' --quick' if args.quick else ''}`; data=synthetic, "
        "bf16, Adam, log_every=2; each row two runs in one process (data.residency=device, then host). Step ms: "
        "the loop's median `step_time_ms`; limits at the same batch: one pinned host-to-device copy (CUDA events, "
        "median of 50) and the host gather of its rows (`take_rows`, median of 30).",
        "",
        "| model | resident step ms | host step ms | host rate / resident | losses equal (steps) | batch MB "
        "| host input GB/s | H2D copy ms (GB/s) | host gather ms |",
        "|---|---|---|---|---|---|---|---|---|",
        *lines,
    ]
    record.write(args.out, "bench-residency", rows, "\n".join(md))


if __name__ == "__main__":
    main()
