"""The numbers of a comparison (what compare.json holds), from the paired runs of :mod:`.runs`."""

from __future__ import annotations

from typing import Any

import numpy as np

from mlptrain.config.schema import flatten
from mlptrain.tools.compare.axis import ALWAYS_SWEPT, EXECUTION, Axis
from mlptrain.tools.compare.runs import Run
from mlptrain.tools.compare.stats import interval_within, mean_std, paired_difference, relative_difference

# Largest relative per-step difference of the training loss at which fused and naive "agree".
# fp64 and fp32 are exact contracts (on the CPU both modes issue the very same BLAS calls);
# half precision and TF32 round the fused and the plain GEMMs differently, and the difference
# compounds over the steps, so those curves are compared by final accuracy and seed band instead.
TOLERANCES = {"fp64": 1e-10, "fp32": 1e-5}
# How fast the curves part: the first step where the relative difference passes each of these.
DIVERGENCE_THRESHOLDS = (1e-3, 1e-2, 1e-1)
# The paired final-accuracy difference "is within" this when its whole 95 % interval is: half a point.
ACCURACY_BOUND = 0.005


def axis_of(pairs: dict[int, dict[str, Run]]) -> Axis:
    """The axis of pairs made by :func:`mlptrain.tools.compare.runs.check_runs`: the arms in their order, and the
    config key the two runs of a seed differ in (``execution.mode`` where they differ in none)."""
    slot = pairs[min(pairs)]
    arms = tuple(slot)
    assert len(arms) == 2, arms
    a, b = (flatten(slot[arm].config) for arm in arms)
    keys = [k for k in sorted(set(a) | set(b)) if k not in ALWAYS_SWEPT and a.get(k) != b.get(k)]
    return Axis(keys[0] if len(keys) == 1 else EXECUTION.key, arms)  # type: ignore[arg-type]


def summarize(pairs: dict[int, dict[str, Run]]) -> dict[str, Any]:
    """The comparison's numbers (what compare.json holds).

    * ``max_rel_diff``: ``max |fused - naive| / |naive|`` of the training loss over every step and
      seed, with where it happened; ``max_abs_diff`` likewise.
    * per mode: final train loss (mean over the last epoch), final test loss and accuracy, each as
      mean and sample std over seeds; median time per step and samples/s over the timed intervals
      of all seeds (see :meth:`Run.timed_intervals`).
    * ``paired``: for the final test accuracy and loss, fused minus naive seed by seed and the
      95 % interval of its mean (:func:`paired_difference`), or None where a run lacks them.
    * ``axis``: what was compared (:class:`Axis`: ``execution.mode``, ``fused`` and ``naive``; or
      ``precision.name``, ``fp8`` and ``bf16``); every "fused" and "naive" here is then the axis's
      candidate and reference, and ``modes`` is keyed by its arms.
    * ``equivalence``: whether the paired final-accuracy difference's 95 % interval lies inside
      ``± ACCURACY_BOUND`` (:func:`interval_within`).
    * ``speedup``: naive median step time / fused median step time.
    * ``tolerance`` and ``agree``: for fp64 and fp32, fused vs naive, whether ``max_rel_diff`` is under it, and
      ``first_above_tolerance``: the earliest step (and its seed) where a seed's difference passed it.
    * ``divergence``: for each of :data:`DIVERGENCE_THRESHOLDS`, the first step where each seed's
      relative difference passed it (``per_seed``, None where it never did) and the earliest of them
      (``step``, ``seed``): how many steps the two modes take to part, whatever the precision.
    """
    seeds = sorted(pairs)
    axis = axis_of(pairs)
    cand, ref = axis.arms
    first = pairs[seeds[0]][cand]
    cfg = first.config
    precision = first.precision
    # Exact contracts hold between the two execution modes of one precision, not between precisions.
    tol = TOLERANCES.get(precision) if axis.key == EXECUTION.key else None
    diffs = loss_differences(pairs, tol)
    modes = {arm: mode_numbers([pairs[sd][arm] for sd in seeds]) for arm in axis.arms}
    paired: dict[str, Any] = {}
    for key in ("test/acc", "test/loss"):
        f_stat, n_stat = modes[cand][key], modes[ref][key]
        paired[key] = paired_difference(f_stat["per_seed"], n_stat["per_seed"]) if f_stat and n_stat else None
    tf, tn = modes[cand]["step_time_ms"], modes[ref]["step_time_ms"]
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
        "max_rel_diff": diffs["max_rel_diff"],
        "max_rel_diff_at": diffs["max_rel_diff_at"],
        "max_abs_diff": diffs["max_abs_diff"],
        "tolerance": tol,
        "agree": None if tol is None else bool(diffs["max_rel_diff"] <= tol),
        "first_above_tolerance": diffs["first_above_tolerance"],
        "divergence": diffs["divergence"],
        "axis": axis.as_dict(),
        "modes": modes,
        "paired": paired,
        "equivalence": interval_within(paired["test/acc"], ACCURACY_BOUND),
        "speedup": (tn / tf) if tf and tn else None,
    }


def loss_differences(pairs: dict[int, dict[str, Run]], tol: float | None) -> dict[str, Any]:
    """How far the per-step training losses of the two modes part, over every step and seed: the
    largest relative and absolute difference (and where the relative one was), the earliest step
    above ``tol``, and the first step above each of :data:`DIVERGENCE_THRESHOLDS` (see :func:`summarize`)."""
    seeds = sorted(pairs)
    max_rel, max_abs, where, above = 0.0, 0.0, None, None
    firsts: dict[float, list[int | None]] = {t: [] for t in DIVERGENCE_THRESHOLDS}
    for seed in seeds:
        cand, ref = pairs[seed]  # the arms, candidate first (fused, naive)
        f, n = pairs[seed][cand].losses(), pairs[seed][ref].losses()
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
    divergence = []
    for t, steps in firsts.items():
        hit = [(step, seed) for step, seed in zip(steps, seeds, strict=True) if step is not None]
        first: tuple[int | None, int | None] = min(hit) if hit else (None, None)
        divergence.append({"above": t, "step": first[0], "seed": first[1], "per_seed": steps})
    return {
        "max_rel_diff": max_rel,
        "max_rel_diff_at": where,
        "max_abs_diff": max_abs,
        "first_above_tolerance": above,
        "divergence": divergence,
    }


def mode_numbers(runs: list[Run]) -> dict[str, Any]:
    """One mode's numbers over its runs (one per seed): final losses and accuracy (mean and std over
    seeds), and the median time per step and samples/s over the timed intervals of all seeds."""
    out: dict[str, Any] = {}
    for key in ("train/loss", "test/loss", "test/acc"):
        vals = [r.summary.get(key) for r in runs if r.summary is not None]
        out[key] = mean_std(vals) if vals and all(v is not None for v in vals) else None
    timed = [r.timed_intervals() for r in runs]
    ms = np.concatenate([t[0] for t in timed])
    sps = np.concatenate([t[1] for t in timed])
    out["timed_intervals"] = int(len(ms))
    out["step_time_ms"] = float(np.median(ms)) if len(ms) else None
    out["samples_per_s"] = float(np.median(sps)) if len(sps) else None
    out["step_time_ms_per_seed"] = [float(np.median(t[0])) if len(t[0]) else None for t in timed]
    out["wall_s"] = [float(r.summary["wall_s"]) for r in runs if r.summary and "wall_s" in r.summary]
    return out
