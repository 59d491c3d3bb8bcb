"""Fused vs naive, side by side: read a comparison sweep and write its figure, table and numbers.

``make compare`` trains the same model with the same seed and data order twice, once with the
epilogs fused into the GEMMs (``execution=fused``) and once with plain GEMMs and separate
kernels (``execution=naive``), through the Hydra multirun of ``conf/compare.yaml``; then it runs
this script on the sweep directory::

    python scripts/compare.py runs/compare/2026-11-30_12-00-00 [--out DIR]

It reads every job directory (``run.json`` and ``metrics.jsonl``, see :mod:`mlptrain.metrics`),
checks that the runs are complete and comparable, pairs the fused and naive run of each seed, and
writes into the sweep directory (or ``--out``):

* ``compare.png``: training loss per step (mean over seeds, min-max band), test accuracy per
  epoch, the per-step relative loss difference |fused - naive| / |naive| (a running median per
  seed, beside the same measure between two seeds of naive, and the precision's tolerance), and
  samples per second of each mode;
* ``compare.md``: the table (final loss and accuracy per mode, largest loss difference, time per
  step, speedup) and the commands that made it;
* ``compare.json``: the same numbers.

A run that is missing or incomplete stops the script with one line ``error: <message>`` naming
the run directory, and exit status 2. The math lives in importable functions
(:func:`load_runs`, :func:`summarize`, :func:`plot`, :func:`write_markdown`) for the tests.

Several comparisons (one folder each, as ``scripts/compare_gpu.sh`` makes them for docs/compare-gpu/:
``<panel>/compare.json`` and, for the speed task, ``<panel>/speed/compare.json``) get one index::

    python scripts/compare.py --index docs/compare-gpu [--made-by "scripts/compare_gpu.sh OUT_DIR"] [--note FILE]

``<DIR>/README.md``: the recipes, a table of accuracies and one of times per step with a row per
panel, how fused and naive differ and why (:data:`DIFFERENCES`), and each panel's figure
(:func:`write_index`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

from mlptrain.config import flatten  # noqa: E402
from mlptrain.metrics import read_metrics  # noqa: E402

MODES = ("fused", "naive")
# Largest relative per-step difference of the training loss at which fused and naive "agree".
# fp64 and fp32 are exact contracts (on the CPU both modes issue the very same BLAS calls);
# half precision and TF32 round the fused and the plain GEMMs differently, and the difference
# compounds over the steps, so those curves are compared by final accuracy and seed band instead.
TOLERANCES = {"fp64": 1e-10, "fp32": 1e-5}
# How fast the curves part: the first step where the relative difference passes each of these.
DIVERGENCE_THRESHOLDS = (1e-3, 1e-2, 1e-1)
# The largest relative rounding error of one rounding to each precision's GEMM format (TF32 rounds
# the inputs to 11 significant bits, fp16 the outputs to 11, bf16 to 8).
UNIT_ROUNDOFF = {"fp64": 2.0**-53, "fp32": 2.0**-24, "tf32": 2.0**-11, "fp16": 2.0**-11, "bf16": 2.0**-8}
# Keys that may differ between the runs of one comparison: everything else must match.
SWEPT_KEYS = ("execution.mode", "seed", "progress")
COLORS = {"fused": "tab:blue", "naive": "tab:orange"}


class CompareError(Exception):
    """A run is missing, incomplete or not comparable; the message names the run directory."""


@dataclass
class Run:
    """One training run of the sweep: its record and its metrics by kind."""

    path: Path
    record: dict[str, Any]  # run.json
    steps: list[dict[str, Any]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None

    @property
    def config(self) -> dict[str, Any]:
        return self.record["config"]

    @property
    def mode(self) -> str:
        return self.config["execution"]["mode"]

    @property
    def seed(self) -> int:
        return int(self.config["seed"])

    @property
    def precision(self) -> str:
        return self.config["precision"]["name"]

    def losses(self) -> np.ndarray:
        """Training loss of every step, ``(steps,)`` float64 (NaN where it was not finite)."""
        return np.array([np.nan if r["train/loss"] is None else r["train/loss"] for r in self.steps], dtype=float)

    def timed_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """``(step_time_ms, samples_per_s)`` of the log intervals that time training alone.

        The trainer times each interval of ``log_every`` steps and writes the numbers on its last
        step. Skipped: the first interval (warm-up: planning, kernel compilation, first touches)
        and any interval that crosses an epoch boundary (its timer restarts after evaluation
        while its sample count does not).
        """
        ms, sps = [], []
        start, first = 0, True
        for i, rec in enumerate(self.steps):
            if rec.get("step_time_ms") is None:
                continue
            if not first and self.steps[start]["epoch"] == rec["epoch"]:
                ms.append(rec["step_time_ms"])
                sps.append(rec["samples_per_s"])
            first, start = False, i + 1
        return np.array(ms, dtype=float), np.array(sps, dtype=float)


# --------------------------------------------------------------------------- loading and checks


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` (:func:`mlptrain.metrics.read_metrics`: a torn last line is dropped)."""
    try:
        return read_metrics(path)
    except ValueError as exc:
        raise CompareError(str(exc)) from None


def find_run_dirs(sweep_dir: Path) -> list[Path]:
    """Job directories under ``sweep_dir``: those holding run.json, metrics.jsonl or Hydra's .hydra/."""
    found: set[Path] = set()
    for pattern in ("run.json", "metrics.jsonl", ".hydra"):
        found.update(p.parent for p in sweep_dir.rglob(pattern) if ".hydra" not in p.parent.parts)
    return sorted(found)


def load_run(path: Path) -> Run:
    """Read one job directory. Raises CompareError if a file is missing or unreadable."""
    if not (path / "run.json").is_file():
        raise CompareError(
            f"run {path} is incomplete: it has no run.json (the job failed before training; see its mlptrain.log)"
        )
    if not (path / "metrics.jsonl").is_file():
        raise CompareError(f"run {path} is incomplete: it has no metrics.jsonl")
    try:
        record = json.loads((path / "run.json").read_text(encoding="utf-8"))
        run = Run(path, record)
        _ = (run.mode, run.seed, run.precision)  # the keys must be there
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CompareError(
            f"run {path}: run.json is not an mlptrain run record ({type(exc).__name__}: {exc})"
        ) from None
    for rec in read_jsonl(path / "metrics.jsonl"):
        kind = rec.get("kind")
        if kind == "step":
            run.steps.append(rec)
        elif kind == "epoch":
            run.epochs.append(rec)
        elif kind == "summary":
            run.summary = rec
    run.steps.sort(key=lambda r: r["step"])
    return run


