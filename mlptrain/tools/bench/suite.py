"""``python -m mlptrain.bench`` (also ``scripts/bench.py``): mlptrain's fused epilogs against the naive
path, the GEMMs alone, and PyTorch.

Needs an NVIDIA GPU (CuPy + nvmath-python); PyTorch is optional (its rows are skipped when it is
not importable). One run prints one table and writes ``bench.json`` and ``bench.md`` to --out.

Sections:
  (a) one layer at the seed shape: fp16 W (65536, 16384) @ X^T (16384, 8192), bias 65536:
      forward and backward, fused vs naive vs the GEMMs alone;
  (b) a grid of layer shapes (small, medium, large batch) in fp16 and bf16;
  (c) whole training steps (forward, loss, backward, optimizer) for 784-1024-1024-10 at batch
      256, 4096 x 4 layers at batch 8192 and 8192 x 4 at batch 16384, fp16 and bf16: mlptrain
      fused, mlptrain naive and PyTorch eager (autocast with fp32 master weights, GradScaler for
      fp16), with peak GPU memory;
  (m) peak GPU memory of 4096 x 4 and 8192 x 4 steps against PyTorch eager, with mlptrain's live
      bytes by category (mlptrain.tools.bench.memory_vs_torch);
  (l) the widest 4-layer MLP that trains at batch 16384 in fp16, mlptrain and PyTorch eager
      (mlptrain.tools.bench.largest_model).

Method: random normal data; CUDA events around each call after warm-up; medians. Training steps
are timed two ways: 20 steps back to back (the steady state of a training run) and one step at a
time on an idle GPU (latency, host launch work included). Every fused
result is checked against the naive one (max |difference| / max |value|, in the tables).

Usage: python -m mlptrain.bench [--out DIR] [--sections abcml] [--reps N] [--quick] [--autotune]
       [--workspace-caps none,64]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.base.backend import get_backend, probe_gpu
from mlptrain.config.schema import COMPUTE_COPIES
from mlptrain.tools.bench import largest_model, memory_vs_torch
from mlptrain.tools.bench.layer_timing import GRID, SEED_SHAPE, bench_layer
from mlptrain.tools.bench.medians import CHAIN, fmt
from mlptrain.tools.bench.step_timing import STEP_MODELS, bench_steps, step_rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-out", help="folder for bench.json and bench.md")
    ap.add_argument("--sections", default="abc", help="which sections to run (a, b, c, m, l)")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement (median reported)")
    ap.add_argument("--quick", action="store_true", help="skip the largest shapes (seed layer, 8192 x 4 step)")
    ap.add_argument("--autotune", action="store_true", help="mlptrain steps with execution.autotune=true")
    ap.add_argument("--workspace-caps", default="64,none", help="section m: execution.workspace_mib values")
    ap.add_argument(
        "--compute-copies", default="kept,cast", help="section m: precision.compute_copy values (l: mlptrain's)"
    )
    ap.add_argument(
        "--largest-range", default="32768,81920", help="section l: LO,HI, a width that trains and one that does not"
    )
    ap.add_argument("--largest-range-torch", default=None, help="section l: LO,HI for PyTorch (default: the same)")
    return ap


def software_stack() -> dict[str, Any]:
    """The GPU, the date, the versions and the command of this run, for bench.json and bench.md."""
    cp = get_backend("gpu").xp
    props = cp.cuda.runtime.getDeviceProperties(0)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    stack = {
        "gpu": gpu,
        "date": datetime.date.today().isoformat(),
        "nvmath": get_backend("gpu").versions()["nvmath"],
        "cupy": cp.__version__,
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "driver": cp.cuda.runtime.driverGetVersion(),
        "python": platform.python_version(),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    }
    try:
        import torch

        stack["torch"] = torch.__version__
    except ImportError:
        pass
    return stack


def layer_section(args: argparse.Namespace, result: dict[str, Any]) -> list[str]:
    """Sections a and b: one layer per shape, forward and backward; the table's rows (also printed)."""
    layer_shapes = []
    if "a" in args.sections and not args.quick:
        layer_shapes.append((SEED_SHAPE, "float16"))
    if "b" in args.sections:
        layer_shapes += [(s, dt) for s in GRID for dt in ("float16", "bfloat16")]
    if not layer_shapes:
        return []
    import ml_dtypes

    md = [
        "## One ReLU layer, forward and backward (ms)",
        "",
        "(out, in, batch): W (out, in) @ X^T (in, batch) + bias (out). Backward = weight gradient, bias "
        "gradient and the input gradient through the ReLU of the layer below. Fused backward: the faster "
        "of DRELU_BGRAD + plain wgrad and DRELU + BGRADB (both shown). err: max |fused - naive| / max |naive|.",
        "",
        "| (out, in, batch) | dtype | GEMM fwd | fused fwd | naive fwd | fused/GEMM | GEMMs bwd | fused bwd "
        "(DRELU_BGRAD / BGRADB) | naive bwd | fused/GEMMs | naive/fused bwd | err fwd, bwd |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print(md[-3])
    for (m, k, n), dt in layer_shapes:
        dtype = np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)
        r = bench_layer(m, k, n, dtype, args.reps)
        r["dtype"] = dt
        result["layers"].append(r)
        row = (
            f"| ({m}, {k}, {n}) | {dt} | {fmt(r['gemm_fwd'])} | {fmt(r['fused_fwd'])} | {fmt(r['naive_fwd'])} "
            f"| {r['fused_fwd'] / r['gemm_fwd']:.3f}x | {fmt(r['gemm_bwd'])} | {fmt(r['fused_bwd'])} "
            f"({fmt(r['fused_bwd_drelu_bgrad'])} / {fmt(r['fused_bwd_bgradb'])}) | {fmt(r['naive_bwd'])} "
            f"| {r['fused_bwd'] / r['gemm_bwd']:.3f}x | {r['naive_bwd'] / r['fused_bwd']:.2f}x "
            f"| {r['fwd_err']:.1e}, {r['bwd_err']:.1e} |"
        )
        md.append(row)
        print(row, flush=True)
    return [*md, ""]


