"""GPU memory of the training step against PyTorch eager: the sections ``m`` and ``l`` of ``scripts/bench.py``.

m: for 4096 x 4 at batch 8192 and 8192 x 4 at batch 16384, fp16 and bf16: mlptrain's graph step
   (the default configuration: execution.bgrad=auto, so the bgrad probe runs and its memory counts)
   with each cuBLASLt workspace cap asked for, and PyTorch eager (autocast, fp32 master weights,
   SGD with momentum, GradScaler for fp16), each with its steady step time and peak memory. The
   mlptrain peak is the pools' high-water mark (:mod:`mlptrain.gpu.memory`), PyTorch's is
   ``torch.cuda.max_memory_reserved()``. The live bytes by category come with it.
l: the widest 4-layer MLP (widths ``[w] * 5``, ``w`` in steps of 1024) that trains at batch 16384 in
   fp16, for mlptrain and for PyTorch eager: a bisection over ``w``, each trial a fresh process that
   builds the model, runs four steps (mlptrain: two warm-up steps, the graph capture, a replay) and
   checks the loss is finite. mlptrain's trials use execution.bgrad=bgradb (the probe would time
   hundreds of steps of a model this size) and draw the initial weights on the GPU (the host draw
   of ten billion normals takes minutes; the values do not matter here). Both sides hold their
   batch on the GPU (PyTorch in fp32, as a user feeds autocast).

mlptrain runs once per ``--compute-copies`` value (``kept``, ``cast``: precision.compute_copy).

Run a trial by hand: ``python scripts/bench_memory.py --trial mlptrain --width 40960 --compute-copy cast``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

GIB = 2**30
MEMORY_MODELS = [("4096 x 4", [4096] * 5, 8192), ("8192 x 4", [8192] * 5, 16384)]


def mlptrain_memory(widths, batch, precision, reps, workspace_mib, compute_copy="kept"):
    import gc

    import cupy as cp
    from bench import CHAIN, median, step_trainer

    from mlptrain.gpu.memory import account, expected_step_peak
    from mlptrain.gpu.timing import cuda_time_ms

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    tr = step_trainer(widths, batch, precision, workspace_mib=workspace_mib, compute_copy=compute_copy)
    with tr.stream:
        xb, yb = next(iter(tr.train_loader.epoch(0, out=tr.batch_buffers)))
        chained = cuda_time_ms(lambda: tr.step(xb, yb), warmup=5, reps=reps, chain=CHAIN)
        loss = float(tr.step(xb, yb)[0])
    acc = account(tr)
    step_peak = expected_step_peak(
        tr.widths, batch, tr.precision.compute_dtype, tr.model.uses_wgrad_stream, tr.head.mode == "kernel"
    )
    out = {"ms": median(chained), "peak_gib": acc["peak_bytes"] / GIB, "peak_at": acc["peak_at"], "loss": loss,
           "bgrad": tr.model.bgrad, "account": acc, "step_peak_formula_gib": step_peak / GIB}  # fmt: skip
    tr.gemm.free()  # the caller's gc.collect() and free_all_blocks() release the rest
    return out


def free_device_caches() -> None:
    """Return what this process's CuPy and PyTorch pools cache to the device (before the trials of section l)."""
    _free_all()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _free_all() -> None:
    import gc

    import cupy as cp

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()


