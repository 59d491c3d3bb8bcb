"""The ``partial_fit`` scenario: a loop of ``MLPClassifier.partial_fit`` calls, saved after each, killed at random.

The worker (this file run as a script) loads the last save if there is one, and makes the calls that
are left, one chunk of digits each, saving the estimator after each call (``est.save(path)``) and then
printing ``saved <k>``. The campaign kills it at random moments (SIGKILL, SIGTERM, SIGINT: while Python
and the imports start, during the calls, the moment a save's temporary file appears) and starts it
again until it makes its last call.

What is promised, and checked after every kill and at the end:

1. The save is never torn: after any kill it is absent (no save finished yet) or it loads
   (``MLPClassifier.load``) and holds ``k`` calls (``n_iter_``).
2. No reported save is lost: ``k`` is the last ``saved <k>`` printed, or one more (a save that finished
   but was not yet reported).
3. The save after ``k`` calls is the uninterrupted loop's after ``k`` calls, bit for bit (every array and
   ``n_iter_``, ``t_``, ``loss_curve_``): so continuing from the last save ends where the uninterrupted
   sequence of ``partial_fit`` calls ends, bit for bit; the final save is compared too.

A temporary file left beside the save by a kill is counted (``stray``), not a failure: the next save to
that path removes it (:func:`mlptrain.sklearn.persist.save`), so it lasts until the loop saves again.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

CALLS = 8  # partial_fit calls in the loop, one chunk of digits each
PARAMS = {"hidden_layer_sizes": (128, 64), "random_state": 0, "batch_size": 32, "device": "cpu"}
SIGNALS = {"SIGINT": 2, "SIGTERM": 15, "SIGKILL": 9}
MOMENTS = ["start-up", "calls", "calls", "calls", "save write", "save write"]


def worker(save: Path, keep_all: bool) -> None:
    """The loop: continue from ``save`` (if it exists), one ``partial_fit`` and one save per call.
    ``keep_all``: also keep each call's save as ``<save>.<k>.npz`` (the uninterrupted reference)."""
    from sklearn.datasets import load_digits

    from mlptrain.sklearn import MLPClassifier

    x, y = load_digits(return_X_y=True)
    chunks = np.array_split(np.arange(len(y)), CALLS)
    est = MLPClassifier.load(save) if save.exists() else MLPClassifier(**PARAMS)  # type: ignore[arg-type]
    done = est.n_iter_ if save.exists() else 0
    print(f"loaded {done}", flush=True)
    for k in range(done, CALLS):
        est.partial_fit(x[chunks[k]], y[chunks[k]], classes=np.arange(10))
        if est.n_iter_ != k + 1:
            raise RuntimeError(f"n_iter_ {est.n_iter_} after call {k + 1}, expected {k + 1}")
        est.save(save)
        if keep_all:
            est.save(save.with_name(f"{save.stem}.{k + 1}.npz"))
        print(f"saved {k + 1}", flush=True)


def start(save: Path, keep_all: bool = False) -> subprocess.Popen[str]:
    from fault_injection.runs import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, str(Path(__file__).resolve()), str(save), *(["--keep-all"] if keep_all else [])]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def fitted(path: Path) -> dict[str, Any]:
    """What a save holds: its arrays and the fitted counters, to compare bit for bit."""
    from mlptrain.run import checkpoint
    from mlptrain.sklearn import MLPClassifier

    est = MLPClassifier.load(path)
    arrays = checkpoint.load(path).arrays
    return {"n_iter_": est.n_iter_, "t_": est.t_, "loss_curve_": list(est.loss_curve_), "arrays": arrays}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if [a[k] for k in ("n_iter_", "t_", "loss_curve_")] != [b[k] for k in ("n_iter_", "t_", "loss_curve_")]:
        return False
    return a["arrays"].keys() == b["arrays"].keys() and all(
        np.array_equal(a["arrays"][k], b["arrays"][k]) for k in a["arrays"]
    )


def reference(root: Path) -> tuple[Path, float]:
    """The uninterrupted loop in ``root/reference-partial_fit``, each call's save kept; and how long its
    calls took, from its ``loaded`` line to its end (the range of the ``calls`` moment)."""
    folder = root / "reference-partial_fit"
    folder.mkdir()
    proc = start(folder / "model.npz", keep_all=True)
    lines: list[str] = []
    pump = read_lines(proc, lines)
    while not lines and proc.poll() is None:
        time.sleep(0.002)
    t0 = time.perf_counter()
    _, err = proc.communicate(timeout=600)
    pump.join(timeout=10)
    if proc.returncode != 0:
        raise RuntimeError(f"the uninterrupted partial_fit loop failed: {lines} {err}")
    return folder / "model.npz", max(0.05, time.perf_counter() - t0)


