"""The data loader's batch gather: mlptrain.data.cuda.gather.take_rows against cupy.take.

For each case (a dataset resident on the GPU, a batch of random rows gathered into fixed buffers, as
the training loop does every step), times both with CUDA events after a warm-up: 50 gathers back to
back, median of 11 repeats, and reports microseconds per gather and the bandwidth (bytes read plus
written). Each result is checked equal to ``cupy.take``'s. Random data.

Usage: python scripts/bench_gather.py [--out FILE.md]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

from mlptrain.base.backend import probe_gpu

# (rows in the dataset, row shape, dtype, batch): digits, MNIST-sized, a wide fp16 set, labels, targets
CASES = (
    (1294, (64,), "float32", 64),
    (60000, (784,), "float32", 256),
    (60000, (784,), "float16", 8192),
    (100000, (4096,), "float16", 8192),
    (100000, (), "int64", 8192),
    (100000, (3,), "float32", 8192),
)


def timed(cp, fn, reps=50, repeats=11) -> float:
    """Microseconds per call: ``reps`` calls between two events, median of ``repeats``."""
    fn()
    cp.cuda.Stream.null.synchronize()
    times = []
    for _ in range(repeats):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / reps)
    return float(np.median(times))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = ap.parse_args(argv)
    available, reason = probe_gpu()
    if not available:
        print(f"no GPU: {reason}")
        return 1
    import cupy as cp

    from mlptrain.data.cuda.gather import take_rows

    rng = np.random.default_rng(0)
    lines = [
        f"{datetime.date.today().isoformat()}, {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
        f"CuPy {cp.__version__}; command: python scripts/bench_gather.py",
        "",
        "| dataset rows x row | dtype | batch | take_rows us | cupy.take us | take_rows GB/s | cupy.take GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, row, dtype, batch in CASES:
        src = cp.asarray(rng.standard_normal((n, *row)).astype(dtype) if dtype != "int64"
                         else rng.integers(0, 10, n))  # fmt: skip
        idx = cp.asarray(rng.permutation(n)[:batch].astype(np.int64))
        out_ours, out_cupy = cp.empty((batch, *row), src.dtype), cp.empty((batch, *row), src.dtype)
        take_rows(src, idx, out_ours)
        cp.take(src, idx, axis=0, out=out_cupy)
        if not bool((out_ours == out_cupy).all()):
            raise SystemExit(f"take_rows differs from cupy.take for {n} x {row} {dtype}")
        ours = timed(cp, lambda: take_rows(src, idx, out_ours))  # noqa: B023
        theirs = timed(cp, lambda: cp.take(src, idx, axis=0, out=out_cupy))  # noqa: B023
        moved = 2 * out_ours.nbytes + idx.nbytes
        lines.append(f"| {n} x {row} | {dtype} | {batch} | {ours:.2f} | {theirs:.2f} | "
                     f"{moved / ours / 1e3:.0f} | {moved / theirs / 1e3:.0f} |")  # fmt: skip
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