def memory_section(reps: int, caps: list[int | None], copies: list[str] = ("kept",)) -> tuple[list[dict], list[str]]:
    from bench import bench_step_torch, fmt

    records, md = (
        [],
        [
            "## Peak GPU memory of a training step against PyTorch eager (GiB)",
            "",
            "mlptrain: the graph step in its default configuration (bgrad probe included), peak of CuPy's pools; "
            "workspace cap: execution.workspace_mib (none: nvmath's default); copy: precision.compute_copy "
            "(kept: a half-precision copy of each parameter; cast: each layer's cast into one buffer before its "
            "GEMMs). PyTorch eager: autocast, max_memory_reserved. Step times: steady state, ms.",
            "",
            "| model | batch | dtype | workspace cap MiB | copy | mlptrain GiB | PyTorch GiB | ratio | mlptrain ms "
            "| PyTorch ms | live GiB: weights, copies, grads, optim, batch, saved, relu_aux, data, workspaces "
            "| graph pool GiB | step arrays at their peak, formula GiB | bgrad |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ],
    )
    for name, widths, batch in MEMORY_MODELS:
        for precision in ("fp16", "bf16"):
            torch_rec = bench_step_torch(widths, batch, precision, reps)
            for cap, copy in [(cap, copy) for cap in caps for copy in copies]:
                rec = mlptrain_memory(widths, batch, precision, reps, cap, copy)
                _free_all()
                rec.update(model=name, batch=batch, precision=precision, workspace_mib=cap, compute_copy=copy,
                           torch=torch_rec)  # fmt: skip
                records.append(rec)
                live = ", ".join(f"{v / GIB:.2f}" for v in rec["account"]["live_bytes"].values())
                tp = torch_rec["peak_gib"] if torch_rec else None
                ratio = f"{rec['peak_gib'] / tp:.2f}x" if tp else "-"
                row = (
                    f"| {name} | {batch} | {precision} | {cap or 'none'} | {copy} | {rec['peak_gib']:.2f} "
                    f"| {fmt(tp, 2)} | {ratio} | {rec['ms']:.3f} "
                    f"| {fmt(torch_rec['ms'] if torch_rec else None)} | {live} "
                    f"| {rec['account']['pools']['graph_total'] / GIB:.2f} | {rec['step_peak_formula_gib']:.2f} "
                    f"| {','.join(rec['bgrad'])} |"
                )
                md.append(row)
                print(row, flush=True)
    md.append("")
    return records, md


# --- the largest model ------------------------------------------------------------------------


class _DeviceNormal:
    """Stands in for the host Generator of the initial weights: draws on the GPU (bench only)."""

    def standard_normal(self, shape):
        import cupy as cp

        return cp.random.standard_normal(shape, dtype=cp.float32)


def trial_mlptrain(width: int, batch: int, compute_copy: str = "kept") -> dict:
    import cupy as cp
    from bench import step_trainer

    from mlptrain import build

    real = build.model
    build.model = lambda *a: real(*a[:-1], _DeviceNormal())  # the model's initial weights only
    try:
        tr = step_trainer([width] * 5, batch, "fp16", bgrad="bgradb", compute_copy=compute_copy)
    finally:
        build.model = real
    with tr.stream:
        xb, yb = next(iter(tr.train_loader.epoch(0, out=tr.batch_buffers)))
        for _ in range(4):
            loss = tr.step(xb, yb)[0]
        tr.stream.synchronize()
    from mlptrain.gpu.memory import account

    free, total = cp.cuda.runtime.memGetInfo()
    live = {k: round(v / GIB, 2) for k, v in account(tr)["live_bytes"].items()}
    return {"loss": float(cp.asnumpy(loss)), "peak_gib": tr.memory_peak.sample("end") / GIB,
            "device_used_gib": (total - free) / GIB, "live_gib": live}  # fmt: skip


def trial_torch(width: int, batch: int) -> dict:
    import torch

    layers = []
    for i in range(4):
        layers.append(torch.nn.Linear(width, width, device="cuda"))
        if i < 3:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(batch, width, device="cuda")
    y = torch.randint(0, width, (batch,), device="cuda")
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"loss": float(loss), "peak_gib": torch.cuda.max_memory_reserved() / GIB,
            "device_used_gib": (total - free) / GIB}  # fmt: skip


def run_trial(side: str, width: int, batch: int) -> dict | None:
    """One trial in a fresh process: its record, or None when the model does not train (out of memory).

    ``side``: ``torch``, ``mlptrain`` (precision.compute_copy=kept) or ``mlptrain-cast``."""
    who, _, copy = side.partition("-")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trial", who, "--width", str(width), "--batch", str(batch)]
    cmd += ["--compute-copy", copy] if copy else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        print(f"  {side} width {width}: does not train ({last[:160]})", flush=True)
        return None
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    ok = math.isfinite(rec["loss"])
    print(f"  {side} width {width}: trains, peak {rec['peak_gib']:.1f} GiB (device: {rec['device_used_gib']:.1f} "
          f"in use), loss {rec['loss']:.3f}{', live ' + str(rec['live_gib']) if 'live_gib' in rec else ''}",
          flush=True)  # fmt: skip
    return rec if ok else None


def largest(side: str, batch: int, lo: int, hi: int, step: int = 1024) -> tuple[int, dict]:
    """The largest multiple of ``step`` in [lo, hi) that trains (``lo`` must, ``hi`` must not)."""
    best = run_trial(side, lo, batch)
    while best is None and lo > step:
        hi, lo = lo, max(step, (lo // 2) // step * step)
        best = run_trial(side, lo, batch)
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        rec = run_trial(side, mid, batch)
        lo, hi, best = (mid, hi, rec) if rec is not None else (lo, mid, best)
    return lo, best


def largest_section(
    batch: int = 16384, ranges: dict | None = None, copies: list[str] = ("kept",)
) -> tuple[dict, list[str]]:
    """The widest model of mlptrain (each precision.compute_copy of ``copies``) and of PyTorch eager,
    each searched in ``ranges[side]`` (``(lo, hi)``: ``lo`` must train, ``hi`` must not)."""
    ranges = ranges or {}
    result, md = {}, ["## The largest model that trains (fp16, batch 16384, widths [w] * 5)", ""]
    md += ["| | widest w | parameters | peak GiB |", "|---|---|---|---|"]
    names = {"mlptrain": "mlptrain, compute_copy=kept", "mlptrain-cast": "mlptrain, compute_copy=cast",
             "torch": "PyTorch eager"}  # fmt: skip
    for side in [*(("mlptrain" if c == "kept" else f"mlptrain-{c}") for c in copies), "torch"]:
        w, rec = largest(side, batch, *ranges.get(side.partition("-")[0], (32768, 81920)))
        params = 4 * (w * w + w)
        result[side] = {"width": w, "params": params, **(rec or {})}
        row = f"| {names[side]} | {w} | {params / 1e9:.2f} B | " + (f"{rec['peak_gib']:.1f} |" if rec else "- |")
        md.append(row)
        print(row, flush=True)
    md.append("")
    return result, md


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trial", choices=["mlptrain", "torch"], required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--compute-copy", default="kept", choices=["kept", "cast"], help="mlptrain: precision.compute_copy")
    args = ap.parse_args(argv)
    np.seterr(all="ignore")
    if args.trial == "mlptrain":
        rec = trial_mlptrain(args.width, args.batch, args.compute_copy)
    else:
        rec = trial_torch(args.width, args.batch)
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
