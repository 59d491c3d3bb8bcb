"""The data path on the CPU (#31): a large NPZ loaded by mlptrain against NumPy reading it.

Writes (or takes, ``--file``) an NPZ of ``--rows x --cols`` float32 features ``x`` and ``--classes``
integer labels ``y``, then times, each in a fresh Python process (as a run would start), the
median of ``--repeats``:

* **NumPy**: ``np.load(file)["x"]`` and its column means: the baseline, what reading the table costs;
* **mlptrain, first load**: ``load_dataset`` of ``data=file`` with an empty cache folder: the file
  read and hashed, checked, split, the train split's statistics, the splits normalised into
  float32 and the cache entry written;
* **mlptrain, second load**: the same again, read from that cache entry (verified);
* with ``--stream``, **mlptrain, streamed**: ``data.residency=stream``: read, checked, split and the
  statistics, but no split made (each batch is normalised as it is gathered, in training).

``--pythonpath DIR`` runs the timed processes with the mlptrain in ``DIR`` (an older checkout, for a
before/after). Prints a markdown table with each time over NumPy's.

Usage: python scripts/bench_load.py [--rows 600000] [--cols 256] [--classes 10] [--repeats 3] [--quick]
[--file PATH] [--pythonpath DIR] [--stream]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TARGET = 3.0  # #31: the first load at most 3x NumPy's read and column means
STREAMED = "mlptrain, streamed (data.residency=stream)"

NUMPY = """
import json, sys, time
import numpy as np
start = time.perf_counter()
x = np.load(sys.argv[1])["x"]
x.mean(axis=0)
print(json.dumps(time.perf_counter() - start))
"""
MLPTRAIN = """
import json, sys, time
from mlptrain.cli.main import compose_config
from mlptrain.data import load_dataset
cfg = compose_config(["data=file", f"data.path={sys.argv[1]}", "data.target=y", *sys.argv[2:]]).data
start = time.perf_counter()
ds = load_dataset(cfg)
print(json.dumps(time.perf_counter() - start))
"""


def write_npz(path: Path, rows: int, cols: int, classes: int, seed: int = 0) -> None:
    """A table of ``rows x cols`` float32 features, the class shifting each feature a little, and its labels."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, rows)  # (N,)
    x = rng.standard_normal((rows, cols), dtype=np.float32)  # (N, F)
    x += (0.1 * y[:, None]).astype(np.float32)
    np.savez(path, x=x, y=y)


def timed_process(code: str, file: Path, cache: Path, pythonpath: str | None, *overrides: str) -> float:
    """Seconds that ``code`` reports, run in a fresh interpreter with ``MLPTRAIN_DATA=cache``."""
    env = {**os.environ, "MLPTRAIN_DATA": str(cache)}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-c", code, str(file), *overrides]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def measure(file: Path, repeats: int, pythonpath: str | None, folder: Path, stream: bool) -> dict[str, list[float]]:
    """``{what: [seconds of each repeat]}``: NumPy, the first load (a fresh cache) and the second, interleaved;
    with ``stream`` also a streamed load (``data.residency=stream``: statistics, no split made)."""
    times: dict[str, list[float]] = {
        "NumPy np.load + column means": [],
        "mlptrain, first load": [],
        "mlptrain, second load": [],
        **({STREAMED: []} if stream else {}),
    }
    for r in range(repeats):
        cache = folder / f"cache{r}"
        times["NumPy np.load + column means"].append(timed_process(NUMPY, file, cache, pythonpath))
        times["mlptrain, first load"].append(timed_process(MLPTRAIN, file, cache, pythonpath))
        times["mlptrain, second load"].append(timed_process(MLPTRAIN, file, cache, pythonpath))
        if stream:
            times[STREAMED].append(timed_process(MLPTRAIN, file, cache, pythonpath, "data.residency=stream"))
        shutil.rmtree(cache, ignore_errors=True)
    return times


def table(times: dict[str, list[float]], nbytes: int) -> list[str]:
    base = statistics.median(times["NumPy np.load + column means"])
    md = ["| what | median s | all runs, s | GB/s of x | vs NumPy |", "|---|---|---|---|---|"]
    for what, ts in times.items():
        s = statistics.median(ts)
        runs = ", ".join(f"{t:.2f}" for t in ts)
        md.append(f"| {what} | {s:.3f} | {runs} | {nbytes / 1e9 / s:.2f} | {s / base:.2f}x |")
    first = statistics.median(times["mlptrain, first load"]) / base
    md += [
        "",
        f"First load / NumPy: {first:.2f}x; the target (#31) is at most {TARGET:g}x: "
        + ("met." if first <= TARGET else "not met."),
    ]
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=600_000)
    ap.add_argument("--cols", type=int, default=256)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per variant (median)")
    ap.add_argument("--quick", action="store_true", help="60,000 rows, one repeat")
    ap.add_argument("--file", type=Path, help="an NPZ of x and y to load instead of writing one")
    ap.add_argument("--pythonpath", help="run the timed processes with the mlptrain in this folder")
    ap.add_argument("--stream", action="store_true", help="also time a streamed load (data.residency=stream)")
    args = ap.parse_args(argv)
    rows, repeats = (min(args.rows, 60_000), 1) if args.quick else (args.rows, args.repeats)
    folder = Path(tempfile.mkdtemp(prefix="mlptrain-bench-load-"))
    try:
        file = args.file
        if file is None:
            file = folder / "table.npz"
            write_npz(file, rows, args.cols, args.classes)
        with np.load(file) as npz:
            shape, dtype, nbytes = npz["x"].shape, npz["x"].dtype, npz["x"].nbytes
        times = measure(file, repeats, args.pythonpath, folder, args.stream)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    command = " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    print(
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores, Python {platform.python_version()}, NumPy "
        f"{np.__version__}: {shape[0]:,} x {shape[1]} {dtype} ({nbytes / 1e6:.0f} MB), medians of {repeats} fresh "
        f"processes each. Command: `{command}`\n"
    )
    print("\n".join(table(times, nbytes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
