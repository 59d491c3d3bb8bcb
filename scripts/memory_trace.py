"""Where a training step's memory peaks: every allocation of one eager step, by phase and call site (#16).

A CuPy ``MemoryHook`` follows the default pool's live bytes through one step (after two warm-up
steps) of mlptrain's fused trainer, ``graph=false`` so that each allocation is a Python call,
tagged by phase: ``forward``, ``head+backward`` (the loss), ``head+backward/model.backward`` (the
layers' GEMMs), ``optimizer``, ``scaler.check``. At the peak it lists what the step had allocated
and still held, grouped by phase and call site, beside the live bytes by category of
:mod:`mlptrain.step.cuda.memory`. The arrays alive before the step (parameters, optimizer state, the
dataset, the previous step's saved inputs and gradients) are the base; what the step frees of
them counts down from it.

``--graph``: the step as a training run takes it (warm-up steps and the capture into a CUDA graph,
whose private pool receives everything the step allocates): every block the pool reserves from
the device (``cudaMalloc``), with its size, phase, call site and stream, beside the bytes the pool
has in use then. Where the pool reserves more than the step's arrays need at their peak
(:func:`mlptrain.step.memory.expected_step_peak`), these lines say which allocation found no free
block to reuse.

Needs a GPU. Usage: python scripts/memory_trace.py [--graph] [--out DIR]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import traceback
from pathlib import Path

import mlptrain

MIB = 2**20
PACKAGE = str(Path(mlptrain.__file__).resolve().parent)  # allocations are placed by the frames in here
CASES = [("8192 x 4", [8192] * 5, 16384, "fp16"), ("4096 x 4", [4096] * 5, 8192, "fp16"),
         ("8192 x 4", [8192] * 5, 16384, "bf16")]  # fmt: skip
PHASE = ["idle"]


def tag(obj, name: str, label: str) -> None:
    """Wrap ``obj.name`` so that allocations inside it are tagged ``label`` (nested: ``outer/label``)."""
    f = getattr(obj, name)

    @functools.wraps(f)
    def tagged(*a, **k):
        old = PHASE[0]
        PHASE[0] = label if old == "idle" else f"{old}/{label}"
        try:
            return f(*a, **k)
        finally:
            PHASE[0] = old

    setattr(obj, name, tagged)


def make_trace():
    from cupy.cuda import memory_hook

    class Trace(memory_hook.MemoryHook):
        """Net bytes allocated since the hook was entered, their high-water mark, and what was live then."""

        name = "mlptrain-trace"

        def __init__(self) -> None:
            self.live: dict[int, tuple[int, str, str]] = {}
            self.total = self.peak = 0
            self.at_peak: tuple[str, dict] = ("none", {})

        def malloc_postprocess(self, **kw) -> None:
            # mlptrain's own frames (the call sites in the library), innermost first
            ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(PACKAGE)]
            where = " < ".join(f"{Path(f.filename).name}:{f.name}:{f.lineno}" for f in reversed(ours[-3:]))
            self.live[kw["mem_ptr"]] = (kw["mem_size"], PHASE[0], where)
            self.total += kw["mem_size"]
            if self.total > self.peak:
                self.peak, self.at_peak = self.total, (PHASE[0], dict(self.live))

        def free_postprocess(self, **kw) -> None:
            mine = self.live.pop(kw["mem_ptr"], None)
            self.total -= mine[0] if mine is not None else kw["mem_size"]  # arrays of before the step too

    return Trace()


def make_reserve_trace():
    from cupy.cuda import memory_hook

    class Reserve(memory_hook.MemoryHook):
        """Blocks reserved from the device (``alloc``) and the pool's bytes in use at that moment."""

        name = "mlptrain-reserve"

        def __init__(self) -> None:
            self.used = 0
            self.sizes: dict[int, int] = {}
            self.events: list[tuple] = []

        def alloc_postprocess(self, **kw) -> None:
            import cupy as cp

            ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(PACKAGE)]
            where = " < ".join(f"{Path(f.filename).name}:{f.name}:{f.lineno}" for f in reversed(ours[-3:]))
            stream = cp.cuda.get_current_stream().ptr
            self.events.append((PHASE[0], kw["mem_size"], self.used, stream, where))

        def malloc_postprocess(self, **kw) -> None:
            self.sizes[kw["mem_ptr"]] = kw["mem_size"]
            self.used += kw["mem_size"]

        def free_postprocess(self, **kw) -> None:
            self.used -= self.sizes.pop(kw["mem_ptr"], 0)

    return Reserve()


