"""A whole run against its peers: wall clock from a fresh process to a trained model (issue #31).

The task of issue #31: a synthetic table of ``--rows`` x ``--features`` float32 rows (10 classes, a
mixture of Gaussian blobs; a test file of its own), saved as NPZ; 256-1024-1024-10, bf16, Adam
(lr 1e-3), batch 1024, ``--epochs`` epochs, no validation split. Each variant is a fresh process
reading the same file:

* ``mlptrain-first``: ``python -m mlptrain data=file ...`` with empty caches (mlptrain's data cache,
  plans and measured choices in ``MLPTRAIN_DATA``, CuPy's kernels in ``CUPY_CACHE_DIR``), as the first
  run on a machine;
* ``mlptrain-again``: the same command on the caches the first run left;
* ``torch-loop``: a plain PyTorch loop on GPU-resident tensors (eager, bf16 autocast, fused Adam),
  the features standardised with the train split's mean and standard deviation as mlptrain does;
* ``lightning-resident``: PyTorch Lightning with the batches already on the GPU;
* ``lightning-loader``: Lightning with a ``TensorDataset`` and a ``DataLoader`` (pinned memory);
* ``mlptrain-init-torch``: ``mlptrain-again`` with PyTorch's initialisation (``model.init=torch``).

Reported first: the time to read the NPZ from the page cache (best of 3, after a read that brings it
there), the yardstick of #31 for a run's time outside its steps at 10,000,000 rows. Reported per
variant: the process's wall time and the test accuracy; for mlptrain also the loop's
time (``wall_s`` of the summary), the sum of its step times (the median ``step_time_ms`` of the step
records times the steps) and the time outside the loop (imports, data, planning). Writes
``bench-run.md`` and ``bench-run.json`` into ``--out``.

Usage: python benchmarks/bench_run.py --out DIR [--rows 600000] [--features 256] [--epochs 5] [--repeats 1]
       [--variants mlptrain-first,mlptrain-again,torch-loop,lightning-resident,lightning-loader]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import record

REPO = Path(__file__).resolve().parent.parent
PEERS = ("torch-loop", "lightning-resident", "lightning-loader")
VARIANTS = ("mlptrain-first", "mlptrain-again", *PEERS, "mlptrain-init-torch")
HIDDEN, BATCH, LR, CLASSES = (1024, 1024), 1024, 1e-3, 10
STARTUP = ("python", "imports", "config", "backend")  # mlptrain.base.timeline's phases that any run pays first


def make_table(path: Path, rows: int, features: int, test_rows: int, seed: int = 0) -> None:
    """``x (rows, F)``, ``y``, ``x_test``, ``y_test``: two Gaussian blobs per class, unit noise (float32)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(CLASSES, 2, features)).astype(np.float32) * np.float32(3.0 / np.sqrt(features))
    out = {}
    for xk, yk, n in (("x", "y", rows), ("x_test", "y_test", test_rows)):
        y = rng.integers(0, CLASSES, size=n)
        blob = rng.integers(0, 2, size=n)
        x = centres[y, blob] + rng.standard_normal((n, features), dtype=np.float32)
        out[xk], out[yk] = x.astype(np.float32), y.astype(np.int64)
    np.savez(path, **out)


