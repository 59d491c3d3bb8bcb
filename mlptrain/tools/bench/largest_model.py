"""The widest 4-layer MLP that trains, mlptrain against PyTorch eager (``scripts/bench.py`` section l).

Widths ``[w] * 5``, ``w`` in steps of 1024, at batch 16384 in fp16: a bisection over ``w``, each
trial a fresh process (``python -m mlptrain.tools.bench.largest_model --trial ...``) that builds the
model, runs four steps (mlptrain: two warm-up steps, the graph capture, a replay) and checks the
loss is finite. mlptrain's trials use execution.bgrad=bgradb (the probe would time hundreds of
steps of a model this size) and draw the initial weights on the GPU (the host draw of ten billion
normals takes minutes; the values do not matter here). Both sides hold their batch on the GPU
(PyTorch in fp32, as a user feeds autocast).

Run a trial by hand: ``python -m mlptrain.tools.bench.largest_model --trial mlptrain --width 40960 --compute-copy cast``
(or ``python scripts/bench_memory.py`` with the same arguments).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from mlptrain.base.backend import get_backend
from mlptrain.config.schema import COMPUTE_COPIES
from mlptrain.tools.bench.step_trainer import step_trainer

GIB = 2**30


class _DeviceNormal:
    """Stands in for the host Generator of the initial weights: draws on the GPU (bench only)."""

    def standard_normal(self, shape):
        cp = get_backend("gpu").xp

        return cp.random.standard_normal(shape, dtype=cp.float32)


def trial_mlptrain(width: int, batch: int, compute_copy: str = "kept") -> dict:
    cp = get_backend("gpu").xp

    from mlptrain.step import build

    real: Any = build.model
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
    from mlptrain.step.cuda.memory import account

    free, total = cp.cuda.runtime.memGetInfo()
    live = {k: round(v / GIB, 2) for k, v in account(tr)["live_bytes"].items()}
    return {
        "loss": float(cp.asnumpy(loss)),
        "peak_gib": tr.memory_peak.sample("end") / GIB,
        "device_used_gib": (total - free) / GIB,
        "live_gib": live,
    }


def trial_torch(width: int, batch: int) -> dict:
    import torch

    layers: list[Any] = []
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
    return {
        "loss": float(loss),
        "peak_gib": torch.cuda.max_memory_reserved() / GIB,
        "device_used_gib": (total - free) / GIB,
    }


def run_trial(side: str, width: int, batch: int) -> dict | None:
    """One trial in a fresh process: its record, or None when the model does not train (out of memory).

    ``side``: ``torch``, ``mlptrain`` (precision.compute_copy=kept) or ``mlptrain-cast``."""
    who, _, copy = side.partition("-")
    cmd = [sys.executable, "-m", "mlptrain.tools.bench.largest_model", "--trial", who, "--width", str(width)]
    cmd += ["--batch", str(batch)]
    cmd += ["--compute-copy", copy] if copy else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        print(f"  {side} width {width}: does not train ({last[:160]})", flush=True)
        return None
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    ok = math.isfinite(rec["loss"])
    print(
        f"  {side} width {width}: trains, peak {rec['peak_gib']:.1f} GiB (device: {rec['device_used_gib']:.1f} "
        f"in use), loss {rec['loss']:.3f}{', live ' + str(rec['live_gib']) if 'live_gib' in rec else ''}",
        flush=True,
    )
    return rec if ok else None


def largest(side: str, batch: int, lo: int, hi: int, step: int = 1024) -> tuple[int, dict | None]:
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
    batch: int = 16384, ranges: dict | None = None, copies: Sequence[str] = ("kept",)
) -> tuple[dict, list[str]]:
    """The widest model of mlptrain (each precision.compute_copy of ``copies``) and of PyTorch eager,
    each searched in ``ranges[side]`` (``(lo, hi)``: ``lo`` must train, ``hi`` must not)."""
    ranges = ranges or {}
    result, md = {}, ["## The largest model that trains (fp16, batch 16384, widths [w] * 5)", ""]
    md += ["| | widest w | parameters | peak GiB |", "|---|---|---|---|"]
    names = {
        "mlptrain": "mlptrain, compute_copy=kept",
        "mlptrain-cast": "mlptrain, compute_copy=cast",
        "torch": "PyTorch eager",
    }
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
    ap.add_argument("--compute-copy", default="kept", choices=COMPUTE_COPIES, help="mlptrain: precision.compute_copy")
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
