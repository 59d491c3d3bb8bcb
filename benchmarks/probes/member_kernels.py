"""Where an ensemble's training step spends its GPU time, kernel by kernel (#50).

For the two cases of ``benchmarks/bench_members.py`` (8 members of 256-1024-1024-10, 32 of 64-256-256-2, batch
256, bf16), one model and the ensemble, with and without a CUDA graph: the step's steady time (CUDA events, a
chain of steps, median) and each kernel's GPU time per step from PyTorch's CUPTI-based profiler (as
``step_kernels.py --profile`` reads them). Writes ``member_kernels.json`` into ``$OUT`` (default: the current
folder).

Usage: python benchmarks/probes/member_kernels.py [KEY=VALUE ...]   (settings of every run, as on the command line of
``python -m mlptrain``: execution.epilogue_kernels=false; a GPU with CuPy and nvmath-python, PyTorch for the profile)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CASES = {"big": (256, [1024, 1024], 10, 8), "small": (64, [256, 256], 2, 32)}


def profile_kernels(fn, reps: int) -> list[tuple[str, float]]:
    """``[(kernel name, mean GPU microseconds per call of fn)]``, largest first, from PyTorch's profiler."""
    import cupy as cp
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        cp.cuda.get_current_stream().synchronize()
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


def measure(tr) -> tuple[float, list[tuple[str, float]]]:
    """``tr``'s steady step time (ms) and its kernels' GPU time per step, on 8 of its batches in turn."""
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
        return median(cuda_time_ms(step, warmup=2, reps=20, chain=CHAIN)), profile_kernels(step, 10)


def main() -> int:
    import cupy as cp

    out = {}
    for case, (features, hidden, classes, k) in CASES.items():
        for members in (1, k):
            for graph in (True, False):
                ms, kernels = measure(trainer(features, hidden, classes, members, graph, sys.argv[1:]))
                key = f"{case}-K{members}-{'graph' if graph else 'eager'}"
                total = sum(us for _, us in kernels)
                out[key] = {"step_ms": ms, "gpu_us_total": total, "kernels_us": kernels}
                print(f"== {key}: step {ms:.4f} ms, kernel GPU time {total:.1f} us/step, {len(kernels)} kernels")
                for name, us in kernels[:25]:
                    print(f"   {us:8.2f}  {name[:110]}")
                cp.get_default_memory_pool().free_all_blocks()
    (Path(os.environ.get("OUT", ".")) / "member_kernels.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