def step_section(args: argparse.Namespace, result: dict[str, Any]) -> list[str]:
    """Section c: whole training steps of :data:`STEP_MODELS` in fp16 and bf16; the table's rows."""
    md = [
        "## Whole training steps (ms per step, peak GPU memory GiB)",
        "",
        "Forward, softmax cross-entropy, backward, SGD with momentum (fp32 master weights). fp16 with "
        "dynamic loss scaling. mlptrain peak = CuPy pool high-water mark; PyTorch = max_memory_reserved. "
        "GEMM floor: the GPU time of the step's GEMMs alone (nvmath, replayed from a CUDA graph). "
        "own GEMMs: the step's GEMMs with their epilogs, as the fused step runs them, replayed alone. "
        "fused, graph: the whole step replayed from a CUDA graph (the default on the GPU), weight "
        "gradients on a second stream concurrent with the input-gradient chain; 1 stream: the same "
        "graph with the backward on one stream (execution.wgrad_stream=false). The GEMM floor runs its "
        "GEMMs one after another; own GEMMs runs them as the step does (two streams). "
        f"Steady state: {CHAIN} steps back to back, per step (what a training run sees). Isolated: one "
        "step on an idle GPU, host launch work included (latency).",
        "",
        "| model | batch | dtype | timing | GEMM floor | own GEMMs | fused, graph | graph, 1 stream | fused "
        "| naive | PyTorch eager "
        "| graph / floor | graph / own GEMMs | PyTorch / graph | PyTorch / fused | naive / fused "
        "| peak GiB graph / fused / naive / torch | bgrad |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, widths, batch in STEP_MODELS:
        if args.quick and widths[0] == 8192:
            continue
        for precision in ("fp16", "bf16"):
            rec = bench_steps(name, widths, batch, precision, args.reps, autotune=args.autotune)
            result["steps"].append(rec)
            for row in step_rows(rec):
                md.append(row)
                print(row, flush=True)
    return [*md, ""]


def memory_sections(args: argparse.Namespace, result: dict[str, Any], ap: argparse.ArgumentParser) -> list[str]:
    """Sections m and l: peak memory against PyTorch, and the largest model (l runs first, printed last)."""
    copies = args.compute_copies.split(",")
    if not set(copies) <= set(COMPUTE_COPIES):
        ap.error(f"--compute-copies {args.compute_copies}: expected kept, cast or both, comma-separated")
    md: list[str] = []
    largest_md: list[str] = []
    if "l" in args.sections:
        # Before section m: the trials are processes of their own, and this one's pools would hold GPU
        # memory they need (after section m, about 10 GiB); what sections a to c cached goes back first.
        memory_vs_torch.free_device_caches()
        ranges = {"mlptrain": tuple(int(v) for v in args.largest_range.split(","))}
        ranges["torch"] = tuple(int(v) for v in (args.largest_range_torch or args.largest_range).split(","))
        result["largest"], largest_md = largest_model.largest_section(ranges=ranges, copies=copies)
    if "m" in args.sections:
        caps = [None if c == "none" else int(c) for c in args.workspace_caps.split(",")]
        result["memory"], rows = memory_vs_torch.memory_section(args.reps, caps, copies)
        md += rows
    return md + largest_md


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    available, reason = probe_gpu()
    if not available:
        print(f"bench.py needs an NVIDIA GPU with CuPy and nvmath-python: {reason}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stack = software_stack()
    result: dict[str, Any] = {"stack": stack, "layers": [], "steps": []}
    md = [
        f"Measured {stack['date']} on {stack['gpu']}: nvmath-python {stack['nvmath']}, CuPy {stack['cupy']}, "
        f"CUDA runtime {stack['cuda_runtime']}, driver API {stack['driver']}"
        + (f", PyTorch {stack['torch']}" if "torch" in stack else "")
        + f". Command: `{stack['command']}`.",
        f"Medians of {args.reps} CUDA-event-timed runs after warm-up, random normal data.",
        "",
    ]
    md += layer_section(args, result)
    if "c" in args.sections:
        md += step_section(args, result)
    if "m" in args.sections or "l" in args.sections:
        md += memory_sections(args, result, ap)
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    return 0