def check_runs(runs: list[Run], sweep_dir: Path) -> dict[int, dict[str, Run]]:
    """Check that the runs are complete and comparable; return them as ``{seed: {mode: run}}``.

    Raises:
        CompareError: one message for the first problem found, naming the run directory.
    """
    if not runs:
        raise CompareError(
            f"no runs in {sweep_dir}: expected job directories with run.json and metrics.jsonl "
            "(made by `make compare` or `python -m mlptrain --config-name compare`)"
        )
    for run in runs:
        if run.mode not in MODES:
            raise CompareError(f"run {run.path} has execution.mode={run.mode!r}; expected one of {MODES}")
        if run.summary is None:
            raise CompareError(
                f"run {run.path} is incomplete: metrics.jsonl has {len(run.steps)} step records and no summary "
                "record (the run did not finish; run the comparison again)"
            )
    for mode in MODES:
        if not any(r.mode == mode for r in runs):
            other = ", ".join(sorted(str(r.path.name) for r in runs))
            raise CompareError(
                f"no {mode} run in {sweep_dir} (found only: {other}); the comparison needs both "
                "execution=fused and execution=naive"
            )
    by_seed: dict[int, dict[str, Run]] = {}
    for run in runs:
        slot = by_seed.setdefault(run.seed, {})
        if run.mode in slot:
            raise CompareError(
                f"runs {slot[run.mode].path} and {run.path} are both {run.mode} with seed {run.seed}; "
                "give each comparison its own sweep directory"
            )
        slot[run.mode] = run
    for seed, slot in sorted(by_seed.items()):
        for mode in MODES:
            if mode not in slot:
                (have,) = slot.values()
                raise CompareError(f"seed {seed} has a {have.mode} run ({have.path}) but no {mode} run to pair it with")
    # Same length: the longest run sets what complete means.
    ref = max(runs, key=lambda r: (len(r.steps), len(r.epochs)))
    for run in runs:
        if len(run.steps) != len(ref.steps) or len(run.epochs) != len(ref.epochs):
            raise CompareError(
                f"run {run.path} is incomplete: it has {len(run.steps)} step and {len(run.epochs)} epoch records, "
                f"its peers have {len(ref.steps)} and {len(ref.epochs)} ({ref.path})"
            )
        if [r["step"] for r in run.steps] != list(range(len(run.steps))):
            raise CompareError(f"run {run.path}: its step records are not numbered 0..{len(run.steps) - 1}")
    # Same experiment: only the swept keys may differ.
    ref_cfg = {k: v for k, v in flatten(ref.config).items() if k not in SWEPT_KEYS}
    for run in runs:
        cfg = {k: v for k, v in flatten(run.config).items() if k not in SWEPT_KEYS}
        for key in sorted(set(ref_cfg) | set(cfg)):
            if ref_cfg.get(key) != cfg.get(key):
                raise CompareError(
                    f"runs {ref.path} and {run.path} differ in {key} ({ref_cfg.get(key)!r} vs {cfg.get(key)!r}); "
                    "a comparison may vary only execution and seed"
                )
        if run.record.get("device") != ref.record.get("device"):
            raise CompareError(
                f"runs {ref.path} and {run.path} ran on different devices "
                f"({ref.record.get('device')!r} vs {run.record.get('device')!r})"
            )
    return dict(sorted(by_seed.items()))


def load_runs(sweep_dir: Path) -> dict[int, dict[str, Run]]:
    """Load and check every run of a sweep: ``{seed: {"fused": Run, "naive": Run}}``.

    Raises:
        CompareError: the directory, a run or a file is missing, a run is incomplete, or the runs
            are not one comparison.
    """
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise CompareError(f"sweep directory {sweep_dir} does not exist")
    return check_runs([load_run(p) for p in find_run_dirs(sweep_dir)], sweep_dir)


# --------------------------------------------------------------------------- numbers


def relative_difference(fused: np.ndarray, naive: np.ndarray) -> np.ndarray:
    """Per step ``(fused - naive) / |naive|``; 0 where both are equal (zeros and NaNs included)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = (fused - naive) / np.abs(naive)
    same = (fused == naive) | (np.isnan(fused) & np.isnan(naive))
    rel[same] = 0.0
    rel[np.isnan(rel)] = np.inf  # one side not finite
    return rel


def running_median(x: np.ndarray, window: int) -> np.ndarray:
    """The median of each ``window`` consecutive values ending at each step (fewer at the start); NaNs skipped."""
    if window <= 1:
        return x.astype(float)
    out = np.empty(len(x), dtype=float)
    for i in range(len(x)):
        part = x[max(0, i - window + 1) : i + 1]
        part = part[np.isfinite(part)]
        out[i] = np.median(part) if len(part) else np.nan
    return out


def _mean_std(values: list[float]) -> dict[str, Any]:
    """Mean and sample standard deviation (None with one seed) of per-seed values."""
    a = np.array(values, dtype=float)
    return {
        "mean": float(a.mean()),
        "std": float(a.std(ddof=1)) if len(a) > 1 else None,
        "per_seed": [float(v) for v in a],
    }


# Student's t, two-sided 95 % (the 0.975 quantile), by degrees of freedom (n seeds - 1): the
# half-width of the interval of a mean paired difference is t * sd / sqrt(n). Between the tabled
# values beyond 30 the next one below is taken (a slightly wider interval, never a narrower one).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
       20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
       29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}  # fmt: skip


def t95(df: int) -> float:
    """Student's t for a two-sided 95 % interval with ``df`` >= 1 degrees of freedom (:data:`T95`)."""
    return T95[max(k for k in T95 if k <= df)]


def paired_difference(fused: list[float], naive: list[float]) -> dict[str, Any]:
    """Fused minus naive, seed by seed, with the 95 % interval of its mean.

    The two runs of a seed start from the same weights and see the same batches, so the
    per-seed difference removes what the seed alone does (one seed's lucky initialisation
    lifts both modes); its spread over seeds is then what rounding differences do to the
    result. ``half_width``: t(n-1) * sd / sqrt(n). ``contains_zero``: whether the interval
    ``mean ± half_width`` holds 0, i.e. whether the seeds show no difference between the modes at
    the 95 % level (about one panel in twenty says NO by chance alone). Both are None where they
    cannot be told: one seed; differences that do not vary over the seeds (no spread to scale them
    by; all zero is the exception: the modes agree on every seed); a value that is not finite.
    """
    d = np.asarray(fused, dtype=float) - np.asarray(naive, dtype=float)
    n = len(d)
    out: dict[str, Any] = {"n": n, "mean": None, "half_width": None, "contains_zero": None,
                           "per_seed": [float(v) for v in d]}  # fmt: skip
    if not np.isfinite(d).all():
        return out
    out["mean"] = float(d.mean())
    tiny = 1e-12  # accuracies are counts over a test set: equal differences may differ in the last bit
    if n > 1 and (np.abs(d) <= tiny).all():
        out.update(half_width=0.0, contains_zero=True)
    elif n > 1 and d.std(ddof=1) > tiny:
        half = float(t95(n - 1) * d.std(ddof=1) / math.sqrt(n))
        out.update(half_width=half, contains_zero=bool(abs(out["mean"]) <= half))
    return out