def trace_graph_case(widths, batch, precision) -> dict:
    """Reservations of the step's graph pool through its warm-up steps and capture."""
    from mlptrain.step.cuda.memory import account, expected_step_peak
    from mlptrain.tools.bench.step_trainer import step_trainer

    tr = step_trainer(widths, batch, precision, graph=True, bgrad="bgradb")
    tag(tr.model, "forward", "forward")
    tag(tr.head, "backward", "head+backward")
    tag(tr.optimizer, "step", "optimizer")
    trace = make_reserve_trace()
    with tr.stream:
        xb, yb = next(iter(tr.train_loader.epoch(0, out=tr.batch_buffers)))
        with trace:
            for i in range(3):  # two warm-up steps and the capture
                PHASE[0] = f"step {i}"
                tr.step(xb, yb)
                PHASE[0] = "idle"
        tr.stream.synchronize()
    acc = account(tr)
    tr.gemm.free()
    return {
        "graph_pool_mib": acc["pools"]["graph_total"] / MIB,
        "step_peak_formula_mib": expected_step_peak(
            tr.widths, batch, tr.precision.compute_dtype, tr.model.uses_wgrad_stream, tr.head.mode == "kernel"
        )
        / MIB,
        "reserved": [
            (ph, round(size / MIB, 2), round(used / MIB, 2), stream, where)
            for ph, size, used, stream, where in trace.events
        ],  # fmt: skip
    }


def trace_case(widths, batch, precision) -> dict:
    import cupy as cp

    from mlptrain.step.cuda.memory import account
    from mlptrain.tools.bench.step_trainer import step_trainer

    pool = cp.get_default_memory_pool()
    tr = step_trainer(widths, batch, precision, graph=False, bgrad="bgradb")
    tag(tr.model, "forward", "forward")
    tag(tr.head, "backward", "head+backward")
    tag(tr.model, "backward", "model.backward")
    tag(tr.optimizer, "step", "optimizer")
    tag(tr.scaler, "check", "scaler.check")
    with tr.stream:
        xb, yb = next(iter(tr.train_loader.epoch(0, out=tr.batch_buffers)))
        for _ in range(2):
            tr.step(xb, yb)
        tr.stream.synchronize()
        base = pool.used_bytes()
        trace = make_trace()
        with trace:
            tr.step(xb, yb)
            tr.stream.synchronize()
    phase, live = trace.at_peak
    by_site: dict[tuple[str, str], int] = {}
    for size, ph, where in live.values():
        by_site[ph, where] = by_site.get((ph, where), 0) + size
    acc = account(tr)
    tr.gemm.free()
    return {
        "base_used_mib": base / MIB,
        "peak_used_mib": (base + trace.peak) / MIB,
        "peak_phase": phase,
        "held_at_peak": [
            (ph, where, round(n / MIB, 1)) for (ph, where), n in sorted(by_site.items(), key=lambda kv: -kv[1])
        ],
        "account": {k: v for k, v in acc.items() if k != "samples"},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for memory_trace.json")
    ap.add_argument("--graph", action="store_true", help="the graph pool's reservations through warm-up and capture")
    args = ap.parse_args(argv)
    import cupy as cp

    results = {}
    for name, widths, batch, precision in CASES:
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
        if args.graph:
            r = results[f"{name} {precision}"] = trace_graph_case(widths, batch, precision)
            print(f"===== {name}, batch {batch}, {precision}: graph pool {r['graph_pool_mib']:.0f} MiB, "
                  f"the step's arrays at their peak {r['step_peak_formula_mib']:.0f} MiB (formula)")  # fmt: skip
            for row in r["reserved"]:
                print("    reserved (phase, MiB, MiB in use before, stream, call site):", row)
            continue
        r = results[f"{name} {precision}"] = trace_case(widths, batch, precision)
        print(f"===== {name}, batch {batch}, {precision}: used before the step {r['base_used_mib']:.0f} MiB, "
              f"at the peak {r['peak_used_mib']:.0f} MiB, in {r['peak_phase']}")  # fmt: skip
        for row in r["held_at_peak"]:
            print("    allocated by the step and held at the peak:", row)
        print("    live bytes by category:", json.dumps(r["account"].get("live_bytes")))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "memory_trace.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
