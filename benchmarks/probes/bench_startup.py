"""How long the default run takes from a cold cache and a warm one (the first GPU run a user makes).

Runs ``python -m mlptrain [overrides]`` in subprocesses, each into a new run directory:

0. a priming run, not timed, on caches of its own: the operating system's file cache then holds
   the libraries (CUDA's are hundreds of megabytes), and Python has the bytecode of every module
   the run imports, as after ``pip install`` (which compiles it) or any earlier run. With
   ``--bytecode prime`` (the default) the priming run writes that bytecode into a cache of the
   benchmark's own (``PYTHONPYCACHEPREFIX``, bytecode writing on), which the timed runs read:
   an environment with ``PYTHONDONTWRITEBYTECODE=1`` and packages installed without bytecode would
   otherwise compile them from source in every run (the H200 host's image: 433 of the 828 modules
   a default run imports had no bytecode, its NumPy among them; a sampled warm run spent 0.24 s
   compiling), which no installed mlptrain pays. ``--bytecode as-is`` leaves the environment as it
   is (``--no-prime`` leaves the priming run out);
1. cold: CuPy's kernel cache (``CUPY_CACHE_DIR``) and mlptrain's cache (``MLPTRAIN_DATA``: plans,
   measured choices) empty, as on the first run after installing mlptrain;
2. warm: the same caches again (what every later run sees), twice.

Before each run the file systems are synced (``os.sync``), so that a run's own fsyncs (mlptrain
writes its run record and metrics durably) do not pay for flushing what other programs wrote just
before (a package installed a moment earlier: on the H200 host the first fsync after installing
the wheels took a second).

Per run: the wall time of the process, the training loop's time (``wall_s`` of the summary
record) and the rest (start-up: imports, data, planning, kernel compilation). With ``--profile``
a cold and a warm run are also profiled (cProfile; the top functions by cumulative time go
into ``cold-profile.txt`` and ``warm-profile.txt``): what the start-up spends its time on.

Usage: python benchmarks/probes/bench_startup.py [--out DIR] [--profile] [-- overrides ...]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_once(
    overrides: list[str], caches: Path, run_dir: Path, profile: Path | None = None, python_env: dict | None = None
) -> dict:
    env = {**os.environ, **(python_env or {})}
    env.update(CUPY_CACHE_DIR=str(caches / "cupy"), MLPTRAIN_DATA=str(caches / "mlptrain"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = [
        sys.executable,
        *(["-m", "cProfile", "-o", str(profile)] if profile else []),
        "-m",
        "mlptrain",
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    os.sync()  # flush other programs' writes now, not in this run's first fsync
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    kernels = len(list((caches / "cupy").glob("*"))) if (caches / "cupy").is_dir() else 0
    return {
        "wall_s": wall,
        "loop_s": summary["wall_s"],
        "startup_s": wall - summary["wall_s"],
        "test_acc": summary.get("test/acc"),
        "cached_kernels": kernels,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-startup-out")
    ap.add_argument("--profile", action="store_true", help="also profile a cold run (cProfile)")
    ap.add_argument("--no-prime", action="store_true", help="no untimed priming run first (see above)")
    ap.add_argument(
        "--bytecode",
        choices=("prime", "as-is"),
        default="prime",
        help="prime: the priming run writes the bytecode the timed runs read (see above)",
    )
    ap.add_argument("overrides", nargs="*", help="overrides of the run (default: none, the default run)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        timed_env, bytecode = None, "as the environment has it"
        if args.bytecode == "prime" and not args.no_prime:
            prefix = os.environ.get("PYTHONPYCACHEPREFIX") or str(Path(tmp) / "pycache")
            timed_env = {"PYTHONPYCACHEPREFIX": prefix}
            bytecode = "written by the priming run"
        if not args.no_prime:
            prime_env = None if timed_env is None else {**timed_env, "PYTHONDONTWRITEBYTECODE": ""}
            run_once(args.overrides, Path(tmp) / "caches-prime", Path(tmp) / "run-prime", python_env=prime_env)
        caches = Path(tmp) / "caches"
        for i, label in enumerate(["cold", "warm", "warm"]):
            rec = run_once(args.overrides, caches, Path(tmp) / f"run{i}", python_env=timed_env)
            rows.append({"run": label, **rec})
            print(json.dumps(rows[-1]), flush=True)
        if args.profile:  # a cold run and then a warm one, on caches of their own
            for label in ("cold", "warm"):
                prof = Path(tmp) / f"{label}.prof"
                run_once(
                    args.overrides,
                    Path(tmp) / "caches-profiled",
                    Path(tmp) / f"run-{label}-profiled",
                    prof,
                    python_env=timed_env,
                )
                with open(out / f"{label}-profile.txt", "w") as f:
                    pstats.Stats(str(prof), stream=f).sort_stats("cumulative").print_stats(80)
    cold, warm = rows[0], min(rows[1:], key=lambda r: r["wall_s"])
    md = [
        f"Measured {datetime.date.today().isoformat()}, command: `python benchmarks/probes/bench_startup.py "
        f"{' '.join(sys.argv[1:])}` (overrides: {' '.join(args.overrides) or 'none: the default run'}; "
        f"{'no priming run' if args.no_prime else 'after an untimed priming run on caches of its own'}; "
        f"Python {sys.version.split()[0]}, bytecode writing {'off' if sys.flags.dont_write_bytecode else 'on'} "
        f"in this environment; the timed runs' bytecode: {bytecode}).",
        "",
        "| run | wall s | training loop s | start-up s | kernels compiled into CuPy's cache |",
        "|---|---|---|---|---|",
        *(
            f"| {r['run']} | {r['wall_s']:.2f} | {r['loop_s']:.2f} | {r['startup_s']:.2f} | {r['cached_kernels']} |"
            for r in rows
        ),
        "",
        f"cold / warm wall time: {cold['wall_s'] / warm['wall_s']:.2f}x",
    ]
    (out / "bench-startup.md").write_text("\n".join(md) + "\n")
    (out / "bench-startup.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
