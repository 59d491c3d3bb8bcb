"""CPU training steps with one BLAS thread against the library's default, per model size (issue #27).

    python scripts/bench_blas_threads.py [--steps 60] [--repeats 3]

For each size, the median over ``--repeats`` of the mean step time of ``--steps`` steps (after 5
warm-up steps), with ``threadpoolctl.threadpool_limits(1, "blas")`` and without; the rule of
:func:`mlptrain.base.backend.blas_threads` was chosen from these numbers (docs/benchmarks.md). Run a CPU
hog beside it (``python -c 'while True: pass' &``) to see a busy machine.

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import statistics
import time

from threadpoolctl import threadpool_info, threadpool_limits

from mlptrain.config.schema import DatasetName, Device, TrainConfig
from mlptrain.step import build
from mlptrain.step.trainer import Trainer

# (features, hidden, batch): the default digits run, then larger steps
SIZES = [
    (64, [128, 128], 64),
    (64, [128, 128], 256),
    (784, [256, 256], 128),
    (784, [512, 512], 256),
    (784, [1024, 1024], 256),
    (784, [1024, 1024], 1024),
]


def trainer(features: int, hidden: list[int], batch: int) -> Trainer:
    cfg = TrainConfig()
    cfg.device, cfg.progress, cfg.model.hidden = Device.cpu, False, hidden
    cfg.data.name, cfg.data.features, cfg.data.batch_size = DatasetName.synthetic, features, batch
    cfg.data.samples = 4 * batch
    return Trainer(cfg)


def step_ms(tr: Trainer, steps: int) -> float:
    batches = list(tr.train_loader.epoch(0))
    for i in range(5):
        tr.step(*batches[i % len(batches)])
    t0 = time.perf_counter()
    for i in range(steps):
        tr.step(*batches[i % len(batches)])
    return (time.perf_counter() - t0) / steps * 1e3


def _size(text: str) -> tuple[int, list[int], int]:
    features, hidden, batch = text.split(":")
    return int(features), [int(h) for h in hidden.split("x")], int(batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default=None, help="features:hidden:batch,... e.g. 784:2048x2048:2048; default SIZES")
    args = ap.parse_args()
    sizes = SIZES if args.sizes is None else [_size(s) for s in args.sizes.split(",")]
    default = max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")
    print(f"| widths | batch | GFLOP per step | 1 thread (ms) | {default} threads (ms) | default / 1 |")
    print("|---|---|---|---|---|---|")
    for features, hidden, batch in sizes:
        tr = trainer(features, hidden, batch)
        times = {1: [], default: []}
        for _ in range(args.repeats):
            for n in times:
                with threadpool_limits(n, user_api="blas"):
                    times[n].append(step_ms(tr, args.steps))
        one, many = (statistics.median(times[n]) for n in (1, default))
        gflop = build.step_flops(tr.widths, batch) / 1e9
        widths = "-".join(map(str, tr.widths))
        print(f"| {widths} | {batch} | {gflop:.3f} | {one:.2f} | {many:.2f} | {many / one:.2f} |")


if __name__ == "__main__":
    main()
