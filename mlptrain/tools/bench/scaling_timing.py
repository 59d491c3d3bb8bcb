"""What each ``data.normalize`` mode costs on the CPU (#49): its statistics, a normalising pass, a streamed batch.

On a ``--rows x --cols`` float32 table of lognormal values (seeded), for ``standard``, ``robust`` and
``quantile`` (:mod:`mlptrain.data.files.column_stats`), the best of ``--repeats``:

* **statistics**: :func:`mlptrain.data.prepare.normalization` over every row (robust: the medians and quartiles;
  quantile: 1000 quantiles of a 10,000-row sample);
* **pass**: :func:`mlptrain.data.files.chunks.gather_normalised` of the whole table, as a made split is normalised;
* **batch**: one ``--batch``-row batch through :func:`mlptrain.data.files.chunks.normalise_into`, as a streamed
  split (``data.residency=stream``) normalises every batch it gathers.

Prints a markdown table, with the date and the stack. Usage:
``python scripts/bench_scaling.py [--rows 200000] [--cols 64] [--batch 64] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from collections.abc import Callable

import numpy as np

from mlptrain.data.files import chunks
from mlptrain.data.prepare import normalization

MODES = ("standard", "robust", "quantile")


def best(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    """The fastest of ``repeats`` timings of ``inner`` calls of ``fn``, per call, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--cols", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    x = np.random.default_rng(0).lognormal(0.0, 1.0, (args.rows, args.cols)).astype(np.float32)  # (N, F)
    out = np.empty((args.batch, args.cols), np.float32)  # (B, F) a streamed batch's slot
    print(
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"NumPy {np.__version__}; a {args.rows:,} x {args.cols} float32 table, best of {args.repeats}\n"
    )
    print(f"| mode | statistics (s) | a pass over the table (s) | a batch of {args.batch} rows (ms) |")
    print("|---|---|---|---|")
    for mode in MODES:
        print(row(mode, x, out, args.repeats))
    return 0


def row(mode: str, x: np.ndarray, out: np.ndarray, repeats: int) -> str:
    """The table's row of ``mode``: its statistics, a pass over ``x (N, F)``, one batch into ``out (B, F)``."""
    norm = normalization(mode, x, seed=0)
    stats = best(lambda: normalization(mode, x, seed=0), repeats)
    full = best(lambda: chunks.gather_normalised(x, None, norm.shift, norm.scale, mapped=norm.mapped), repeats)
    inv, rows = 1.0 / norm.scale, x[: len(out)]  # (F,), (B, F)
    batch = best(lambda: chunks.normalise_into(rows, norm.shift, inv, out, norm.mapped), repeats, inner=50)
    return f"| `{mode}` | {stats:.3f} | {full:.3f} | {batch * 1e3:.2f} |"
