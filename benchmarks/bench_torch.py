"""A PyTorch training loop with ``mlptrain.torch.FusedMLP`` against the same loop with ``nn.Sequential`` (issue #33).

Needs an NVIDIA GPU, PyTorch with CUDA and nvmath-python (``pip install 'mlptrain[torch,cu13]'``).

The loop is what a PyTorch user writes: fp32 parameters, ``torch.autocast`` to bf16 or fp16,
``GradScaler`` for fp16 (bf16 runs without one), ``SGD(lr=1e-3, momentum=0.9)``, cross-entropy on
random labels. The two models have the same parameters (FusedMLP loads nn.Sequential's state_dict),
each run eager and with ``torch.compile`` of the model and loss (default mode, ``fullgraph=True`` for
FusedMLP: its custom ops must not break the graph). Shapes: 784-1024-1024-10 at batch 256 and
4096 x 4 (five widths of 4096) at batch 8192.

Timing: CUDA events on torch's current stream after ``--warmup`` steps (torch.compile compiles
there, FusedMLP plans its GEMMs and, at 4096 x 4, measures its bias-gradient strategy), medians of
``--reps``: *steady* is ``--chain`` steps back to back between two events, divided (the host queues
the next step while the GPU runs this one: a training loop); *isolated* one step at a time.

Checked before timing: one step of each variant from the same parameters and batch gives the loss
and parameter gradients of eager nn.Sequential within half precision's error (norm-wise relative
error in the table; over 5e-2 marks the row FAILED).

Usage: python benchmarks/bench_torch.py --out DIR [--reps N] [--chain N] [--warmup N] [--modes eager,compile]
(``--modes eager,compile,reduce-overhead`` adds ``torch.compile(mode="reduce-overhead")``: CUDA graphs.)
Writes DIR/bench_torch.md (the table) and DIR/bench_torch.json (every figure and the stack).

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path
from typing import Any

import record

MODELS = [("784-1024-1024-10", [784, 1024, 1024, 10], 256), ("4096 x 4", [4096] * 5, 8192)]
DTYPES = ("bf16", "fp16")
KINDS = {"sequential": "nn.Sequential", "fused": "FusedMLP"}
# torch.compile's options per mode; "reduce-overhead" replays CUDA graphs (cudagraph trees)
MODES = {"eager": None, "compile": {}, "reduce-overhead": {"mode": "reduce-overhead"}}
CHECK_TOL = 5e-2


def build(kind: str, widths: list[int], reference: Any) -> Any:
    """nn.Sequential(Linear, ReLU, ..., Linear) or FusedMLP, on the GPU, with the reference's parameters."""
    import torch

    from mlptrain.torch import FusedMLP

    if kind == "fused":
        model = FusedMLP(widths, device="cuda")
    else:
        layers: list[Any] = []
        for i in range(len(widths) - 1):
            layers.append(torch.nn.Linear(widths[i], widths[i + 1], device="cuda"))
            if i < len(widths) - 2:
                layers.append(torch.nn.ReLU())
        model = torch.nn.Sequential(*layers)
    if reference is not None:
        model.load_state_dict(reference.state_dict())  # the same keys: 0.weight, 0.bias, 2.weight, ...
    return model


class Loop:
    """One training loop: model, SGD momentum, autocast, GradScaler (fp16), on fixed random data."""

    def __init__(self, kind: str, mode: str, widths: list[int], batch: int, precision: str, reference: Any) -> None:
        import torch

        self.model = build(kind, widths, reference)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        self.scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
        g = torch.Generator(device="cuda").manual_seed(0)
        self.x = torch.randn(batch, widths[0], device="cuda", generator=g)
        self.y = torch.randint(0, widths[-1], (batch,), device="cuda", generator=g)
        loss = lambda x, y: torch.nn.functional.cross_entropy(self.model(x), y)
        options = MODES[mode]
        self.loss = loss if options is None else torch.compile(loss, fullgraph=kind == "fused", **options)

    def backward(self) -> Any:
        """Forward and backward of the loss, no update: the loss and the gradients it leaves."""
        import torch

        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=self.dtype):
            loss = self.loss(self.x, self.y)
        self.scaler.scale(loss).backward()
        return loss

    def step(self) -> None:
        self.backward()
        self.scaler.step(self.opt)
        self.scaler.update()


