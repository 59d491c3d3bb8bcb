"""precision=fp8 against mlptrain's bf16 step and against torchao's float8 training, in one run.

    python benchmarks/bench_fp8.py --out bench-fp8            # 4096 x 4 (batch 8192) and 8192 x 4 (batch 16384)
    python benchmarks/bench_fp8.py --out bench-fp8 --quick    # 4096 x 4 only

Per model, whole training steps (forward, loss, backward, update; SGD momentum 0.9, lr 1e-3, random
data, ReLU), each the median of --reps CUDA-event timings of 20 steps back to back after warm-up:

* mlptrain bf16 and fp8, fused, replayed from a CUDA graph (what a training run does); fp8 with the
  bfloat16 weight copy kept (``precision.compute_copy=kept``; fp8's own is ``cast``: the FP8 casts read
  the float32 weights); and fp8 naive (the same FP8 GEMMs with bias, ReLU and reductions as separate
  kernels);
* PyTorch with bf16 autocast over fp32 master weights and ``torch.compile``, and the same model
  converted by torchao (``convert_to_float8_training``, recipe ``tensorwise``, then ``torch.compile``):
  the float8 training a PyTorch user has. Skipped when torch or torchao is not importable.

Peak memory: mlptrain's pools' high-water mark; torch's ``max_memory_reserved``. Writes
``bench_fp8.json`` and ``bench_fp8.md`` (a table for docs/benchmarks.md, with the command) to --out.
Needs a GPU of compute capability 8.9+ (H100/H200); torchao is carried as a wheel (0.18.0).

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import record

from mlptrain.base.backend import probe_gpu
from mlptrain.tools.bench.medians import CHAIN, median
from mlptrain.tools.bench.step_timing import bench_step_mlptrain

MODELS = [("4096 x 4", [4096] * 5, 8192), ("8192 x 4", [8192] * 5, 16384)]
MLPTRAIN = [  # (variant, precision, execution, precision.compute_copy: None for the precision's own)
    ("mlptrain bf16", "bf16", "fused", None),
    ("mlptrain fp8", "fp8", "fused", None),
    ("mlptrain fp8, bf16 weight copy kept", "fp8", "fused", "kept"),
    ("mlptrain fp8 naive", "fp8", "naive", None),
]


def torch_step(widths: list[int], batch: int, reps: int, float8: str | None) -> dict[str, Any] | None:
    """A compiled PyTorch step in bf16 autocast; ``float8``: the torchao recipe its Linears are converted with."""
    try:
        import torch

        if float8 is not None:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        logging.warning("skipping the %s PyTorch step: %s", float8 or "bf16", exc)
        return None
    import cupy as cp

    from mlptrain.base.cuda.timing import cuda_time_ms

    torch.manual_seed(0)
    mods: list[Any] = []
    for fan_in, fan_out in zip(widths, widths[1:], strict=False):
        mods += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    net = torch.nn.Sequential(*mods[:-1]).cuda()  # fp32 master weights, no ReLU after the last Linear
    if float8 is not None:  # every Linear whose dims FP8 takes (multiples of 16), as torchao's own filter
        config = Float8LinearConfig.from_recipe_name(float8)
        convert_to_float8_training(
            net, config=config, module_filter_fn=lambda m, _: m.in_features % 16 == 0 and m.out_features % 16 == 0
        )
    compiled = torch.compile(net)
    sgd = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    inputs = torch.randn(batch, widths[0], device="cuda")
    labels = torch.randint(0, widths[-1], (batch,), device="cuda")

    def train_step() -> None:
        sgd.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = torch.nn.functional.cross_entropy(compiled(inputs), labels)
        out.backward()
        sgd.step()

    torch.cuda.reset_peak_memory_stats()
    on = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)  # CuPy's events on torch's stream
    chained = cuda_time_ms(train_step, warmup=5, reps=reps, stream=on, chain=CHAIN)
    return {"ms": median(chained), "peak_gib": torch.cuda.max_memory_reserved() / 2**30}


def model_rows(name: str, widths: list[int], batch: int, reps: int) -> list[dict[str, Any]]:
    """Every variant of one model, in one process: the mlptrain steps, then PyTorch's."""
    rows = []
    for label, precision, mode, copy in MLPTRAIN:
        r = bench_step_mlptrain(widths, batch, precision, mode, reps, graph=True, compute_copy=copy)
        kept = {key: r[key] for key in ("ms", "peak_gib", "losses", "bgrad")}
        rows.append({"model": name, "batch": batch, "variant": label, **kept})
        logging.warning("%s %s: %.3f ms, peak %.2f GiB", name, label, r["ms"], r["peak_gib"])
    for label, recipe in (("torch.compile bf16", None), ("torchao float8 tensorwise", "tensorwise")):
        r = torch_step(widths, batch, reps, recipe)
        if r is not None:
            rows.append({"model": name, "batch": batch, "variant": label, **r})
            logging.warning("%s %s: %.3f ms, peak %.2f GiB", name, label, r["ms"], r["peak_gib"])
            sys.modules["torch"].cuda.empty_cache()  # the next variant starts from torch's pool emptied
    return rows


def markdown(rows: list[dict[str, Any]], stack: dict[str, Any]) -> str:
    """The table: ms per step, and how much faster mlptrain fp8 is than each of the others."""
    lines = [
        f"Measured {stack['date']} on {stack['gpu']} ({stack['versions']}). Command: `{stack['command']}`.",
        f"Medians of {stack['reps']} timings of {CHAIN} steps back to back; SGD momentum, ReLU, random data.",
        "",
        "| model, batch | variant | ms / step | fp8 speed-up over it | peak GiB |",
        "|---|---|---|---|---|",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        fp8 = next((r["ms"] for r in mine if r["variant"] == "mlptrain fp8"), None)
        for r in mine:
            ratio = f"{r['ms'] / fp8:.2f}x" if fp8 and r["variant"] != "mlptrain fp8" else "-"
            lines.append(f"| {model}, {r['batch']} | {r['variant']} | {r['ms']:.3f} | {ratio} | {r['peak_gib']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-fp8", help="folder for bench_fp8.json and bench_fp8.md")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per variant (median reported)")
    ap.add_argument("--quick", action="store_true", help="4096 x 4 only")
    args = ap.parse_args(argv)
    available, reason = probe_gpu()
    if not available:
        print(f"bench_fp8.py needs an NVIDIA GPU with CuPy and nvmath-python: {reason}", file=sys.stderr)
        return 2
    found = record.versions("nvmath", "cupy", "torch", "torchao")
    names = {"nvmath": "nvmath-python", "cupy": "CuPy"}
    stack = {
        "gpu": record.gpu_name(),
        "date": record.today(),
        "versions": ", ".join(f"{names.get(m, m)} {v}" for m, v in found.items() if m != "python"),
        "reps": args.reps,
        "command": record.command(argv),
    }
    rows = []
    for name, widths, batch in MODELS[:1] if args.quick else MODELS:
        rows += model_rows(name, widths, batch, args.reps)
    record.write(args.out, "bench_fp8", {"stack": stack, "rows": rows}, markdown(rows, stack))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