def python_env(work: Path) -> dict[str, str]:
    """Every process reads the bytecode a priming run wrote (as after ``pip install``, which compiles it): an
    image with ``PYTHONDONTWRITEBYTECODE=1`` would otherwise compile every module from source in every run."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def prime(work: Path) -> None:
    """Write the bytecode of everything the variants import, and warm the file cache (not timed)."""
    env = {**python_env(work), "MLPTRAIN_DATA": str(work / "prime-cache"), "CUPY_CACHE_DIR": str(work / "prime-cupy")}
    run = [sys.executable, "-m", "mlptrain", "epochs=1", "progress=false", f"hydra.run.dir={work / 'prime-run'}"]
    subprocess.run(run, env=env, capture_output=True, check=True)
    peers = "import torch, numpy; torch.ones(1, device='cuda')\ntry:\n import lightning\nexcept ImportError:\n pass"
    subprocess.run([sys.executable, "-c", peers], env=env, capture_output=True)


def mlptrain_env(caches: Path) -> dict[str, str]:
    """The environment of an mlptrain variant: its data cache, plans and kernels kept under ``caches``."""
    return {
        **python_env(caches.parent),
        "CUPY_CACHE_DIR": str(caches / "cupy"),
        "MLPTRAIN_DATA": str(caches / "mlptrain"),
    }


def mlptrain_overrides(table: Path, epochs: int, run_dir: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """``python -m mlptrain``'s overrides for the task on ``table``, into ``run_dir``."""
    return [
        "data=file",
        f"data.path={table}",
        "data.val_fraction=0",
        f"model.hidden=[{HIDDEN[0]},{HIDDEN[1]}]",
        "precision=bf16",
        "optimizer=adam",
        f"optimizer.lr={LR}",
        f"data.batch_size={BATCH}",
        f"epochs={epochs}",
        "model.init=he",  # the run this benchmark measured before data=file took a table's recipe (#49)
        "early_stopping.patience=0",
        "progress=false",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def mlptrain_run(table: Path, epochs: int, caches: Path, run_dir: Path, extra: tuple[str, ...] = ()) -> dict:
    env = mlptrain_env(caches)
    overrides = mlptrain_overrides(table, epochs, run_dir, extra)
    os.sync()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mlptrain", *overrides], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"mlptrain exited {proc.returncode}: {proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in records if r["kind"] == "summary")
    step_ms = [r["step_time_ms"] for r in records if r["kind"] == "step" and "step_time_ms" in r]
    evaluation = sum(r.get("time_s", 0.0) for r in records if r["kind"] == "epoch")
    steps_s = statistics.median(step_ms) * summary["steps"] / 1e3
    timeline = json.loads((run_dir / "run.json").read_text()).get("timeline", {})
    return {
        "wall_s": wall,
        "test_acc": summary.get("test/acc"),
        "loop_s": summary["wall_s"],
        "steps_s": steps_s,
        "step_ms_median": statistics.median(step_ms),
        "epochs_time_s": evaluation,
        "outside_loop_s": wall - summary["wall_s"],
        "timeline": timeline,  # mlptrain.base.timeline: the run's phases and the loop's parts, as run.json has them
    }


def startup_s(timeline: dict) -> float:
    """#31's start-up: the interpreter, the imports, Hydra's compose and the backend (CuPy, nvmath, CUDA)."""
    phases = timeline.get("phases_s", {})
    return sum(phases.get(k, 0.0) for k in STARTUP)


def worker(kind: str, table: Path, epochs: int) -> dict:
    """One PyTorch variant, in this (fresh) process: returns its test accuracy."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    d = np.load(table)
    x, y, xt, yt = (torch.from_numpy(d[k]) for k in ("x", "y", "x_test", "y_test"))
    mean, std = x.mean(0), x.std(0)
    x, xt = (x - mean) / std, (xt - mean) / std
    widths = [x.shape[1], *HIDDEN, CLASSES]
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1]).cuda()
    if kind == "torch-loop":
        return {"test_acc": _torch_loop(model, x, y, xt, yt, epochs)}
    return {"test_acc": _lightning(kind, model, x, y, xt, yt, epochs)}


def _torch_loop(model, x, y, xt, yt, epochs: int) -> float:  # noqa: ANN001 (torch objects)
    import torch

    x, y, xt, yt = x.cuda(), y.cuda(), xt.cuda(), yt.cuda()
    opt = torch.optim.Adam(model.parameters(), lr=LR, fused=True)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(epochs):
        perm = torch.randperm(len(x), device="cuda")
        for i in range(0, len(x), BATCH):
            idx = perm[i : i + BATCH]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        return float((model(xt).argmax(1) == yt).float().mean())


def _lightning(kind: str, model, x, y, xt, yt, epochs: int) -> float:  # noqa: ANN001 (torch objects)
    import torch

    try:
        import lightning as L
    except ImportError:
        import pytorch_lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch, _):  # noqa: ANN001
            xb, yb = batch
            return torch.nn.functional.cross_entropy(self.net(xb), yb)

        def configure_optimizers(self):  # noqa: ANN202
            return torch.optim.Adam(self.parameters(), lr=LR, fused=True)

    if kind == "lightning-resident":
        xg, yg = x.cuda(), y.cuda()

        class Resident(torch.utils.data.IterableDataset):
            def __iter__(self):  # noqa: ANN204
                perm = torch.randperm(len(xg), device="cuda")
                for i in range(0, len(xg), BATCH):
                    yield xg[perm[i : i + BATCH]], yg[perm[i : i + BATCH]]

        loader = torch.utils.data.DataLoader(Resident(), batch_size=None)
    else:
        data = torch.utils.data.TensorDataset(x, y)
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, pin_memory=True)
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Module()
    trainer.fit(module, loader)
    net = module.net.cuda().eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        return float((net(xt.cuda()).argmax(1) == yt.cuda()).float().mean())


def page_cache_read_s(path: Path, repeats: int = 3) -> float:
    """Seconds to read ``path``'s bytes once it is in the page cache (the best of ``repeats``, after one
    read that brings it there): #31's yardstick for the time a run spends outside its steps at 10M rows."""
    buf = bytearray(64 << 20)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def peer_run(kind: str, table: Path, epochs: int) -> dict:
    os.sync()
    t0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--worker", kind, "--table", str(table), "--epochs", str(epochs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=python_env(table.parent))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    return {"wall_s": wall, **json.loads(proc.stdout.strip().splitlines()[-1])}


