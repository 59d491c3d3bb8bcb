"""What one training step runs on the GPU, and what it costs.

Builds the training step of a model as ``python -m mlptrain`` does (fused, CUDA graph), lists the
kernels of the captured graph in launch order, and times the step against its GEMMs alone:

* steady state: 20 steps back to back, per step (what a training run sees);
* isolated: one step on an idle GPU (latency, host launch work included).

Usage: python benchmarks/probes/step_kernels.py [--widths 784,1024,1024,10] [--batch 256] [--precision fp16]
       [--optimizer sgd] [--out DIR]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from mlptrain.base.backend import probe_gpu


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="784,1024,1024,10")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--precision", default="fp16", choices=["fp32", "tf32", "fp16", "bf16", "fp8"])
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"])
    ap.add_argument("--bgrad", default="auto", choices=["auto", "bgradb", "drelu_bgrad"])
    ap.add_argument("--autotune", action="store_true", help="time cuBLASLt's candidate algorithms per GEMM")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="folder for kernels.json and graph.dot")
    ap.add_argument("--one-stream", action="store_true", help="the backward on one stream (wgrad_stream=false)")
    ap.add_argument(
        "--gemm-head",
        action="store_true",
        help="the output layer's input gradient as a cuBLASLt GEMM (head_kernel=false), not mlptrain_head_dgrad",
    )
    ap.add_argument("--profile", action="store_true", help="GPU time of each kernel (needs PyTorch's profiler)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    available, reason = probe_gpu()
    if not available:
        print(f"step_kernels.py needs an NVIDIA GPU with CuPy and nvmath-python: {reason}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    rec = measure(args)
    report(rec, args)
    if args.out:
        (Path(args.out) / "kernels.json").write_text(json.dumps(rec, indent=2) + "\n")
    return 0


def measure(args: argparse.Namespace) -> dict:
    """The step's graph (its kernels in launch order), its times and its GEMMs' floor, as kernels.json holds them."""
    import cupy as cp
    import ml_dtypes

    from mlptrain.base.cuda.timing import cuda_time_ms
    from mlptrain.tools.bench.medians import CHAIN, median
    from mlptrain.tools.bench.step_timing import step_gemm_floor
    from mlptrain.tools.bench.step_trainer import step_trainer

    widths = [int(w) for w in args.widths.split(",")]
    tr = step_trainer(
        widths,
        args.batch,
        args.precision,
        autotune=args.autotune,
        optimizer=args.optimizer,
        bgrad=args.bgrad,
        wgrad_stream=not args.one_stream,
        head_kernel=not args.gemm_head,
    )
    with tr.stream:
        xb, yb = next(iter(tr.train_loader.epoch(0, out=tr.batch_buffers)))  # into the graph's inputs
        for _ in range(3):  # two warm-up steps, then the capture
            tr.step(xb, yb)
        graph = next(iter(tr.graphed.graphs().values()))
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "graph.dot").write_text(graph.debug_dot_str())
        names = tr.graphed.kernel_names()
        step = {
            "steady": median(cuda_time_ms(lambda: tr.step(xb, yb), warmup=2, reps=args.reps, chain=CHAIN)),
            "isolated": median(cuda_time_ms(lambda: tr.step(xb, yb), warmup=2, reps=args.reps)),
        }
        per_kernel = profile_kernels(lambda: tr.step(xb, yb), args.reps) if args.profile else None
    bf16 = np.dtype(ml_dtypes.bfloat16)  # fp8: the floor is the bf16 GEMMs the FP8 ones replace
    dtype = {"fp16": np.float16, "bf16": bf16, "fp8": bf16}.get(args.precision, np.float32)
    floor = step_gemm_floor(widths, args.batch, dtype, args.reps)
    return {
        "widths": widths,
        "batch": args.batch,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "bgrad": tr.model.bgrad,
        "autotune": args.autotune,
        "wgrad_stream": not args.one_stream,
        "head_kernel": tr.head.mode == "kernel",
        "kernels": names,
        "kernel_counts": Counter(names),
        "step_ms": step,
        "gemm_floor_ms": floor,
        "kernel_us": per_kernel,
        "cupy": cp.__version__,
    }


def report(rec: dict, args: argparse.Namespace) -> None:
    """What :func:`measure` found, on stdout: the setup, the graph's kernels, their GPU times, step against floor."""
    names, per_kernel, step, floor = rec["kernels"], rec["kernel_us"], rec["step_ms"], rec["gemm_floor_ms"]
    ours = [n for n in names if n.startswith("mlptrain_")]
    model = "-".join(map(str, rec["widths"]))
    tuned = ", autotuned" if args.autotune else ""
    streams = "one stream" if args.one_stream else "weight gradients on a second stream"
    head = "head kernel" if rec["head_kernel"] else "head GEMM"
    setup = f"{args.precision}, {args.optimizer}, bgrad {rec['bgrad']}{tuned}, {streams}, {head}"
    print(f"{model}, batch {args.batch}, {setup}")
    print(f"{len(names)} graph nodes per step: {len(ours)} of mlptrain's kernels, the rest cuBLASLt's (GEMMs, memsets)")
    for n in names:
        print(f"  {n[:110]}")
    if per_kernel:
        print(f"GPU time per kernel (us, mean of {args.reps} replays, PyTorch profiler):")
        for name, us in per_kernel:
            print(f"  {us:8.2f}  {name[:100]}")
        print(f"  {sum(us for _, us in per_kernel):8.2f}  total")
    for label, key in (("steady", "ms"), ("isolated", "ms_isolated")):
        t = step[label]
        print(f"{label:>8}: step {t:.4f} ms, GEMMs alone {floor[key]:.4f} ms, ratio {t / floor[key]:.2f}x")


def profile_kernels(fn, reps):
    """``[(kernel name, mean GPU microseconds per call of fn)]`` from PyTorch's CUPTI-based profiler."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        print("--profile needs PyTorch (its profiler reads the kernel times through CUPTI)", file=sys.stderr)
        return None
    import cupy as cp

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        cp.cuda.get_current_stream().synchronize()
    totals = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us() / reps
    return sorted(totals.items(), key=lambda kv: -kv[1])


if __name__ == "__main__":
    sys.exit(main())
