"""The statistics of a comparison: per-step relative differences, running medians, and the paired
difference of the two modes over seeds with its 95 % interval (Student's t)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


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


def mean_std(values: list[Any]) -> dict[str, Any]:
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
T95 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    16: 2.120,
    17: 2.110,
    18: 2.101,
    19: 2.093,
    20: 2.086,
    21: 2.080,
    22: 2.074,
    23: 2.069,
    24: 2.064,
    25: 2.060,
    26: 2.056,
    27: 2.052,
    28: 2.048,
    29: 2.045,
    30: 2.042,
    40: 2.021,
    60: 2.000,
    120: 1.980,
}


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
    out: dict[str, Any] = {
        "n": n,
        "mean": None,
        "half_width": None,
        "contains_zero": None,
        "per_seed": [float(v) for v in d],
    }
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


def interval_within(gap: dict[str, Any] | None, bound: float) -> dict[str, Any]:
    """Whether the 95 % interval of a paired difference (:func:`paired_difference`) lies inside ``± bound``.

    ``low`` and ``high``: ``mean ∓ half_width``; ``inside``: ``-bound <= low`` and ``high <= bound``
    (an equivalence test at the 2.5 % level on each side: both one-sided tests reject a difference as
    large as ``bound``), None where the interval cannot be told (one seed, no spread, not finite).
    """
    out: dict[str, Any] = {"bound": bound, "low": None, "high": None, "inside": None}
    if gap is None or gap.get("mean") is None or gap.get("half_width") is None:
        return out
    low, high = gap["mean"] - gap["half_width"], gap["mean"] + gap["half_width"]
    out.update(low=low, high=high, inside=bool(-bound <= low and high <= bound))
    return out
