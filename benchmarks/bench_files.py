"""How fast data=file reads a large CSV: NumPy's loadtxt, Arrow's reader, and the binary cache.

Writes a CSV of random float features and an integer label (default 1,000,000 rows x 100 features)
into a temporary folder, then times, on this machine:

* ``numpy.loadtxt`` of the whole table (the baseline the issue names);
* ``read_table(reader="numpy")``: mlptrain's NumPy path (loadtxt of the features and the label, plus
  its check that every row has every field);
* ``read_table(reader="arrow")``: Arrow's multi-threaded CSV parser (the ``arrow`` extra);
* the binary cache: the first run (parse with Arrow, check, store) and the second run (the stored
  arrays, memory-mapped, and the first touch of every page of ``x``).

Each reader is timed ``--repeats`` times and the median kept (a small machine's timings vary run to run).

Every reader's ``x`` is checked equal to loadtxt's. Usage:
python benchmarks/bench_files.py [--rows 1000000] [--features 100] [--out DIR]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import record

from mlptrain.data.files import cache
from mlptrain.data.files.readers import arrow_available, read_table


def write_csv(path: Path, rows: int, features: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        f.write(",".join([*(f"f{j}" for j in range(features)), "label"]) + "\n")
        for start in range(0, rows, 100_000):
            n = min(100_000, rows - start)
            block = np.hstack([rng.standard_normal((n, features)), rng.integers(0, 10, (n, 1))])
            np.savetxt(f, block, delimiter=",", fmt=["%.7g"] * features + ["%d"])


def timed(fn, repeats: int = 1):
    """``(median seconds of repeats, the last result)``."""
    times, out = [], None
    for _ in range(repeats):
        out = None  # let the previous result go before the next read
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--features", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3, help="reads per reader (median; the cache is read as it is used)")
    ap.add_argument("--out", default=None, help="folder for bench-files.json and bench-files.md")
    args = ap.parse_args(argv)
    if not arrow_available():
        print("bench_files.py needs pyarrow (pip install 'mlptrain[arrow]')", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="mlptrain-bench-files-"))
    os.environ["MLPTRAIN_DATA"] = str(folder / "cache")
    path = folder / "big.csv"
    t_write, _ = timed(lambda: write_csv(path, args.rows, args.features))
    size = path.stat().st_size
    results: dict[str, float] = {}
    results["numpy.loadtxt"], ref = timed(lambda: np.loadtxt(path, delimiter=",", skiprows=1), args.repeats)
    x_ref = ref[:, : args.features]
    del ref
    for name, reader in (("read_table, numpy", "numpy"), ("read_table, arrow", "arrow")):
        results[name], (table, _) = timed(lambda r=reader: read_table(path, "label", reader=r), args.repeats)
        assert np.array_equal(table.x, x_ref), name
        del table
    results["cache, first run (arrow + store)"], _ = timed(lambda: cache.read_cached(path, "label", reader="arrow"))
    results["cache, second run (memory-mapped)"], (table, _) = timed(lambda: cache.read_cached(path, "label"))
    results["second run, first touch of x"], total = timed(lambda: float(np.asarray(table.x).sum()))
    assert isinstance(table.x, np.memmap) and np.isclose(total, x_ref.sum())
    base = results["numpy.loadtxt"]
    stamp = {
        "date": record.today(),
        "rows": args.rows,
        "features": args.features,
        "csv_bytes": size,
        "cores": os.cpu_count(),
        **record.versions("numpy", "pyarrow"),
        "command": record.command(argv),
    }
    lines = [
        f"{stamp['date']}, {args.rows:,} rows x {args.features} float features + an integer label "
        f"({size / 2**20:,.0f} MiB of CSV, written in {t_write:.0f} s), {stamp['cores']} cores, Python "
        f"{stamp['python']}, NumPy {stamp['numpy']}, pyarrow {stamp['pyarrow']}; medians of {args.repeats} reads. "
        f"Command: `{stamp['command']}`.",
        "",
        "| read | seconds | vs numpy.loadtxt |",
        "|---|---|---|",
        *[f"| {k} | {v:.2f} | {base / v:.1f}x |" for k, v in results.items()],
    ]
    if args.out:
        record.write(args.out, "bench-files", {**stamp, "seconds": results}, "\n".join(lines))
    else:
        print("\n".join(lines))
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
