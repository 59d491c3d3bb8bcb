"""PyTorch DistributedDataParallel's training step, the peer of benchmarks/bench_distributed.py.

Run by torchrun (``torchrun --nproc_per_node=N benchmarks/bench_ddp.py --widths ... --batch B
--precision fp16``): one process per GPU, NCCL, ``DistributedDataParallel`` over an MLP of
``nn.Linear`` and ``nn.ReLU``, autocast with fp32 master weights, SGD with momentum 0.9,
``GradScaler`` for fp16, ``B`` rows per GPU of random data. CUDA events around 20 steps back to
back after 5 warm-up steps, median of ``--reps``; rank 0 prints one JSON line.

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", required=True, help="comma-separated layer widths, e.g. 4096,4096,4096,4096,4096")
    ap.add_argument("--batch", type=int, required=True, help="rows per GPU")
    ap.add_argument("--precision", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers).cuda(), device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    dtype = torch.float16 if args.precision == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=args.precision == "fp16")
    x = torch.randn(args.batch, widths[0], device="cuda")
    y = torch.randint(0, widths[-1], (args.batch,), device="cuda")
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 20)
    ms = statistics.median(times)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(
            json.dumps(
                {"ms": ms, "world": world, "samples_per_s": world * args.batch / ms * 1e3, "torch": torch.__version__}
            ),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
