"""Why a long prediction runs slower per batch than a short one: the SM clock under sustained GEMM load.

For 4096 x 4 (fp16 by default) on 1,000,000 raw float32 rows resident on the GPU, in batches of 8192,
as ``scripts/bench_predict.py`` runs it, this times

* the forward GEMMs alone (RELU_BIAS ... BIAS, the batch already in the compute dtype), 20, 122 and
  366 batches back to back, then 20 again;
* the whole pipeline (``Predictor.run``: normalise, the graph of the forward and the argmax, results),
  122 batches a pass, median of 3 passes;
* the normalise kernel alone over the 122 batches,

with 1.5 s of idle before each, while ``nvidia-smi`` samples the SM clock and the board power every
25 ms; each phase is printed with the clock range and mean it ran at.

Usage: python scripts/predict_clocks.py [--out DIR] [--precision fp16|bf16] [--rows N] [--batch B]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def clock_samples(path: Path) -> list[tuple[float, float, float]]:
    """``(unix time, SM MHz, watts)`` rows of an ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw`` CSV."""
    out = []
    with path.open() as f:
        for row in csv.reader(f):
            try:
                t = datetime.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
                out.append((t.timestamp(), float(row[1].split()[0]), float(row[2].split()[0])))
            except (ValueError, IndexError):
                continue
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="predict-clocks-out")
    ap.add_argument("--precision", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=8192)
    args = ap.parse_args(argv)
    import cupy as cp

    from mlptrain.inference.cuda.infer_kernels import normalise
    from mlptrain.inference.predictor import Predictor
    from mlptrain.tools.bench.predict_timing import cupy_events, forward_floor, random_checkpoint, time_passes

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    samples = out / "clocks.csv"
    sink = samples.open("w")
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader", "-lms", "25"],
        stdout=sink,
    )
    phases: list[tuple[str, float, float, float]] = []  # (name, start, end, ms per batch)

    def phase(name: str, fn, batches: int) -> None:
        time.sleep(1.5)  # idle: the clock recovers
        t0 = time.time()
        seconds = fn()
        phases.append((name, t0, time.time(), seconds * 1e3 / batches))

    try:
        widths, rows, batch = [4096] * 5, args.rows, args.batch
        p = Predictor(random_checkpoint(widths, args.precision), device="gpu", precision=args.precision,
                      batch_size=batch)  # fmt: skip
        rng = np.random.default_rng(1)
        x_host = (rng.standard_normal((rows, widths[0]), dtype=np.float32) * p.scale + p.shift).astype(np.float32)
        x = cp.asarray(x_host)
        del x_host
        p.run(x)  # plans, captures
        n = -(-rows // batch)
        for chain in (20, n, 3 * n, 20):
            phase(
                f"forward GEMMs, {chain} batches",
                lambda c=chain: forward_floor(p, x[:batch], batch, c)["s_per_batch"] * c,
                chain,
            )  # noqa: E501
        phase(
            f"whole pipeline, {n} batches",
            lambda: statistics.median(time_passes(lambda: p.run(x), cupy_events(p.gpu_runner.stream), 3)),
            n,
        )  # noqa: E501

        def normalise_all() -> float:
            x_in = cp.empty((batch, widths[0]), p.precision.compute_dtype)
            s = p.gpu_runner.stream
            with s:
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(s)
                for i in range(0, rows, batch):
                    part = x[i : i + batch]
                    normalise(part, p.gpu_runner.shift, p.gpu_runner.inv, x_in[: len(part)])
                end.record(s)
                end.synchronize()
            return cp.cuda.get_elapsed_time(start, end) / 1e3

        phase(f"normalise alone, {n} batches", normalise_all, n)
    finally:
        time.sleep(0.2)
        smi.terminate()
        smi.wait()
        sink.close()
    clocks = clock_samples(samples)
    lines = [f"{datetime.date.today()} {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, 4096 x 4, "
             f"{args.precision}, batch {batch}, {rows} rows; SM clock and power sampled every 25 ms", "",
             "| phase | ms per batch | SM MHz min-max (mean) | max W |", "|---|---|---|---|"]  # fmt: skip
    for name, t0, t1, ms in phases:
        seg = [c for c in clocks if t0 <= c[0] <= t1]
        if not seg:  # a phase shorter than the sampling interval
            lines.append(f"| {name} | {ms:.4f} | - | - |")
            continue
        mhz = f"{min(c[1] for c in seg):.0f}-{max(c[1] for c in seg):.0f} ({statistics.mean(c[1] for c in seg):.0f})"
        lines.append(f"| {name} | {ms:.4f} | {mhz} | {max(c[2] for c in seg)} |")
    (out / "predict-clocks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
