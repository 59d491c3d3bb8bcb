"""Data parallel on the GPUs of one host: mlptrain on 1 and N GPUs, against PyTorch DDP on the same.

For each model and precision (fp16, bf16), with the same rows per GPU:

* mlptrain, 1 GPU: the training step replayed from a CUDA graph (``graph=true``);
* mlptrain, N GPUs: one process per GPU (spawned, as ``distributed.gpus=N``), NCCL all-reduces
  inside the captured step, each layer's weight gradient reduced on the side stream as soon as
  it is made;
* PyTorch ``DistributedDataParallel`` through ``torchrun`` on 1 and N GPUs (benchmarks/bench_ddp.py:
  autocast, fp32 master weights, SGD momentum, GradScaler for fp16).

Models: 4096 x 4 at 8192 rows per GPU, and 784-1024-1024-10 at 256 rows per GPU (where the
all-reduce's latency, not its bandwidth, sets the pace). Throughput is samples per second of the
global batch: ``world x rows per GPU / step time``. Step time: CUDA events around 20 steps back
to back after warm-up (capture included), median of ``--reps``, on rank 0; random data. After the
timing every rank reports a digest of its parameters, and the script checks they are identical.

Usage: python benchmarks/bench_distributed.py [--gpus N] [--out DIR] [--reps N] [--no-torch]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
from pathlib import Path

import record

MODELS = [("4096 x 4", [4096] * 5, 8192), ("784-1024-1024-10", [784, 1024, 1024, 10], 256)]


def _rank(rank: int, world: int, uid: bytes, widths: list, rows: int, precision: str, reps: int, out) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    import cupy as cp
    import numpy as np

    from mlptrain.base.cuda.timing import cuda_time_ms
    from mlptrain.distributed.cuda.nccl import NcclComm
    from mlptrain.tools.bench.step_trainer import step_trainer

    comm = NcclComm(rank, world, uid, device=rank) if world > 1 else None
    tr = step_trainer(widths, rows * world, precision, comm=comm)
    with tr.stream:
        xb, yb = next(iter(tr.train_loader.epoch(0, out=tr.batch_buffers)))
        t = cuda_time_ms(lambda: tr.step(xb, yb), warmup=6, reps=reps, chain=20)
        loss = float(tr.step(xb, yb)[0])
        cp.cuda.get_current_stream().synchronize()
    digest = float(sum(np.float64(cp.asnumpy(p.value).astype(np.float64).sum()) for p in tr.model.params))
    out.put((rank, statistics.median(t), loss, digest, tr.graphed.num_graphs if tr.graphed else 0))
    out.close()
    out.join_thread()
    os._exit(0)  # as mlptrain's workers: no interpreter teardown (NCCL and graph finalisers can wait on each other)


def mlptrain_run(world: int, widths: list, rows: int, precision: str, reps: int) -> dict:
    from mlptrain.distributed.cuda.nccl import NcclComm

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = NcclComm.new_id() if world > 1 else b""
    procs = [ctx.Process(target=_rank, args=(r, world, uid, widths, rows, precision, reps, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join()
    ms = got[0][1]
    digests = {g[3] for g in got}
    return {
        "world": world,
        "ms": ms,
        "samples_per_s": world * rows / ms * 1e3,
        "loss": got[0][2],
        "identical_params": len(digests) == 1,
        "per_rank_ms": [g[1] for g in got],
    }


def ddp_run(world: int, widths: list, rows: int, precision: str, reps: int) -> dict | None:
    script = str(Path(__file__).parent / "bench_ddp.py")
    cmd = [
        "torchrun",
        "--standalone",
        f"--nproc_per_node={world}",
        script,
        "--widths",
        ",".join(map(str, widths)),
        "--batch",
        str(rows),
        "--precision",
        precision,
        "--reps",
        str(reps),
    ]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"torchrun failed: {exc}", file=sys.stderr)
        return None
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        print(f"torchrun exited {res.returncode}: {res.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def markdown(rec: dict) -> str:
    out = [
        f"# Data parallel on {rec['gpus']} GPUs ({rec['date']})",
        "",
        f"`{rec['command']}`. {rec['device']} x {rec['gpus']}; {rec['stack']}.",
        "",
        "Samples per second of the global batch (rows per GPU as listed); speed-up against the same stack on one GPU.",
        "",
        "| model | rows per GPU | precision | mlptrain 1 GPU | mlptrain N GPUs | speed-up | PyTorch DDP 1 GPU "
        "| PyTorch DDP N GPUs | speed-up | mlptrain N / DDP N | params identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rec["rows"]:
        m1, mn, t1, tn = r["mlptrain_1"], r["mlptrain_n"], r["ddp_1"], r["ddp_n"]

        def sps(v: dict | None) -> str:
            return "-" if v is None else f"{v['samples_per_s']:,.0f} ({v['ms']:.3f} ms)"

        def ratio(a: dict | None, b: dict | None) -> str:
            return "-" if a is None or b is None else f"{a['samples_per_s'] / b['samples_per_s']:.2f}x"

        out.append(
            f"| {r['model']} | {r['rows']} | {r['precision']} | {sps(m1)} | {sps(mn)} | {ratio(mn, m1)} | {sps(t1)} "
            f"| {sps(tn)} | {ratio(tn, t1)} | {ratio(mn, tn)} | {mn['identical_params']} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--out", default="bench-distributed-out")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--precisions", default="fp16,bf16")
    ap.add_argument("--models", default="4096 x 4,784-1024-1024-10", help="comma-separated names of MODELS")
    args = ap.parse_args(argv)
    import cupy as cp
    import nvmath

    rows = []
    for name, widths, per_gpu in MODELS:
        if name not in args.models.split(","):
            continue
        for precision in args.precisions.split(","):
            r = {"model": name, "widths": widths, "rows": per_gpu, "precision": precision}
            r["mlptrain_1"] = mlptrain_run(1, widths, per_gpu, precision, args.reps)
            r["mlptrain_n"] = mlptrain_run(args.gpus, widths, per_gpu, precision, args.reps)
            r["ddp_1"] = None if args.no_torch else ddp_run(1, widths, per_gpu, precision, args.reps)
            r["ddp_n"] = None if args.no_torch else ddp_run(args.gpus, widths, per_gpu, precision, args.reps)
            print(json.dumps(r), flush=True)
            rows.append(r)
    rec = {
        "date": record.today(),
        "command": record.command(argv),
        "gpus": args.gpus,
        "device": record.gpu_name(),
        "stack": f"CuPy {cp.__version__}, nvmath-python {nvmath.__version__}, NCCL {cp.cuda.nccl.get_version()}",
        "rows": rows,
    }
    record.write(args.out, "bench-distributed", rec, markdown(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