def check(loop: Loop, reference: Loop) -> float:
    """Largest norm-wise relative error of ``loop``'s loss and gradients against ``reference``'s, one backward each."""
    losses = [lp.backward().float() for lp in (loop, reference)]
    scales = [lp.scaler.get_scale() if lp.scaler.is_enabled() else 1.0 for lp in (loop, reference)]
    errors = [(losses[0] - losses[1]).abs().item() / losses[1].abs().item()]
    for p, q in zip(loop.model.parameters(), reference.model.parameters(), strict=True):
        a, b = p.grad.double() / scales[0], q.grad.double() / scales[1]
        errors.append(((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    return max(errors)


def time_steps(loop: Loop, warmup: int, reps: int, chain: int) -> dict[str, float]:
    """Median ms per step, steady (``chain`` steps per event pair) and isolated (one), on CUDA events."""
    import torch

    for _ in range(warmup):
        loop.step()
    torch.cuda.synchronize()
    out = {}
    for name, n in (("isolated", 1), ("steady", chain)):
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                loop.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / n)
        out[name] = statistics.median(times)
    return out


def bench_case(widths: list[int], batch: int, precision: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    reference_model = build("sequential", widths, None)
    row: dict[str, Any] = {"widths": widths, "batch": batch, "precision": precision}
    eager_ref = Loop("sequential", "eager", widths, batch, precision, reference_model)
    for mode in args.modes:
        for kind in KINDS:
            name = f"{kind} {mode}"
            loop = Loop(kind, mode, widths, batch, precision, reference_model)
            row[f"{name} check"] = check(loop, eager_ref)
            torch.cuda.reset_peak_memory_stats()
            row[name] = time_steps(loop, args.warmup, args.reps, args.chain)
            row[f"{name} peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            print(
                f"{widths} batch {batch} {precision} {name}: {row[name]} check {row[name + ' check']:.2g}", flush=True
            )
            del loop
            torch.cuda.empty_cache()
    return row


def _ratio(ms: dict[str, float], slow: str, fast: str) -> str:
    return f"{ms[slow] / ms[fast]:.2f}x" if slow in ms and fast in ms else "-"


def table(rows: list[dict[str, Any]], timing: str, modes: list[str]) -> list[str]:
    """Markdown rows of one timing (steady or isolated): ms per step, per mode nn.Sequential and FusedMLP, and
    the speed-up of FusedMLP over nn.Sequential per mode."""
    names = [f"{kind} {mode}" for mode in modes for kind in KINDS]
    head = [f"{KINDS[name.split()[0]]} {name.split()[1]}" for name in names]
    head += [f"{mode}: Sequential / Fused" for mode in modes] + ["worst check"]
    lines = ["| model | batch | dtype | timing | " + " | ".join(head) + " |", "|---" * (len(head) + 4) + "|"]
    for r in rows:
        ms = {v: r[v][timing] for v in names if v in r}
        worst = max(v for k, v in r.items() if k.endswith(" check"))
        model = next(name for name, w, _ in MODELS if w == r["widths"])
        cells = [f"{ms[v]:.3f}" if v in ms else "-" for v in names]
        cells += [_ratio(ms, f"sequential {mode}", f"fused {mode}") for mode in modes]
        cells.append(f"{worst:.1e}" + (" FAILED" if worst > CHECK_TOL else ""))
        lines.append(f"| {model} | {r['batch']} | {r['precision']} | {timing} | " + " | ".join(cells) + " |")
    return lines


def stack() -> dict[str, str]:
    import nvmath
    import torch

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "nvmath": nvmath.__version__,
        "python": record.versions()["python"],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for bench_torch.md and bench_torch.json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chain", type=int, default=20, help="steps per event pair in the steady timing")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument(
        "--modes", default="eager,compile", help=f"comma-separated, of {list(MODES)} (reduce-overhead: CUDA graphs)"
    )
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    if not set(args.modes) <= set(MODES):
        ap.error(f"--modes {','.join(args.modes)}: expected a comma-separated list of {list(MODES)}")
    rows = [bench_case(widths, batch, p, args) for _, widths, batch in MODELS for p in DTYPES]
    info = stack()
    command = record.command()
    where = f"{info['gpu']}, PyTorch {info['torch']} (CUDA {info['cuda']}), nvmath {info['nvmath']}, {info['date']}"
    text = [f"`{command}`, {where}; ms per training step (median)", ""]
    text += table(rows, "steady", args.modes) + table(rows, "isolated", args.modes)[2:]
    record.write(args.out, "bench_torch", {"stack": info, "rows": rows}, "\n".join(text))


if __name__ == "__main__":
    main()
