"""The GELU epilogs on the GPU: fused vs naive per layer and per step, and the step against PyTorch.

Needs an NVIDIA GPU (CuPy + nvmath-python); PyTorch rows are skipped where it is not importable.
GELU is the tanh form (``model.activation=gelu``; PyTorch ``nn.GELU(approximate="tanh")``).

* Layers (the shapes of ``scripts/bench.py`` section b, fp16 and bf16), each with GELU and ReLU:
  forward GELU_AUX_BIAS (RELU_AUX_BIAS) against the plain GEMM then bias and GELU as array
  operations; backward: the faster of DGELU_BGRAD + plain weight gradient and DGELU + BGRADB,
  against the naive backward; errors of fused against naive.
* Steps, replayed from a CUDA graph (``graph=true``): 784-1024-1024-10 at batch 256 and 4096 x 4
  at batch 8192, fp16 and bf16, GELU: mlptrain fused, mlptrain naive, PyTorch eager and
  ``torch.compile`` (autocast, fp32 master weights, SGD momentum, GradScaler for fp16), and
  mlptrain fused with ReLU for reference.

Method as ``scripts/bench.py``: random normal data, CUDA events after warm-up, medians; steady =
20 steps back to back, isolated = one at a time.

Usage: python benchmarks/bench_gelu.py [--out DIR] [--reps N] [--no-compile]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import sys

import record

from mlptrain.base.backend import probe_gpu
from mlptrain.tools.bench.layer_timing import GRID, bench_layer
from mlptrain.tools.bench.step_timing import bench_step_mlptrain, bench_step_torch

STEP_MODELS = [("784-1024-1024-10", [784, 1024, 1024, 10], 256), ("4096 x 4", [4096] * 5, 8192)]


def layers(reps: int) -> list[dict]:
    import ml_dtypes
    import numpy as np

    rows = []
    for m, k, n in GRID:
        for dtype in (np.float16, ml_dtypes.bfloat16):
            for activation in ("gelu", "relu"):
                r = bench_layer(m, k, n, dtype, reps, activation=activation, graphed=True)
                r["activation"] = activation
                rows.append(r)
                print(
                    f"layer {m}x{k}x{n} {r['dtype']} {activation}: fwd fused {r['fused_fwd']:.3f} naive "
                    f"{r['naive_fwd']:.3f} gemm {r['gemm_fwd']:.3f}; bwd fused {r['fused_bwd']:.3f} naive "
                    f"{r['naive_bwd']:.3f}",
                    flush=True,
                )
    return rows


def steps(reps: int, compile: bool) -> list[dict]:
    rows = []
    for name, widths, batch in STEP_MODELS:
        for precision in ("fp16", "bf16"):
            r = {"model": name, "widths": widths, "batch": batch, "precision": precision}
            for key, mode, activation in (
                ("fused", "fused", "gelu"),
                ("naive", "naive", "gelu"),
                ("fused_relu", "fused", "relu"),
            ):
                r[key] = bench_step_mlptrain(widths, batch, precision, mode, reps, graph=True, activation=activation)
            r["torch"] = bench_step_torch(widths, batch, precision, reps, activation="gelu")
            r["torch_compile"] = (
                bench_step_torch(widths, batch, precision, reps, activation="gelu", compile=True) if compile else None
            )
            rows.append(r)
            print(
                f"step {name} {precision}: "
                + ", ".join(f"{k} {v['ms']:.3f}" for k, v in r.items() if isinstance(v, dict)),
                flush=True,
            )
    return rows


def _f(v: float | None, nd: int = 3) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def markdown(rec: dict) -> str:
    out = [
        f"# GELU on the GPU ({rec['date']})",
        "",
        f"`{rec['command']}`. {rec['device']}; CuPy {rec['cupy']}, nvmath-python {rec['nvmath']}, "
        f"PyTorch {rec['torch'] or '-'}, Python {rec['python']}.",
        "",
        "## One layer, ms (GPU time from CUDA graph replays, medians; backward: weight gradient + own bias "
        "gradient + input gradient through the activation of the layer below)",
        "",
        "| shape (out, in, batch) | dtype | act | GEMM fwd | fused fwd | naive fwd | naive/fused fwd | GEMMs bwd "
        "| fused bwd (strategy) | naive bwd | naive/fused bwd | err fwd, bwd |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rec["layers"]:
        out.append(
            f"| {tuple(r['shape'])} | {r['dtype']} | {r['activation']} | {_f(r['gemm_fwd'])} | {_f(r['fused_fwd'])} "
            f"| {_f(r['naive_fwd'])} | {r['naive_fwd'] / r['fused_fwd']:.2f}x | {_f(r['gemm_bwd'])} "
            f"| {_f(r['fused_bwd'])} ({r['fused_bwd_strategy']}) | {_f(r['naive_bwd'])} "
            f"| {r['naive_bwd'] / r['fused_bwd']:.2f}x | {r['fwd_err']:.1e}, {r['bwd_err']:.1e} |"
        )
    out += [
        "",
        "## Training steps with GELU, ms per step (graph replay; steady / isolated)",
        "",
        "| model | batch | precision | mlptrain fused | mlptrain naive | PyTorch eager | torch.compile "
        "| fused vs eager | fused vs compile | fused, ReLU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rec["steps"]:
        f, n, t, c, rl = r["fused"], r["naive"], r["torch"], r["torch_compile"], r["fused_relu"]
        out.append(
            f"| {r['model']} | {r['batch']} | {r['precision']} | {_f(f['ms'])} / {_f(f['ms_isolated'])} "
            f"| {_f(n['ms'])} / {_f(n['ms_isolated'])} | {_f(t and t['ms'])} / {_f(t and t['ms_isolated'])} "
            f"| {_f(c and c['ms'])} / {_f(c and c['ms_isolated'])} | {_f(t and t['ms'] / f['ms'], 2)}x "
            f"| {_f(c and c['ms'] / f['ms'], 2)}x | {_f(rl['ms'])} / {_f(rl['ms_isolated'])} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-gelu-out", help="folder for bench-gelu.json and bench-gelu.md")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement (median reported)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    args = ap.parse_args(argv)
    ok, reason = probe_gpu()
    if not ok:
        print(f"error: needs an NVIDIA GPU ({reason})", file=sys.stderr)
        return 2
    found = record.versions("cupy", "nvmath", "torch")
    rec = {
        "date": record.today(),
        "command": record.command(argv),
        "device": record.gpu_name(),
        "cupy": found["cupy"],
        "nvmath": found["nvmath"],
        "torch": found.get("torch"),
        "python": found["python"],
        "layers": layers(args.reps),
        "steps": steps(args.reps, not args.no_compile),
    }
    record.write(args.out, "bench-gelu", rec, markdown(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