def median_run(runs: list[dict]) -> dict:
    """Of one variant's rounds, the run of the median wall time (the upper of the two middle ones), with every
    round's wall beside it (``walls_s``); a round that failed is reported where none succeeded."""
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["wall_s"])
    if not ok:
        return runs[-1]
    return {**ok[len(ok) // 2], "walls_s": [round(r["wall_s"], 3) for r in runs if "error" not in r]}


def table_md(results: dict, args: argparse.Namespace) -> str:
    lines = [
        f"# A whole run against its peers ({datetime.date.today().isoformat()})",
        "",
        f"Command: `python benchmarks/bench_run.py --out DIR --rows {args.rows} --features {args.features} "
        f"--epochs {args.epochs} --repeats {args.repeats}`; {args.rows:,} x {args.features} float32 rows as NPZ, "
        f"{args.features}-{HIDDEN[0]}-{HIDDEN[1]}-{CLASSES}, bf16, Adam, batch {BATCH}.",
        "",
        f"The NPZ ({results.get('_file', {}).get('bytes', 0) / 1e9:.2f} GB) read from the page cache: "
        f"{results.get('_file', {}).get('page_cache_read_s', float('nan')):.2f} s (best of 3). #31 asks, at "
        "10,000,000 rows, for mlptrain's time outside its steps (wall - steps) at most that plus 3 s.",
        "",
        f"Each variant ran {args.repeats} time(s), one round after another (each round's mlptrain-first on empty "
        "caches of its own); the row is its run of median wall time, and 'walls s' lists every round's.",
        "",
        "| variant | wall s | test acc | loop s | steps s (median step x steps) | outside the loop s "
        "| wall - steps s | walls s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if name.startswith("_"):
            continue
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'].splitlines()[-1][:120]} | | | | | | |")
            continue
        cells = [f"{r['wall_s']:.1f}", f"{r['test_acc']:.4f}"]
        cells += [f"{r[k]:.2f}" if k in r else "" for k in ("loop_s", "steps_s", "outside_loop_s")]
        cells.append(f"{r['wall_s'] - r['steps_s']:.2f}" if "steps_s" in r else "")
        cells.append(", ".join(f"{w:.2f}" for w in r.get("walls_s", [r["wall_s"]])))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", *ratios_md(results), *timeline_md(results)]
    return "\n".join(lines) + "\n"


def ratios_md(results: dict) -> list[str]:
    """#31's ratios between the variants: the PyTorch loop's wall over mlptrain's, and a first run's over a second's."""
    wall = {k: r["wall_s"] for k, r in results.items() if not k.startswith("_") and "wall_s" in r}
    lines = []
    if "torch-loop" in wall and "mlptrain-again" in wall:
        lines.append(
            f"- PyTorch loop / mlptrain-again: {wall['torch-loop'] / wall['mlptrain-again']:.2f}x (#31: at least 3x)"
        )
    if "mlptrain-first" in wall and "mlptrain-again" in wall:
        ratio = wall["mlptrain-first"] / wall["mlptrain-again"]
        lines.append(f"- mlptrain-first / mlptrain-again: {ratio:.2f}x (#31: at most 1.2x)")
    return [*lines, ""] if lines else []


def timeline_md(results: dict) -> list[str]:
    """Per mlptrain variant: the run's phases (``run.json``'s timeline), and #31's ratio of the wall to the sum
    of its steps, evaluation and start-up (the interpreter, imports, config, backend)."""
    runs = {k: r for k, r in results.items() if r.get("timeline", {}).get("phases_s")}
    if not runs:
        return []
    phases = list(dict.fromkeys(p for r in runs.values() for p in r["timeline"]["phases_s"]))
    parts = list(dict.fromkeys(p for r in runs.values() for p in r["timeline"].get("loop_s", {})))
    head = [
        "variant",
        *phases,
        *(f"loop: {p}" for p in parts),
        "after the loop",
        "steps + eval + start-up",
        "wall / that",
    ]
    lines = [
        "Where each mlptrain run's wall went, s (`run.json`'s `timeline`, mlptrain/base/timeline.py; "
        "'after the loop': the wall less the timeline's total, the process's exit included):",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for name, r in runs.items():
        t = r["timeline"]
        base = r["steps_s"] + t.get("loop_s", {}).get("evaluate", 0.0) + startup_s(t)
        cells = [f"{t['phases_s'].get(p, 0.0):.2f}" for p in phases]
        cells += [f"{t.get('loop_s', {}).get(p, 0.0):.2f}" for p in parts]
        cells += [f"{r['wall_s'] - t['total_s']:.2f}", f"{base:.2f}", f"{r['wall_s'] / base:.2f}x"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--rows", type=int, default=600_000)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--test-rows", type=int, default=100_000)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=1, help="rounds of every variant; each reports its median-wall run")
    p.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    p.add_argument("--table", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.table, args.epochs)))
        return
    if args.out is None:
        p.error("--out DIR is required")
    work = Path(tempfile.mkdtemp(prefix="mlptrain-bench-run-"))
    table = work / "table.npz"
    make_table(table, args.rows, args.features, args.test_rows)
    prime(work)
    results: dict[str, dict] = {"_file": {"bytes": table.stat().st_size, "page_cache_read_s": page_cache_read_s(table)}}
    print("_file", json.dumps(results["_file"]), flush=True)
    names = args.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            p.error(f"--variants: {name!r} is not one of {', '.join(VARIANTS)}")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: expected at least 1")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.repeats):  # round r: its own caches, so that each round's mlptrain-first is a first run
        for name in names:
            if name.startswith("mlptrain"):  # -init-torch: PyTorch's initialisation (model.init=torch)
                extra = ("model.init=torch",) if name == "mlptrain-init-torch" else ()
                run = mlptrain_run(table, args.epochs, work / f"caches-{r}", work / f"run-{name}-{r}", extra)
            else:
                run = peer_run(name, table, args.epochs)
            runs[name].append(run)
            print(name, r, json.dumps(run), flush=True)
    for name in names:
        results[name] = median_run(runs[name])
    record.write(
        args.out, "bench-run", {"args": {**vars(args), "out": str(args.out)}, **results}, table_md(results, args)
    )


if __name__ == "__main__":
    main()