def summarize(pairs: dict[int, dict[str, Run]]) -> dict[str, Any]:
    """The comparison's numbers (what compare.json holds).

    * ``max_rel_diff``: ``max |fused - naive| / |naive|`` of the training loss over every step and
      seed, with where it happened; ``max_abs_diff`` likewise.
    * per mode: final train loss (mean over the last epoch), final test loss and accuracy, each as
      mean and sample std over seeds; median time per step and samples/s over the timed intervals
      of all seeds (see :meth:`Run.timed_intervals`).
    * ``paired``: for the final test accuracy and loss, fused minus naive seed by seed and the
      95 % interval of its mean (:func:`paired_difference`), or None where a run lacks them.
    * ``speedup``: naive median step time / fused median step time.
    * ``tolerance`` and ``agree``: for fp64 and fp32, whether ``max_rel_diff`` is under it, and
      ``first_above_tolerance``: the earliest step (and its seed) where a seed's difference passed it.
    * ``divergence``: for each of :data:`DIVERGENCE_THRESHOLDS`, the first step where each seed's
      relative difference passed it (``per_seed``, None where it never did) and the earliest of them
      (``step``, ``seed``): how many steps the two modes take to part, whatever the precision.
    """
    seeds = sorted(pairs)
    first = pairs[seeds[0]]["fused"]
    cfg = first.config
    precision = first.precision
    tol = TOLERANCES.get(precision)
    max_rel, max_abs, where, above = 0.0, 0.0, None, None
    firsts: dict[float, list[int | None]] = {t: [] for t in DIVERGENCE_THRESHOLDS}
    for seed in seeds:
        f, n = pairs[seed]["fused"].losses(), pairs[seed]["naive"].losses()
        rel = np.abs(relative_difference(f, n))
        for t, steps in firsts.items():
            steps.append(int(np.argmax(rel > t)) if (rel > t).any() else None)
        i = int(np.argmax(rel))
        if rel[i] > max_rel or where is None:
            max_rel, where = float(rel[i]), {"seed": seed, "step": i}
        if tol is not None and (rel > tol).any():
            j = int(np.argmax(rel > tol))
            if above is None or j < above["step"]:
                above = {"seed": seed, "step": j}
        diff = np.abs(f - n)
        diff[(f == n) | (np.isnan(f) & np.isnan(n))] = 0.0
        diff[np.isnan(diff)] = np.inf
        max_abs = max(max_abs, float(diff.max()))
    modes: dict[str, Any] = {}
    for mode in MODES:
        runs = [pairs[s][mode] for s in seeds]
        out: dict[str, Any] = {}
        for key in ("train/loss", "test/loss", "test/acc"):
            vals = [r.summary.get(key) for r in runs if r.summary is not None]
            out[key] = _mean_std(vals) if vals and all(v is not None for v in vals) else None
        timed = [r.timed_intervals() for r in runs]
        ms = np.concatenate([t[0] for t in timed])
        sps = np.concatenate([t[1] for t in timed])
        out["timed_intervals"] = int(len(ms))
        out["step_time_ms"] = float(np.median(ms)) if len(ms) else None
        out["samples_per_s"] = float(np.median(sps)) if len(sps) else None
        out["step_time_ms_per_seed"] = [float(np.median(t[0])) if len(t[0]) else None for t in timed]
        out["wall_s"] = [float(r.summary["wall_s"]) for r in runs if r.summary and "wall_s" in r.summary]
        modes[mode] = out
    divergence = []
    for t, steps in firsts.items():
        hit = [(step, seed) for step, seed in zip(steps, seeds, strict=True) if step is not None]
        step, seed = min(hit) if hit else (None, None)
        divergence.append({"above": t, "step": step, "seed": seed, "per_seed": steps})
    paired: dict[str, Any] = {}
    for key in ("test/acc", "test/loss"):
        f_stat, n_stat = modes["fused"][key], modes["naive"][key]
        paired[key] = paired_difference(f_stat["per_seed"], n_stat["per_seed"]) if f_stat and n_stat else None
    tf, tn = modes["fused"]["step_time_ms"], modes["naive"]["step_time_ms"]
    opt = cfg.get("optimizer", {})
    return {
        "dataset": cfg["data"]["name"],
        "widths": first.record.get("widths"),
        "activation": cfg.get("model", {}).get("activation", "relu"),
        "precision": precision,
        "batch_size": cfg["data"]["batch_size"],
        "graph": cfg.get("graph"),
        "optimizer": {k: opt[k] for k in ("name", "lr", "weight_decay", "warmup_steps", "schedule") if k in opt},
        "device": first.record.get("device"),
        "mlptrain": first.record.get("mlptrain"),
        "versions": {k: first.record[k] for k in ("python", "numpy", "cupy", "nvmath") if k in first.record},
        "seeds": seeds,
        "steps": len(first.steps),
        "epochs": len(first.epochs),
        "log_every": cfg.get("log_every"),
        "max_rel_diff": max_rel,
        "max_rel_diff_at": where,
        "max_abs_diff": max_abs,
        "tolerance": tol,
        "agree": None if tol is None else bool(max_rel <= tol),
        "first_above_tolerance": above,
        "divergence": divergence,
        "modes": modes,
        "paired": paired,
        "speedup": (tn / tf) if tf and tn else None,
    }


# --------------------------------------------------------------------------- outputs


def title(s: dict[str, Any]) -> str:
    widths = "-".join(map(str, s["widths"] or []))
    n = len(s["seeds"])
    return (
        f"fused vs naive: {s['dataset']} {widths} {s.get('activation', 'relu')}, {s['precision']}, "
        f"batch {s['batch_size']}, {s['device']}, {n} seed{'s' if n > 1 else ''}"
    )


def verdict(s: dict[str, Any]) -> str:
    """One sentence on whether the curves agree, for the table and the figure."""
    n = f"{s['steps']} steps x {len(s['seeds'])} seed{'s' if len(s['seeds']) > 1 else ''}"
    if s["tolerance"] is None:
        return (
            f"{s['precision']}: reduced-precision GEMMs round fused and naive differently and the difference "
            f"compounds over the steps, so these curves are compared by final accuracy and the band over seeds, "
            f"not step by step (largest relative difference {s['max_rel_diff']:.3g} over {n})"
        )
    if s["agree"]:
        return (
            f"agree: the largest relative difference of the per-step training loss, {s['max_rel_diff']:.3g} "
            f"over {n}, is under the {s['precision']} tolerance {s['tolerance']:g}"
        )
    first = s.get("first_above_tolerance") or {}
    return (
        f"DIFFER: the largest relative difference of the per-step training loss, {s['max_rel_diff']:.3g} "
        f"over {n}, is above the {s['precision']} tolerance {s['tolerance']:g}, "
        f"first at step {first.get('step')} (seed {first.get('seed')})"
    )