def counts(lines: list[str], word: str) -> list[int]:
    """The numbers of the worker's whole ``<word> <k>`` lines (a line cut by the kill is not one)."""
    return [int(m.group(1)) for line in lines if (m := re.fullmatch(word + r" (\d+)", line))]


def read_lines(proc: subprocess.Popen[str], lines: list[str]) -> threading.Thread:
    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def reach(proc: subprocess.Popen[str], lines: list[str], moment: str, rng: np.random.Generator, span: float) -> bool:
    """Wait until the worker reaches ``moment``; False if it ended first."""
    if moment == "start-up":
        time.sleep(float(rng.uniform(0.0, 1.5)))
        return proc.poll() is None
    deadline = time.monotonic() + 120
    while not any(line.startswith("loaded") for line in lines):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    time.sleep(float(rng.uniform(0.0, span)))
    if moment == "calls":
        return proc.poll() is None
    save = Path(str(proc.args[2]))  # type: ignore[index]
    while proc.poll() is None:
        if any(p.name.startswith(save.name) and p.name.endswith(".tmp") for p in save.parent.iterdir()):
            return True
        time.sleep(0.0002)
    return False


def attempt(save: Path, rng: np.random.Generator, span: float, hit_allowed: bool) -> dict[str, Any]:
    """One start of the worker, interrupted at a random moment (if ``hit_allowed``); its log entry."""
    sig, moment = str(rng.choice(list(SIGNALS))), str(rng.choice(MOMENTS))
    proc = start(save)
    lines: list[str] = []
    pump = read_lines(proc, lines)
    hit = hit_allowed and reach(proc, lines, moment, rng, span)
    if hit:
        proc.send_signal(SIGNALS[sig])
    _, err = proc.communicate(timeout=300)
    pump.join(timeout=10)
    reported = max(counts(lines, "saved"), default=None)
    loaded = counts(lines, "loaded")
    entry: dict[str, Any] = {
        "scenario": "partial_fit",
        "signal": sig if hit else None,
        "moment": moment if hit else None,
    }
    entry.update(exit=proc.returncode, reported=reported if reported is not None else next(iter(loaded), None))
    entry["finished"] = proc.returncode == 0
    if proc.returncode != 0 and not hit:
        entry["problems"] = [f"the loop failed uninterrupted (exit {proc.returncode}): {err[-2000:]}"]
    return entry


def check_save(save: Path, entry: dict[str, Any], ref: Path) -> list[str]:
    """Promises 1 to 3 of the save a kill left (see the module's docstring)."""
    stray = [p.name for p in save.parent.iterdir() if p.name.endswith(".tmp")]
    entry["stray"] = len(stray)
    if not save.exists():
        return [] if not entry["reported"] else [f"{save} is gone after {entry['reported']} reported saves"]
    try:
        now = fitted(save)
    except Exception as exc:  # the promise: it always loads
        return [f"{save} does not load after {entry['signal']} at {entry['moment']}: {type(exc).__name__}: {exc}"]
    k, reported = now["n_iter_"], entry["reported"]
    entry["calls_saved"], entry["lost"] = k, max(0, reported - k)
    found = []
    if not reported <= k <= reported + 1:
        found.append(f"{save} holds {k} calls; {reported} were reported saved (expected {reported} or {reported + 1})")
    if k and not same(now, fitted(ref.with_name(f"{ref.stem}.{k}.npz"))):
        found.append(f"{save} after {k} calls differs from the uninterrupted loop's after {k} calls")
    return found


def one_run(run: Path, ref: Path, span: float, rng: np.random.Generator, budget: int, log: list[Any]) -> list[str]:
    """One trial: the loop into ``run`` from nothing to its last call, killed at random while ``budget``
    lasts, each kill's save checked; the final save compared with the uninterrupted loop's."""
    run.mkdir()
    save, known = run / "model.npz", 0
    for _ in range(100):
        entry = attempt(save, rng, span, budget > 0)
        log.append(entry)
        budget -= entry["signal"] is not None
        if entry["reported"] is None:  # stopped before it said anything: the save is the last one known
            entry["reported"] = known
        found = entry.get("problems", []) or ([] if entry["finished"] else check_save(save, entry, ref))
        if found:
            entry["problems"] = found
            return found
        if entry["finished"]:
            break
        known = entry.get("calls_saved", known)
    if not same(fitted(save), fitted(ref)):
        return [f"{save}: the final model differs from the uninterrupted sequence of {CALLS} partial_fit calls"]
    return []


if __name__ == "__main__":  # the worker: mlptrain is found through PYTHONPATH (start sets it)
    worker(Path(sys.argv[1]), "--keep-all" in sys.argv[2:])
