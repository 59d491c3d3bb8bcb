"""Inference throughput: ``mlptrain.predict`` against PyTorch eager and ``torch.compile``.

For each model (784-1024-1024-10 and 4096 x 4: four 4096 -> 4096 layers) and dtype (fp16, bf16),
the same random weights score the same 1,000,000 raw float32 rows, resident on the GPU, in batches
of 8192. The work per batch is the same in every variant: normalise ``(x - shift) * (1 / scale)``
and cast, the MLP, the argmax; the class ids of all rows come back to the host at the end.

* mlptrain: :class:`mlptrain.inference.predictor.Predictor` (one normalise kernel, then a CUDA graph of the
  RELU_BIAS/BIAS GEMMs and the argmax);
* PyTorch eager: ``nn.Sequential(Linear, ReLU, ...)`` in the dtype, under ``torch.inference_mode``;
* ``torch.compile`` (inductor, default mode) of the same function.

Each variant's pass over all rows is timed with CUDA events after a warm-up pass (which also
compiles); the median of ``--reps`` passes gives rows/s. The predictions are compared with
mlptrain's (share of equal class ids: half-precision GEMMs with other algorithms may round
differently at near-ties). mlptrain from host (NumPy) rows is timed too, transfers included.

Usage: python benchmarks/bench_predict.py [--out DIR] [--rows N] [--batch B] [--reps R] [--models NAME]
(with mlptrain installed, or ``PYTHONPATH=.`` at the repository's root; the timing helpers are
:mod:`mlptrain.tools.bench.predict_timing`)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys

import numpy as np
import record

from mlptrain.base.backend import probe_gpu
from mlptrain.inference.predictor import Predictor
from mlptrain.run import checkpoint
from mlptrain.tools.bench.predict_timing import cupy_events, forward_floor, random_checkpoint, time_passes

MODELS = [("784-1024-1024-10", [784, 1024, 1024, 10]), ("4096 x 4", [4096] * 5)]


def torch_events():
    import torch

    def make():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return (lambda: a.record()), (lambda: (b.record(), b.synchronize())), (lambda: a.elapsed_time(b) / 1e3)

    return make


def torch_variants(p: Predictor, ckpt: checkpoint.Checkpoint, precision: str, batch: int):
    import torch

    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    widths = ckpt.meta["widths"]
    layers = []
    for i in range(len(widths) - 1):
        lin = torch.nn.Linear(widths[i], widths[i + 1])
        lin.weight.data = torch.from_numpy(ckpt.arrays[f"param/layer{i}.weight"])
        lin.bias.data = torch.from_numpy(ckpt.arrays[f"param/layer{i}.bias"])
        layers += [lin] + ([torch.nn.ReLU()] if i < len(widths) - 2 else [])
    model = torch.nn.Sequential(*layers).cuda().to(dtype).eval()
    shift = torch.tensor(p.shift.astype(np.float32), device="cuda")
    inv = torch.tensor((1.0 / p.scale).astype(np.float32), device="cuda")

    def infer(xb):  # the same work per batch as mlptrain's
        return model(((xb - shift) * inv).to(dtype)).argmax(dim=1)

    compiled = torch.compile(infer)
    xb = torch.randn(batch, widths[0], device="cuda").to(dtype)
    with torch.inference_mode():  # the model alone, for the floor
        for _ in range(3):
            model(xb)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            model(xb)
        b.record()
        b.synchronize()
    floor = a.elapsed_time(b) / 1e3 / 20

    def runner(fn):
        def run_all(x):
            with torch.inference_mode():
                out = torch.empty(len(x), dtype=torch.int64, device="cuda")
                for s in range(0, len(x), batch):
                    out[s : s + batch] = fn(x[s : s + batch])
                return out.cpu().numpy()

        return run_all

    return {"torch eager": runner(infer), "torch.compile": runner(compiled)}, {
        "s_per_batch": floor,
        "rows_per_s": batch / floor,
    }


def bench(name: str, widths: list[int], precision: str, rows: int, batch: int, reps: int) -> dict:
    import cupy as cp

    ckpt = random_checkpoint(widths, precision)
    p = Predictor(ckpt, device="gpu", precision=precision, batch_size=batch)
    rng = np.random.default_rng(1)
    x_host = (rng.standard_normal((rows, widths[0]), dtype=np.float32) * p.scale + p.shift).astype(np.float32)
    x_dev = cp.asarray(x_host)
    rec: dict = {"model": name, "widths": widths, "precision": precision, "rows": rows, "batch": batch}
    ours = p.run(x_dev).class_id
    times = time_passes(lambda: p.run(x_dev), cupy_events(p.gpu_runner.stream), reps)
    rec["mlptrain"] = {"s": statistics.median(times), "rows_per_s": rows / statistics.median(times)}
    tuned = Predictor(ckpt, device="gpu", precision=precision, batch_size=batch, autotune=True)
    agree = float(np.mean(tuned.run(x_dev).class_id == ours))  # (plans, autotunes and captures)
    t = statistics.median(time_passes(lambda: tuned.run(x_dev), cupy_events(tuned.gpu_runner.stream), reps))
    rec["mlptrain, autotune"] = {
        "s": t,
        "rows_per_s": rows / t,
        "agree": agree,
    }
    rec["forward GEMMs only"] = forward_floor(p, x_dev[:batch], batch)
    host = statistics.median(time_passes(lambda: p.run(x_host), cupy_events(p.gpu_runner.stream), 2))
    rec["mlptrain, host rows"] = {"s": host, "rows_per_s": rows / host}  # transfers and finiteness check included
    try:
        import torch
    except ImportError:
        return rec
    x_t = torch.from_dlpack(x_dev)  # the same device memory
    cp.cuda.Device().synchronize()
    variants, rec["torch forward only"] = torch_variants(p, ckpt, precision, batch)
    for label, fn in variants.items():
        times = time_passes(lambda fn=fn: fn(x_t), torch_events(), reps)
        theirs = fn(x_t)
        rec[label] = {
            "s": statistics.median(times),
            "rows_per_s": rows / statistics.median(times),
            "agree": float(np.mean(theirs == ours)),
        }
    return rec


def table(results: list[dict]) -> list[str]:
    md = [
        "| model | dtype | mlptrain | mlptrain, autotune | torch eager | torch.compile | vs eager | vs compile | "
        "same class id (eager, compile) | forward only: mlptrain, torch | mlptrain from host rows |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ours, tuned = r["mlptrain"]["rows_per_s"], r["mlptrain, autotune"]["rows_per_s"]
        e, c, tf = r.get("torch eager"), r.get("torch.compile"), r.get("torch forward only")
        peers = "- | - | - | - | -"
        if e and c:
            peers = (
                f"{e['rows_per_s'] / 1e6:.2f} M | {c['rows_per_s'] / 1e6:.2f} M | "
                f"{ours / e['rows_per_s']:.2f}x ({tuned / e['rows_per_s']:.2f}x) | "
                f"{ours / c['rows_per_s']:.2f}x ({tuned / c['rows_per_s']:.2f}x) | "
                f"{e['agree']:.4f}, {c['agree']:.4f}"
            )
        floor = f"{r['forward GEMMs only']['rows_per_s'] / 1e6:.2f} M, " + (
            f"{tf['rows_per_s'] / 1e6:.2f} M" if tf else "-"
        )
        host = r["mlptrain, host rows"]["rows_per_s"] / 1e6
        md.append(
            f"| {r['model']} | {r['precision']} | {ours / 1e6:.2f} M | {tuned / 1e6:.2f} M | {peers} | {floor} | "
            f"{host:.2f} M |"
        )
    md += [
        "",
        "Rows per second. Ratios: mlptrain's default (autotune in brackets) over the peer. Forward only: the "
        "model's layers on one batch already in the compute dtype, 20 batches back to back: the ceiling "
        "that normalising, the argmax and the batching are measured against.",
    ]
    return md


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-predict-out", help="folder for bench_predict.json and .md")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5, help="timed passes over all rows per variant (median)")
    ap.add_argument("--models", default="all", help="all, or one model's name: 784-1024-1024-10 or '4096 x 4'")
    args = ap.parse_args(argv)
    available, reason = probe_gpu()
    if not available:
        print(f"bench_predict.py needs an NVIDIA GPU with CuPy and nvmath-python: {reason}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    stack = {"gpu": record.gpu_name(), "date": record.today(), "command": record.command(argv)}
    stack.update(record.versions("nvmath", "cupy", "torch"))
    results = []
    for name, widths in MODELS:
        if args.models not in ("all", name):
            continue
        for precision in ("fp16", "bf16"):
            results.append(bench(name, widths, precision, args.rows, args.batch, args.reps))
            print(json.dumps(results[-1]), flush=True)
    torch_version = f", PyTorch {stack['torch']}" if "torch" in stack else ""
    md = [
        f"Measured {stack['date']} on {stack['gpu']}: nvmath-python {stack['nvmath']}, CuPy {stack['cupy']}"
        f"{torch_version}. Command: `{stack['command']}`.",
        f"{args.rows:,} raw float32 rows on the GPU, batch {args.batch}; medians of {args.reps} passes "
        "(CUDA events, after a warm-up pass).",
        "",
        *table(results),
    ]
    record.write(args.out, "bench_predict", {"stack": stack, "results": results}, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
