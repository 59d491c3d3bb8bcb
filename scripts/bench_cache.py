"""What the data cache's checks cost on every read: the source's SHA-256 and the arrays' checksums.

Stores a cache entry of ``--rows x --features`` float64 features (default 600,000 x 256, 1.2 GB)
and integer labels, then times, on this machine, each the median of ``--repeats``:

* :func:`mlptrain.data.files.cache.checksum` of ``x`` (NumPy, vectorised) in GB/s;
* SHA-256 (``mlptrain.base.fs.sha256_file``, what keys the source) and BLAKE2b of a file of the same
  bytes, in GB/s (warm page cache): the source's hash costs ``its size / this rate`` per read;
* ``cache.load`` of the entry: every array's shape, dtype and checksum verified (the source here is
  a small file, so this is the arrays' share), against ``np.load(mmap_mode="r")`` alone;
* what normalising ``--rows`` target cells costs a parse (:mod:`mlptrain.data.files.labels`): integer
  labels, float targets and text labels, as the NumPy reader hands them over (text) and as the
  Arrow reader does (an Arrow string column, with pyarrow installed).

Usage: python scripts/bench_cache.py [--rows 600000] [--features 256] [--repeats 3]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mlptrain.base.fs import sha256_file
from mlptrain.data.files import cache, labels
from mlptrain.data.files.table import Table


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def blake2b_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "blake2b").hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=600_000)
    ap.add_argument("--features", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="mlptrain-bench-cache-"))
    os.environ["MLPTRAIN_DATA"] = str(folder / "cache")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, args.features))  # (N, F) float64
    y = rng.integers(0, 10, args.rows)
    gb = x.nbytes / 1e9
    raw = folder / "x.bin"
    x.tofile(raw)
    source = folder / "d.csv"
    source.write_text("f0,label\n0,0\n")
    cache.store(source, "label", (Table(source, x, y, [f"f{j}" for j in range(args.features)], ["label"]), None))
    folder_entry = next(p for p in (folder / "cache" / "tables").iterdir() if p.is_dir())
    rows = {
        "cache.checksum(x)": median_seconds(lambda: cache.checksum(x), args.repeats),
        "SHA-256 of the same bytes (a file)": median_seconds(lambda: sha256_file(raw), args.repeats),
        "BLAKE2b of the same bytes (a file)": median_seconds(lambda: blake2b_file(raw), args.repeats),
        "cache.load (arrays verified)": median_seconds(lambda: cache.load(source, "label"), args.repeats),
        "np.load(mmap_mode='r') of x alone": median_seconds(
            lambda: np.load(folder_entry / "train_x.npy", mmap_mode="r"), args.repeats
        ),
    }
    assert cache.load(source, "label") is not None, "the entry did not verify"
    print(
        f"{args.rows:,} x {args.features} float64 ({gb:.2f} GB) + int64 labels, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, NumPy {np.__version__}; medians of {args.repeats}. Command: `python "
        f"{' '.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}`\n"
    )
    print("| what | seconds | GB/s of x |\n|---|---|---|")
    for name, s in rows.items():
        print(f"| {name} | {s:.3f} | {gb / s:.2f} |" if "np.load" not in name else f"| {name} | {s:.4f} | - |")
    shutil.rmtree(folder, ignore_errors=True)
    print("\n| target cells | NumPy reader (text), s | Arrow reader (string column), s |\n|---|---|---|")
    for name, cells in target_kinds(args.rows).items():
        print(f"| {args.rows:,} {name} | " + " | ".join(f"{t:.3f}" for t in time_targets(cells, args.repeats)) + " |")
    return 0


def target_kinds(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "integer labels": rng.integers(0, 10, rows).astype(str),
        "float targets": rng.standard_normal(rows).astype(str),
        "text labels": np.array(["cat", "dog", "emu"])[rng.integers(0, 3, rows)],
    }


def time_targets(cells: np.ndarray, repeats: int) -> list[float]:
    out = [median_seconds(lambda: labels.read_targets([labels.text_column(cells)], ["y"], str, "bench"), repeats)]
    try:
        import pyarrow as pa

        from mlptrain.data.files.arrow_reader import target_cells
    except ImportError:
        return out + [float("nan")]
    col = pa.chunked_array([pa.array(cells.tolist(), pa.string())])
    return out + [median_seconds(lambda: labels.read_targets([target_cells(col)], ["y"], str, "bench"), repeats)]


if __name__ == "__main__":
    sys.exit(main())