def plot(pairs: dict[int, dict[str, Run]], s: dict[str, Any], path: Path) -> Any:
    """Write the four-panel figure to ``path`` (PNG) and return the closed Figure."""
    try:
        import matplotlib
    except ImportError:
        raise CompareError("compare.py needs matplotlib for the figure: pip install 'mlptrain[plot]'") from None
    matplotlib.use("Agg")  # headless, whatever the environment says
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    seeds = sorted(pairs)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax_loss, ax_acc, ax_diff, ax_speed = axes.ravel()
    styles = {"fused": {"lw": 2.0, "ls": "-"}, "naive": {"lw": 1.2, "ls": "--"}}

    # (a) training loss per step: mean over seeds, min-max band.
    for mode in MODES:
        L = np.stack([pairs[sd][mode].losses() for sd in seeds])  # (seeds, steps)
        x = np.arange(L.shape[1])
        ax_loss.plot(x, L.mean(0), color=COLORS[mode], label=mode, **styles[mode])
        if len(seeds) > 1:
            ax_loss.fill_between(x, L.min(0), L.max(0), color=COLORS[mode], alpha=0.2, lw=0)
    ax_loss.set_yscale("log")
    ax_loss.set(xlabel="step", ylabel="training loss (batch)", title="training loss per step")
    band = f"; band: min-max over {len(seeds)} seeds" if len(seeds) > 1 else ""
    ax_loss.legend(title=f"mean{band}", fontsize=9, title_fontsize=9)

    # (b) test accuracy per epoch.
    for mode in MODES:
        runs = [pairs[sd][mode] for sd in seeds]
        if not all(r.epochs and r.epochs[0].get("test/acc") is not None for r in runs):
            continue
        A = np.array([[e["test/acc"] for e in r.epochs] for r in runs]) * 100  # (seeds, epochs)
        x = np.arange(1, A.shape[1] + 1)
        ax_acc.plot(x, A.mean(0), color=COLORS[mode], marker="o", ms=3, label=mode, **styles[mode])
        if len(seeds) > 1:
            ax_acc.fill_between(x, A.min(0), A.max(0), color=COLORS[mode], alpha=0.2, lw=0)
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy per epoch")
    ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_acc.legend(fontsize=9)

    # (c) per-step relative difference |fused - naive| / |naive| on a log axis: each seed's running
    # median (the raw values, faint, behind it), and for scale the same measure between two seeds of
    # the naive mode: where the fused-naive curves reach that line, the modes are as far apart as a
    # change of seed makes two runs.
    tol = s["tolerance"]

    def abs_rel(f: np.ndarray, n: np.ndarray) -> np.ndarray:  # NaN where either loss is not finite: no point
        r = np.abs(relative_difference(f, n))
        r[~(np.isfinite(f) & np.isfinite(n))] = np.nan
        return r

    rels = {sd: abs_rel(pairs[sd]["fused"].losses(), pairs[sd]["naive"].losses()) for sd in seeds}
    positive = np.concatenate([r[np.isfinite(r) & (r > 0)] for r in rels.values()])
    floor = min(float(positive.min()) / 3, 1e-9) if len(positive) else 1e-12  # where exact agreement is drawn
    window = max(1, min(25, len(next(iter(rels.values()))) // 30))
    for i, sd in enumerate(seeds):
        rel = np.where(np.isfinite(rels[sd]), np.maximum(rels[sd], floor), np.nan)
        x = np.arange(len(rel))
        color = f"C{i % 10}"
        ax_diff.plot(x, rel, lw=0.4, color=color, alpha=0.25)
        ax_diff.plot(x, running_median(rel, window), lw=1.4, color=color, label=f"seed {sd}")
    if len(seeds) > 1:
        a, b = pairs[seeds[0]]["naive"].losses(), pairs[seeds[1]]["naive"].losses()
        between = abs_rel(a, b)
        between = np.where(np.isfinite(between), np.maximum(between, floor), np.nan)
        ax_diff.plot(np.arange(len(between)), running_median(between, window), color="black", ls="--", lw=1.2,
                     label=f"naive seed {seeds[0]} vs seed {seeds[1]}")  # fmt: skip
    ax_diff.set_yscale("log")
    ax_diff.axhline(floor, color="grey", lw=0.6)
    ax_diff.text(0.01, floor, " equal", transform=ax_diff.get_yaxis_transform(), ha="left", va="bottom",
                 fontsize=8, color="grey")  # fmt: skip
    top = max([float(np.nanmax(r[np.isfinite(r)])) for r in rels.values() if np.isfinite(r).any()] + [floor])
    if len(seeds) > 1 and np.isfinite(between).any():
        top = max(top, float(np.nanmax(between)))
    ax_diff.set_ylim(floor / 3, max(top, tol or 0.0) * 100)  # room above the curves for the text
    if tol is not None:
        ax_diff.axhline(tol, color="tab:red", ls=":", lw=1.2, label=f"{s['precision']} tolerance")
    ax_diff.set(
        xlabel="step",
        ylabel="|fused - naive| / |naive|",
        title=f"training-loss difference per step (running median of {window})"
        if window > 1
        else "training-loss difference per step",
    )
    ax_diff.text(
        0.02,
        0.96,
        f"max |diff| / |naive| = {s['max_rel_diff']:.3g}"
        + ("" if tol is None else f" ({'under' if s['agree'] else 'ABOVE'} {tol:g})"),
        transform=ax_diff.transAxes,
        fontsize=9,
        va="top",
        bbox={"facecolor": "white", "alpha": 0.8, "lw": 0},
    )
    ax_diff.legend(fontsize=8, ncol=2, loc="center right")

    # (d) throughput of the timed intervals, all seeds pooled.
    data, labels = [], []
    for mode in MODES:
        sps = np.concatenate([pairs[sd][mode].timed_intervals()[1] for sd in seeds])
        data.append(sps if len(sps) else np.array([np.nan]))
        labels.append(mode)
    box = ax_speed.boxplot(data, showfliers=False, patch_artist=True, widths=0.5, medianprops={"color": "black"})
    ax_speed.set_xticks([1, 2], labels)
    for patch, mode in zip(box["boxes"], MODES, strict=True):
        patch.set_facecolor(COLORS[mode])
        patch.set_alpha(0.5)
    for i, mode in enumerate(MODES, start=1):
        m = s["modes"][mode]
        if m["samples_per_s"] is not None:
            ax_speed.text(
                i + 0.3,
                m["samples_per_s"],
                f"median\n{m['samples_per_s']:,.0f}/s\n{m['step_time_ms']:.3g} ms/step",
                fontsize=9,
                va="center",
            )
    speed = f"speedup {s['speedup']:.2f}x (naive / fused step time)" if s["speedup"] else "no timed intervals"
    ax_speed.set(ylabel="samples / s (per log interval)", title=f"throughput: {speed}")
    ax_speed.set_xlim(0.5, 2.95)
    if str(s["device"]).startswith("cpu"):
        ax_speed.text(
            0.02,
            0.02,
            "CPU: the NumPy engine emulates the epilogs;\nthis says nothing about fused speed on a GPU",
            transform=ax_speed.transAxes,
            fontsize=8,
            color="dimgrey",
        )

    fig.suptitle(title(s), fontsize=12)
    fig.text(0.5, 0.005, verdict(s), ha="center", va="bottom", fontsize=8.5, wrap=True)
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return fig


def divergence_header(s: dict[str, Any]) -> str:
    """``0.1 % / 1 % / 10 %``: the thresholds of ``s["divergence"]``."""
    return " / ".join(f"{d['above'] * 100:g} %" for d in s.get("divergence", []))


def divergence_cells(s: dict[str, Any]) -> str:
    """``3 / 25 / never``: the earliest step over the seeds where each threshold was passed."""
    return " / ".join("never" if d["step"] is None else str(d["step"]) for d in s.get("divergence", []))


def first_step_above(s: dict[str, Any], threshold: float) -> dict[str, Any] | None:
    """The ``divergence`` entry of ``threshold``, or None if the summary has none (an older compare.json)."""
    return next((d for d in s.get("divergence", []) if math.isclose(d["above"], threshold)), None)


def half_precision_note(s: dict[str, Any]) -> str:
    """What a GPU comparison in fp16, bf16 or TF32 shows, for the table (the index has the whole account)."""
    p = s["precision"]
    u = UNIT_ROUNDOFF.get(p)
    where = first_step_above(s, 1e-2)
    if where is None:  # a summary from before the divergence steps were recorded
        parted = ""
    elif where["step"] is None:
        parted = " Here the per-step losses never differed by more than 1 %."
    else:
        parted = (
            f" Here the per-step losses first differed by more than 1 % at step {where['step']} (seed {where['seed']})."
        )
    gelu = (
        ", and GELU is evaluated by cuBLASLt's epilog in one and by a separate kernel in the other"
        if s.get("activation") == "gelu"
        else ""
    )
    bound = f" (unit roundoff {u:.2g}, against 6e-08 in fp32)" if u else ""
    consequence = (
        "GELU's value and slope follow every such unit"
        if s.get("activation") == "gelu"
        else "a ReLU mask bit differs wherever one path's Z is 0 and the other's just below"
    )
    rounded = (
        f"The GEMMs' inputs are rounded to TF32's 11 significant bits{bound}"
        if p == "tf32"
        else f"Every GEMM result is rounded to {p}{bound}"
    )
    return (
        f"On a GPU the fused and the naive path hand cuBLASLt different GEMMs (fused: `Z^T = W X^T` with the epilogs; "
        f"naive: `Z = X W^T`, then separate kernels), for which it picks different kernels that add the same "
        f"products in another order; the bias gradients are reduced in an epilog in one and by a separate sum "
        f"in the other{gelu}. "
        f"{rounded}, so "
        f"elements near a rounding boundary come out one unit apart from the first step on, {consequence}, and "
        "training amplifies these differences step by "
        f"step until the two runs are as different as two seeds.{parted} So the curves are judged by whether fused "
        "stays within the naive band over seeds and ends at the same accuracy, not step by step. "
        "docs/compare-gpu/README.md says what each path does and why they differ."
    )


def _fmt_stat(stat: dict[str, Any] | None, fmt: str, scale: float = 1.0, unit: str = "") -> str:
    if stat is None:
        return "n/a"
    text = f"{stat['mean'] * scale:{fmt}}{unit}"
    if stat["std"] is not None:
        text += f" ± {stat['std'] * scale:{fmt}}{unit}"
    return text


def commands(sweep_dir: Path, argv: list[str]) -> dict[str, Any]:
    """The commands that made the sweep and this report, from the sweep's multirun.yaml.

    Returns ``{"ran": [training command, this script's command], "make": the make command that
    runs the same sweep, or None}``.
    """
    lines, make = [], None
    meta = sweep_dir / "multirun.yaml"
    if meta.is_file():
        try:
            import yaml  # PyYAML, a dependency of hydra-core's omegaconf

            hydra = (yaml.safe_load(meta.read_text(encoding="utf-8")) or {}).get("hydra", {})
            task = list(hydra.get("overrides", {}).get("task") or [])
            hydra_args = list(hydra.get("overrides", {}).get("hydra") or [])
            name = hydra.get("job", {}).get("config_name", "config")
            if name == "compare":
                # ARGS reaches the recipe's shell unquoted: quote only what the shell would split or expand.
                args = " ".join(a if re.fullmatch(r"[\w@%+=:,./\[\]-]+", a) else shlex.quote(a) for a in task)
                make = f"make compare ARGS={shlex.quote(args)}" if task else "make compare"
            cn = f"--config-name {name}" if name != "config" else "-m"
            lines.append(" ".join(["python -m mlptrain", cn, *map(shlex.quote, hydra_args + task)]))
        except Exception:  # an unreadable multirun.yaml costs only this line
            pass
    lines.append(" ".join(["python scripts/compare.py", *map(shlex.quote, argv)]))
    return {"ran": lines, "make": make}


def write_markdown(s: dict[str, Any], path: Path, made_by: dict[str, Any], figure: str = "compare.png") -> str:
    """Write the table as markdown to ``path`` and return the text."""
    m = s["modes"]
    n = len(s["seeds"])
    over = f"mean ± std over {n} seeds" if n > 1 else "1 seed"

    def row(label: str, key: str, fmt: str, scale: float = 1.0, unit: str = "") -> str:
        cells = [_fmt_stat(m[mode][key], fmt, scale, unit) for mode in MODES]
        return f"| {label} | {cells[0]} | {cells[1]} |"

    def timing(key: str, fmt: str) -> str:
        vals = [m[mode][key] for mode in MODES]
        return " | ".join("n/a" if v is None else f"{v:{fmt}}" for v in vals)

    tol = "not applied (see below)" if s["tolerance"] is None else f"{s['tolerance']:g}"
    speedup = "n/a" if s["speedup"] is None else f"{s['speedup']:.2f}x"
    where = s["max_rel_diff_at"]
    versions = ", ".join(f"{k} {v}" for k, v in {"mlptrain": s["mlptrain"], **s.get("versions", {})}.items())
    at = f" (seed {where['seed']}, step {where['step']})" if s["max_rel_diff"] > 0 and where else ""
    lines = [
        f"# {title(s)}",
        "",
        f"![fused vs naive]({figure})",
        "",
        f"| {s['precision']}, {s['steps']} steps, {s['epochs']} epochs | fused | naive |",
        "|---|---|---|",
        row(f"final train loss (last-epoch mean; {over})", "train/loss", ".4g"),
        row(f"final test loss ({over})", "test/loss", ".4g"),
        row(f"final test accuracy ({over})", "test/acc", ".2f", 100, "%"),
        *(
            [
                f"| final test accuracy, fused - naive paired by seed (95 % interval) | {_gap_cell(accuracy_gap(s))} "
                f"(no difference at 95 %: {_verdict_cell(accuracy_gap(s))}) | |"
            ]
            if n > 1 and accuracy_gap(s) is not None
            else []
        ),
        f"| median time per step (ms) | {timing('step_time_ms', '.4g')} |",
        f"| median samples/s | {timing('samples_per_s', ',.0f')} |",
        "",
        "| fused vs naive | |",
        "|---|---|",
        f"| largest relative training-loss difference, max over steps and seeds of abs(f - n) / abs(n) "
        f"| {s['max_rel_diff']:.3g}{at} |",
        f"| largest absolute training-loss difference | {s['max_abs_diff']:.3g} |",
        f"| first step where the relative difference passes {divergence_header(s)} (earliest seed) "
        f"| {divergence_cells(s)} |",
        f"| tolerance ({s['precision']}) | {tol} |",
        f"| verdict | {verdict(s)} |",
        f"| speedup (naive / fused median time per step) | {speedup} |",
        "",
        f"Time per step is the median over the timed log intervals of all seeds (log_every={s['log_every']}; "
        "the first interval, warm-up, and intervals that cross an epoch boundary are left out).",
    ]
    if str(s["device"]).startswith("cpu"):
        lines += [
            "",
            "On the CPU the fused engine is the NumPy epilog contract (`mlptrain/epilogs.py`): it computes what "
            "cuBLASLt computes, with extra passes where cuBLASLt works in registers (packing the relu_aux bits), "
            "so CPU timings say nothing about fused speed on a GPU. What the CPU comparison shows is that the "
            "fused and naive paths compute the same training run.",
        ]
    elif s["tolerance"] is not None:
        lines += [
            "",
            "On a GPU the fused and the naive path run different cuBLASLt kernels (with and without epilogs), "
            f"whose {s['precision']} results can differ in the last bits; such differences compound from step "
            "to step, and late in training, when the batch loss is small, they weigh more relative to it. "
            "The per-step panel of the figure shows how the difference grows.",
        ]
    else:
        lines += ["", half_precision_note(s)]
    lines += [
        "",
        "Made by:",
        "",
        "```",
        *made_by["ran"],
        "```",
        "",
        *([f"`{made_by['make']}` runs the same sweep and report.", ""] if made_by.get("make") else []),
        f"Report written {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; the runs: device {s['device']}; "
        f"{versions}; seeds {', '.join(map(str, s['seeds']))}.",
        "",
    ]
    text = "\n".join(lines)
    path.write_text(text, encoding="utf-8")
    return text


# --------------------------------------------------------------------------- the index of several comparisons

INDEX_NAME = "README.md"
ACTIVATION_ORDER = ("relu", "gelu", "none")
PRECISION_ORDER = ("fp64", "fp32", "tf32", "fp16", "bf16")

# What the index says about the two paths. Kept beside the code that makes the page, so that a change
# of either shows in one diff. Every statement is about mlptrain/execution.py and mlptrain/epilogs.py.
DIFFERENCES_TEMPLATE = """\
## How fused and naive differ, and why their curves part

Both modes train the same model from the same initial weights on the same batches in the same
order, with the same loss, the same optimizer kernel (fp32 master weights, a half-precision copy
for the GEMMs) and the same loss-scaling rules. In fp16 and bf16 both run every GEMM with fp32
accumulation and round its result to the half format. They differ only in how a layer's GEMMs and
the work around them are done (`mlptrain/execution.py`):

{table}

Where the numbers part:

1. **Different GEMM kernels.** The two modes give cuBLASLt different problems (other operand
   orders, another output layout, with or without an epilog), so its heuristics choose different
   kernels, with different tiles and a different split of the sum over K: the fp32 accumulators add
   the same products in another order and can differ in their last bits. Rounded to fp16 (11
   significant bits) or bf16 (8), most elements still agree; those near a rounding boundary come
   out one unit in the last place apart: 0.05 % to 0.1 % of the value in fp16, 0.4 % to 0.8 % in
   bf16, where two fp32 results would differ by about 1e-7.
2. **Different reductions.** A bias gradient is a sum over the batch: inside an epilog (or the
   loss kernel) in one mode, a separate reduction in the other, the same numbers added in another
   order. At MNIST-1D's output layer (10 classes, ReLU below) the input gradient is a small kernel of
   mlptrain's in fused mode and a GEMM and a mask multiply in naive.
3. **GELU by two implementations.** The epilog and the naive kernel evaluate the same tanh formula
   in fp32 with different code, so their fp32 values need not agree in the last bit; rounding to
   the half format hides most of that, not all. ReLU has no such difference: `relu(round(z))` is
   `round(relu(z))`.
4. **Not a difference: the bias and relu'(0).** cuBLASLt's bias epilogs round the product before
   they add the bias (measured on the H200; `mlptrain/epilogs.py` keeps both roundings), as the
   naive path does, so the same product gives the same `Z` in both. Both keep the mask `Z >= 0`:
   relu'(0) = 1 in both, and an exact `Z = 0` (a product that the bias cancels, common in half
   precision) passes its gradient in either mode.
5. **How one unit becomes more.** Where one mode's `Z` is exactly 0 and the other's one unit below,
   the mask bit differs: that element's gradient passes in one mode and is dropped in the other. In
   fp16 a step whose gradients overflow in one mode only is skipped in that mode only.

Each step's update depends on all of these last-bit differences, and training amplifies a
perturbation from step to step, as it amplifies a change of seed. The two runs start identical and
part a little more each step (the column "first differ by more than 1 %" says when), until they are
as different as two runs of one mode with different seeds. In half precision the question is
therefore not whether the curves coincide but whether the fused runs stay within the spread of the
naive ones over seeds and end at the same accuracy. In fp32 the same kernels differ by about 1e-7
per result and the curves stay together far longer; on the CPU both modes make the very same BLAS
calls and agree bit for bit (docs/compare-cpu/).

Speed: each naive pass over an activation or a gradient (the bias add, the ReLU and its mask, the
mask multiply, the bias-gradient sum) reads and writes the whole `batch x width` array in GPU
memory, 64 MiB for 8192 x 4096 in half precision, and the naive mask is a byte per element where
`relu_aux` is a bit. The epilogs do that work on the GEMM's output tile while it is in registers
and write it once. At MNIST-1D's sizes the GEMMs take microseconds and the replayed graph is a
chain of small kernels, so its time per step says little about the epilogs; the speed task, whose
two 4096 x 4096 layers at a batch of 8192 make the GEMMs large, does.
"""
# (per layer, fused, naive): the rows of the table in DIFFERENCES.
DIFFERENCE_ROWS = (
    (
        "forward GEMM",
        "`Z^T = W X^T`: the result column-major, with the epilog `RELU_AUX_BIAS` or `GELU_AUX_BIAS`",
        "`Z = X W^T`: the result row-major, no epilog",
    ),
    (
        "bias",
        "added by the epilog to the rounded product, rounded again",
        "`Z += b`, a separate kernel, on the rounded product, rounded again",
    ),
    (
        "activation",
        "ReLU or GELU (tanh form, fp32) in the epilog",
        "`maximum(Z, 0)`; GELU: a separate element-wise kernel, the same tanh form in fp32",
    ),
    (
        "kept for the backward",
        "ReLU: `relu_aux`, 1 bit per element (`Z >= 0`); GELU: `Z`",
        "ReLU: 1 byte per element (`Z >= 0`); GELU: `Z`",
    ),
    (
        "input gradient",
        "`W^T dZ^T` with the `DRELU` / `DGELU` epilog (the output layer of a small head with ReLU below: "
        "one kernel of mlptrain's)",
        "`dZ W`, then a multiply by the mask or by gelu'(Z)",
    ),
    (
        "bias gradient",
        "summed over the batch inside an epilog (`DRELU_BGRAD` / `DGELU_BGRAD` or `BGRADB`, whichever was "
        "timed faster for the shape; a small head's output bias: by the loss kernel)",
        "a separate column sum of `dZ`",
    ),
    ("weight gradient", "`X^T dZ`, plain or with `BGRADB`", "`X^T dZ`, plain"),
)
DIFFERENCES = DIFFERENCES_TEMPLATE.format(
    table="\n".join(
        ["| per layer | fused (`execution=fused`) | naive (`execution=naive`) |", "|---|---|---|"]
        + [f"| {what} | {fused} | {naive} |" for what, fused, naive in DIFFERENCE_ROWS]
    )
)


@dataclass
class Panel:
    """One comparison of an index: its folder (relative to the index) and its compare.json numbers."""

    name: str
    summary: dict[str, Any]
    speed: dict[str, Any] | None = None  # <panel>/speed/compare.json, the speed task of the same panel


def _read_summary(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        _ = (data["precision"], data["modes"]["fused"], data["modes"]["naive"], data["seeds"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CompareError(
            f"{path} is not a compare.json of scripts/compare.py ({type(exc).__name__}: {exc})"
        ) from None
    return data


def load_panels(root: Path) -> list[Panel]:
    """Every ``<root>/<panel>/compare.json`` (with ``<panel>/speed/compare.json`` when there is one),
    ordered by dataset, activation (relu, gelu, none) and precision (fp64 ... bf16).

    Raises:
        CompareError: ``root`` does not exist, holds no panel, or a compare.json cannot be read.
    """
    root = Path(root)
    if not root.is_dir():
        raise CompareError(f"index directory {root} does not exist")
    panels = []
    for path in sorted(root.glob("*/compare.json")):
        speed = path.parent / "speed" / "compare.json"
        panels.append(Panel(path.parent.name, _read_summary(path), _read_summary(speed) if speed.is_file() else None))
    if not panels:
        raise CompareError(
            f"no comparisons in {root}: expected <panel>/compare.json files "
            f"(scripts/compare.py SWEEP --out {root}/<panel>)"
        )

    def order(p: Panel) -> tuple:
        act, prec = p.summary.get("activation", "relu"), p.summary["precision"]
        return (
            str(p.summary.get("dataset")),
            ACTIVATION_ORDER.index(act) if act in ACTIVATION_ORDER else len(ACTIVATION_ORDER),
            PRECISION_ORDER.index(prec) if prec in PRECISION_ORDER else len(PRECISION_ORDER),
            p.name,
        )

    return sorted(panels, key=order)


def accuracy_gap(s: dict[str, Any]) -> dict[str, Any] | None:
    """The paired fused - naive difference of the final test accuracy (:func:`paired_difference`),
    or None where the accuracies are missing (a compare.json of before the field: recomputed from
    the per-seed accuracies, which pair by position as both modes list the same seeds)."""
    paired = (s.get("paired") or {}).get("test/acc")
    if paired is not None:
        return paired
    f, n = s["modes"]["fused"].get("test/acc"), s["modes"]["naive"].get("test/acc")
    if not f or not n:
        return None
    return paired_difference(f["per_seed"], n["per_seed"])


def _ms(m: dict[str, Any]) -> str:
    return "n/a" if m.get("step_time_ms") is None else f"{m['step_time_ms']:.4g}"


def _speedup(s: dict[str, Any] | None) -> str:
    return "n/a" if s is None or s.get("speedup") is None else f"{s['speedup']:.2f}x"


def _recipe(s: dict[str, Any]) -> str:
    """One line on what a panel trained: data, model, batch, optimizer, steps and seeds."""
    widths = "-".join(map(str, s.get("widths") or []))
    opt = s.get("optimizer") or {}
    if opt:
        warm = f", {opt['warmup_steps']} warm-up steps" if opt.get("warmup_steps") else ""
        sched = f", then {opt['schedule']}" if opt.get("schedule") and opt.get("schedule") != "constant" else ""
        wd = f", weight decay {opt['weight_decay']:g}" if opt.get("weight_decay") else ""
        optimizer = f"{opt.get('name', '?')} at lr {opt.get('lr', float('nan')):g}{wd}{warm}{sched}"
    else:
        optimizer = "optimizer not recorded"
    n, epochs = len(s["seeds"]), s["epochs"]
    if str(s.get("device")).startswith("cpu"):
        graph = "on the CPU (no CUDA graph)"
    else:
        graph = "no CUDA graph" if s.get("graph") is False else "each step replayed as one CUDA graph"
    return (
        f"{s['dataset']} {widths}, batch {s['batch_size']}, {optimizer}; {epochs} epoch{'s' if epochs != 1 else ''}, "
        f"{s['steps']} steps; {n} seed{'s' if n > 1 else ''} ({', '.join(map(str, s['seeds']))}); {graph}"
    )


def _accuracy_table(panels: list[Panel]) -> list[str]:
    """The index's accuracy table: one row per panel, linking its compare.md."""
    lines = [
        "| panel | activation | precision | final test accuracy, fused | final test accuracy, naive "
        "| fused - naive, paired by seed (95 % interval) | no difference at 95 % | losses first differ by more than "
        "1 % at step | largest relative loss difference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in panels:
        s = p.summary
        gap = accuracy_gap(s)
        acc = [_fmt_stat(s["modes"][m].get("test/acc"), ".2f", 100, "%") for m in MODES]
        first_1 = first_step_above(s, 1e-2)
        parted = "n/a" if first_1 is None else ("never" if first_1["step"] is None else str(first_1["step"]))
        lines.append(
            f"| [{p.name}]({p.name}/compare.md) | {s.get('activation', 'relu')} | {s['precision']} "
            f"| {acc[0]} | {acc[1]} "
            f"| {_gap_cell(gap)} | {_verdict_cell(gap)} | {parted} "
            f"| {s['max_rel_diff']:.3g} |"
        )
    return lines + [
        "",
        "Accuracy: mean ± standard deviation over the seeds of the last epoch's test accuracy. *Paired by seed*: "
        "the mean over seeds of fused minus naive, each seed's two runs having started from the same weights on "
        "the same batches, ± the half-width of its 95 % interval (Student's t over the seeds). *No difference at "
        "95 %*: the interval holds 0. At that level about one panel in twenty says NO by chance alone; a NO is "
        "settled by more seeds, not by a reading of the curves. The step and the difference are those of the "
        "per-step training loss, `abs(fused - naive) / abs(naive)`, over every seed.",
    ]


def _gap_cell(gap: dict[str, Any] | None) -> str:
    if gap is None or gap.get("mean") is None:
        return "n/a"
    half = "" if gap.get("half_width") is None else f" ± {gap['half_width'] * 100:.2f}"
    return f"{gap['mean'] * 100:+.2f}{half} pp"


def _verdict_cell(gap: dict[str, Any] | None) -> str:
    if gap is None or gap.get("mean") is None:
        return "n/a"
    if gap.get("contains_zero") is None:
        return "n/a (1 seed)" if gap.get("n", 0) < 2 else "n/a (no spread over the seeds)"
    return "yes" if gap["contains_zero"] else "NO"


def _speed_table(panels: list[Panel]) -> list[str]:
    """The index's speed table: the accuracy runs' and the speed task's time per step, per panel."""
    lines = [
        "| panel | accuracy runs: ms per step, fused | naive | speedup | speed task: ms per step, fused | naive "
        "| speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in panels:
        s, sp = p.summary, p.speed
        speed_cells = (
            f"[{_ms(sp['modes']['fused'])}]({p.name}/speed/compare.md) | {_ms(sp['modes']['naive'])} | {_speedup(sp)}"
            if sp
            else "n/a | n/a | n/a"
        )
        lines.append(
            f"| {p.name} | {_ms(s['modes']['fused'])} | {_ms(s['modes']['naive'])} | {_speedup(s)} | {speed_cells} |"
        )
    cpu = str(panels[0].summary.get("device")).startswith("cpu")
    return lines + [
        "",
        "Median time per step over the timed log intervals (the first, warm-up, and those that cross an epoch "
        "are left out); speedup: naive over fused."
        + (
            " On the CPU the fused engine is the NumPy epilog contract, which emulates in extra passes what "
            "cuBLASLt does in registers: these times say nothing about the GPU."
            if cpu
            else ""
        ),
    ]


def _panel_sections(panels: list[Panel]) -> list[str]:
    """One section per panel: its links and its figure."""
    lines = []
    for p in panels:
        s = p.summary
        speed_link = f" · [speed task]({p.name}/speed/compare.md)" if p.speed else ""
        lines += [
            f"### {s.get('activation', 'relu')}, {s['precision']} ({p.name})",
            "",
            f"[table and commands]({p.name}/compare.md){speed_link}",
            "",
            f"![fused vs naive, {p.name}]({p.name}/compare.png)",
            "",
        ]
    return lines


def index_markdown(panels: list[Panel], made_by: str | None = None, note: str | None = None) -> str:
    """The index page of several comparisons: the recipes, the accuracy and the speed table, how fused
    and naive differ (:data:`DIFFERENCES`), each panel's figure, and what made them."""
    first = panels[0].summary
    acts = list(dict.fromkeys(p.summary.get("activation", "relu") for p in panels))
    precs = list(dict.fromkeys(p.summary["precision"] for p in panels))
    data = list(dict.fromkeys(str(p.summary["dataset"]) for p in panels))
    lines = [
        f"# Fused vs naive on {first.get('device')}: {', '.join(data)}; {' and '.join(acts)}; {' and '.join(precs)}",
        "",
        "Each panel trains the same model twice per seed, with the epilogs fused into the GEMMs (`execution=fused`) "
        "and with plain GEMMs and separate kernels (`execution=naive`), from the same weights on the same batches.",
        "",
    ]
    lines += [f"- Accuracy: {r}." for r in dict.fromkeys(_recipe(p.summary) for p in panels)]
    speed_recipes = dict.fromkeys(_recipe(p.speed) for p in panels if p.speed)
    lines += [f"- Speed task (for the time per step only): {r}." for r in speed_recipes]
    lines += ["", "## Accuracy", "", *_accuracy_table(panels), ""]
    if note:  # what the person who ran the comparisons read in these tables (--note FILE)
        lines += [note.strip(), ""]
    lines += ["## Speed", "", *_speed_table(panels), ""]
    lines += [DIFFERENCES, "## The panels", "", *_panel_sections(panels), "## Made by", ""]
    if made_by:
        lines += ["```", made_by, "```", ""]
    versions = ", ".join(
        f"{k} {v}" for k, v in {"mlptrain": first.get("mlptrain"), **first.get("versions", {})}.items() if v
    )
    lines += [
        "Each panel's compare.md gives the commands of its two sweeps. "
        f"Device: {first.get('device')}; {versions}. "
        f"Index written {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}.",
        "",
    ]
    return "\n".join(lines)


def write_index(root: Path, made_by: str | None = None, note: str | None = None) -> Path:
    """Write ``<root>/README.md``, the index of the comparisons under ``root``; returns its path."""
    root = Path(root)
    path = root / INDEX_NAME
    path.write_text(index_markdown(load_panels(root), made_by, note), encoding="utf-8")
    return path


def _json_ready(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_ready(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_ready(x) for x in v]
    return v


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description="Compare the fused and naive runs of a `make compare` sweep.")
    parser.add_argument("sweep_dir", type=Path, nargs="?", help="the Hydra sweep directory (runs/compare/<time>)")
    parser.add_argument(
        "--out", type=Path, default=None, help="where to write compare.png/.md/.json (default: sweep_dir)"
    )
    parser.add_argument(
        "--index",
        type=Path,
        default=None,
        metavar="DIR",
        help="instead of a sweep: write DIR/README.md, the index of the comparisons in DIR/<panel>/compare.json",
    )
    parser.add_argument("--made-by", default=None, help="with --index: the command that made the comparisons")
    parser.add_argument(
        "--note", type=Path, default=None, help="with --index: a markdown file whose text follows the accuracy table"
    )
    args = parser.parse_args(argv)
    if (args.index is None) == (args.sweep_dir is None):
        parser.error("give a sweep directory or --index DIR, not both")
    if args.index is None and (args.note is not None or args.made_by is not None):
        parser.error("--note and --made-by apply to --index, not to a sweep")
    if args.index is not None:
        if args.out is not None:
            parser.error("--out applies to a sweep, not to --index")
        try:
            note = None
            if args.note is not None:
                try:
                    note = args.note.read_text(encoding="utf-8")
                except OSError as exc:
                    raise CompareError(f"--note {args.note}: {exc.strerror or exc}") from None
                except UnicodeDecodeError as exc:
                    raise CompareError(f"--note {args.note}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
            path = write_index(args.index, args.made_by, note)
        except CompareError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {path}")
        return 0
    out = args.out or args.sweep_dir
    try:
        pairs = load_runs(args.sweep_dir)
        s = summarize(pairs)
        out.mkdir(parents=True, exist_ok=True)
        plot(pairs, s, out / "compare.png")
        made_by = commands(args.sweep_dir, argv)
        write_markdown(s, out / "compare.md", made_by)
        (out / "compare.json").write_text(
            json.dumps(_json_ready({**s, "commands": made_by}), indent=2, allow_nan=False) + "\n", encoding="utf-8"
        )
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(verdict(s))
    if s["speedup"] is not None:
        print(f"speedup (naive / fused median time per step): {s['speedup']:.2f}x on {s['device']}")
    print(f"wrote {out / 'compare.png'}, {out / 'compare.md'}, {out / 'compare.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
