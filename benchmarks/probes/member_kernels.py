"""Where an ensemble's training step spends its GPU time, kernel by kernel (#50).

For the two cases of ``benchmarks/bench_members.py`` (8 members of 256-1024-1024-10, 32 of 64-256-256-2, batch
256, bf16), one model and the ensemble, with and without a CUDA graph: the step's steady time (CUDA events, a
chain of steps, median) and each kernel's GPU time per step from PyTorch's CUPTI-based profiler (as
``step_kernels.py --profile`` reads them). Writes ``member_kernels.json`` into ``$OUT`` (default: the current
folder); with ``MEMBER_TRACES=1`` also each graphed case's profile timeline, ``trace-<case>.json``, which
``benchmarks/probes/step_timeline.py`` reads.

Usage: python benchmarks/probes/member_kernels.py [KEY=VALUE ...]   (settings of every run, as on the command line of
``python -m mlptrain``: execution.epilogue_kernels=false; a GPU with CuPy and nvmath-python, PyTorch for the profile)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CASES = {"big": (256, [1024, 1024], 10, 8), "small": (64, [256, 256], 2, 32)}


def profile_kernels(fn, reps: int, trace: Path | None = None) -> list[tuple[str, float]]:
    """``[(kernel name, mean GPU microseconds per call of fn)]``, largest first, from PyTorch's profiler; with
    ``trace``, the profile's timeline is written there too (Chrome's trace format: each kernel's stream, start and
    duration, for ``benchmarks/probes/step_timeline.py``)."""
    import cupy as cp
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        cp.cuda.get_current_stream().synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us() / reps
    return sorted(totals.items(), key=lambda kv: -kv[1])


def trainer(features: int, hidden: list[int], classes: int, members: int, graph: bool, settings: list[str]):
    from mlptrain.cli.main import compose_config
    from mlptrain.run.ensemble import EnsembleTrainer
    from mlptrain.step.trainer import Trainer

    overrides = [
        "device=gpu",
        "data=synthetic",
        "data.samples=16384",
        f"data.features={features}",
        f"data.classes={classes}",
        "data.batch_size=256",
        f"model.hidden=[{','.join(map(str, hidden))}]",
        "precision=bf16",
        f"ensemble.size={members}",
        "progress=false",
        f"graph={str(graph).lower()}",
        *settings,
    ]
    cfg = compose_config(overrides)
    return EnsembleTrainer(cfg) if members > 1 else Trainer(cfg)


def measure(tr, trace: Path | None = None) -> tuple[float, list[tuple[str, float]]]:
    """``tr``'s steady step time (ms) and its kernels' GPU time per step, on 8 of its batches in turn (the profile's
    timeline written to ``trace`` if given)."""
    from mlptrain.base.cuda.timing import cuda_time_ms
    from mlptrain.tools.bench.medians import CHAIN, median

    with tr.stream:
        it = iter(tr.train_batches(0))
        batches = [next(it) for _ in range(8)]
        done = [0]

        def step() -> None:
            x, y = batches[done[0] % len(batches)]
            done[0] += 1
            tr.step(x, y)

        for _ in range(5):
            step()
        return median(cuda_time_ms(step, warmup=2, reps=20, chain=CHAIN)), profile_kernels(step, 10, trace)


def update_bytes(tr) -> int:
    """Bytes the optimizer's update moves a step: each parameter's master and state read and written, its gradient
    read, its compute copy (if kept) written."""
    total = 0
    for p in tr.model.params:
        state = sum(a.nbytes for a in tr.optimizer.state[p.name].values())
        copy = p.compute.nbytes if p.has_compute_copy else 0
        total += 2 * (p.value.nbytes + state) + p.grad.nbytes + copy
    return total


def copy_tb_s(nbytes: int = 256 * 2**20) -> float:
    """A device-to-device copy's rate (bytes read plus written per second, in TB/s): the memory's practical peak."""
    import cupy as cp

    from mlptrain.base.cuda.timing import cuda_time_ms
    from mlptrain.tools.bench.medians import median

    src, dst = cp.ones(nbytes // 4, dtype=cp.float32), cp.empty(nbytes // 4, dtype=cp.float32)
    ms = median(cuda_time_ms(lambda: cp.copyto(dst, src), warmup=3, reps=20))
    return 2 * nbytes / (ms * 1e-3) / 1e12


def main() -> int:
    import cupy as cp

    out_dir = Path(os.environ.get("OUT", "."))
    traces = os.environ.get("MEMBER_TRACES") == "1"  # also write each graphed step's timeline
    out: dict = {"copy_tb_s": copy_tb_s()}
    print(f"== a device copy of 256 MiB: {out['copy_tb_s']:.2f} TB/s (read + written)")
    for case, (features, hidden, classes, k) in CASES.items():
        for members in (1, k):
            for graph in (True, False):
                tr = trainer(features, hidden, classes, members, graph, sys.argv[1:])
                key = f"{case}-K{members}-{'graph' if graph else 'eager'}"
                ms, kernels = measure(tr, out_dir / f"trace-{key}.json" if graph and traces else None)
                total = sum(us for _, us in kernels)
                moved = update_bytes(tr)
                update_us = sum(us for name, us in kernels if name.startswith("mlptrain_") and "_step" in name)
                out[key] = {"step_ms": ms, "gpu_us_total": total, "kernels_us": kernels, "update_bytes": moved}
                print(f"== {key}: step {ms:.4f} ms, kernel GPU time {total:.1f} us/step, {len(kernels)} kernels")
                print(f"   the update moves {moved / 1e6:.1f} MB: {moved / (update_us * 1e-6) / 1e12:.2f} TB/s")
                for name, us in kernels[:25]:
                    print(f"   {us:8.2f}  {name[:110]}")
                cp.get_default_memory_pool().free_all_blocks()
    (out_dir / "member_kernels.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
