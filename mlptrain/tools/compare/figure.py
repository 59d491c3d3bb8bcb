"""The four-panel figure of a comparison (compare.png; matplotlib, the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.tools.compare.arms import arms
from mlptrain.tools.compare.report import title, verdict
from mlptrain.tools.compare.runs import CompareError, Run
from mlptrain.tools.compare.stats import relative_difference, running_median

# By the arm's place: the candidate (fused, fp8) solid blue, the reference (naive, bf16) dashed orange.
COLORS = ("tab:blue", "tab:orange")
STYLES = ({"lw": 2.0, "ls": "-"}, {"lw": 1.2, "ls": "--"})


def plot(pairs: dict[int, dict[str, Run]], s: dict[str, Any], path: Path) -> Any:
    """Write the four-panel figure to ``path`` (PNG) and return the closed Figure."""
    try:
        import matplotlib
    except ImportError:
        raise CompareError("mlptrain.compare needs matplotlib for the figure: pip install -e '.[plot]'") from None
    matplotlib.use("Agg")  # headless, whatever the environment says
    import matplotlib.pyplot as plt

    seeds = sorted(pairs)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax_loss, ax_acc, ax_diff, ax_speed = axes.ravel()
    _loss_panel(ax_loss, pairs, seeds, arms(s))
    _accuracy_panel(ax_acc, pairs, seeds, arms(s))
    _difference_panel(ax_diff, pairs, seeds, s)
    _speed_panel(ax_speed, pairs, seeds, s)

    fig.suptitle(title(s), fontsize=12)
    fig.text(0.5, 0.005, verdict(s), ha="center", va="bottom", fontsize=8.5, wrap=True)
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return fig


def _loss_panel(ax_loss: Any, pairs: dict[int, dict[str, Run]], seeds: list[int], modes: tuple[str, str]) -> None:
    """(a) Training loss per step: mean over seeds, min-max band."""
    for i, mode in enumerate(modes):
        L = np.stack([pairs[sd][mode].losses() for sd in seeds])  # (seeds, steps)
        x = np.arange(L.shape[1])
        ax_loss.plot(x, L.mean(0), color=COLORS[i], label=mode, **STYLES[i])
        if len(seeds) > 1:
            ax_loss.fill_between(x, L.min(0), L.max(0), color=COLORS[i], alpha=0.2, lw=0)
    ax_loss.set_yscale("log")
    ax_loss.set(xlabel="step", ylabel="training loss (batch)", title="training loss per step")
    band = f"; band: min-max over {len(seeds)} seeds" if len(seeds) > 1 else ""
    ax_loss.legend(title=f"mean{band}", fontsize=9, title_fontsize=9)


def _accuracy_panel(ax_acc: Any, pairs: dict[int, dict[str, Run]], seeds: list[int], modes: tuple[str, str]) -> None:
    """(b) Test accuracy per epoch."""
    from matplotlib.ticker import MaxNLocator

    for i, mode in enumerate(modes):
        runs = [pairs[sd][mode] for sd in seeds]
        if not all(r.epochs and r.epochs[0].get("test/acc") is not None for r in runs):
            continue
        A = np.array([[e["test/acc"] for e in r.epochs] for r in runs]) * 100  # (seeds, epochs)
        x = np.arange(1, A.shape[1] + 1)
        ax_acc.plot(x, A.mean(0), color=COLORS[i], marker="o", ms=3, label=mode, **STYLES[i])
        if len(seeds) > 1:
            ax_acc.fill_between(x, A.min(0), A.max(0), color=COLORS[i], alpha=0.2, lw=0)
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy per epoch")
    ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_acc.legend(fontsize=9)


def _difference_panel(ax_diff: Any, pairs: dict[int, dict[str, Run]], seeds: list[int], s: dict[str, Any]) -> None:
    # (c) per-step relative difference |fused - naive| / |naive| (or fp8 and bf16) on a log axis: each
    # seed's running median (the raw values, faint, behind it), and for scale the same measure between
    # two seeds of the reference: where the fused-naive curves reach that line, the modes are as far
    # apart as a change of seed makes two runs.
    tol = s["tolerance"]
    cand, ref = arms(s)

    def abs_rel(f: np.ndarray, n: np.ndarray) -> np.ndarray:  # NaN where either loss is not finite: no point
        r = np.abs(relative_difference(f, n))
        r[~(np.isfinite(f) & np.isfinite(n))] = np.nan
        return r

    rels = {sd: abs_rel(pairs[sd][cand].losses(), pairs[sd][ref].losses()) for sd in seeds}
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
        a, b = pairs[seeds[0]][ref].losses(), pairs[seeds[1]][ref].losses()
        between = abs_rel(a, b)
        between = np.where(np.isfinite(between), np.maximum(between, floor), np.nan)
        ax_diff.plot(
            np.arange(len(between)),
            running_median(between, window),
            color="black",
            ls="--",
            lw=1.2,
            label=f"{ref} seed {seeds[0]} vs seed {seeds[1]}",
        )
    ax_diff.set_yscale("log")
    ax_diff.axhline(floor, color="grey", lw=0.6)
    ax_diff.text(
        0.01, floor, " equal", transform=ax_diff.get_yaxis_transform(), ha="left", va="bottom", fontsize=8, color="grey"
    )
    top = max([float(np.nanmax(r[np.isfinite(r)])) for r in rels.values() if np.isfinite(r).any()] + [floor])
    if len(seeds) > 1 and np.isfinite(between).any():
        top = max(top, float(np.nanmax(between)))
    ax_diff.set_ylim(floor / 3, max(top, tol or 0.0) * 100)  # room above the curves for the text
    if tol is not None:
        ax_diff.axhline(tol, color="tab:red", ls=":", lw=1.2, label=f"{s['precision']} tolerance")
    ax_diff.set(
        xlabel="step",
        ylabel=f"|{cand} - {ref}| / |{ref}|",
        title=f"training-loss difference per step (running median of {window})"
        if window > 1
        else "training-loss difference per step",
    )
    ax_diff.text(
        0.02,
        0.96,
        f"max |diff| / |{ref}| = {s['max_rel_diff']:.3g}"
        + ("" if tol is None else f" ({'under' if s['agree'] else 'ABOVE'} {tol:g})"),
        transform=ax_diff.transAxes,
        fontsize=9,
        va="top",
        bbox={"facecolor": "white", "alpha": 0.8, "lw": 0},
    )
    ax_diff.legend(fontsize=8, ncol=2, loc="center right")


def _speed_panel(ax_speed: Any, pairs: dict[int, dict[str, Run]], seeds: list[int], s: dict[str, Any]) -> None:
    """(d) Throughput of the timed intervals, all seeds pooled."""
    data, labels = [], []
    modes = arms(s)
    for mode in modes:
        sps = np.concatenate([pairs[sd][mode].timed_intervals()[1] for sd in seeds])
        data.append(sps if len(sps) else np.array([np.nan]))
        labels.append(mode)
    box = ax_speed.boxplot(data, showfliers=False, patch_artist=True, widths=0.5, medianprops={"color": "black"})
    ax_speed.set_xticks([1, 2], labels)
    for i, patch in enumerate(box["boxes"]):
        patch.set_facecolor(COLORS[i])
        patch.set_alpha(0.5)
    for i, mode in enumerate(modes, start=1):
        m = s["modes"][mode]
        if m["samples_per_s"] is not None:
            ax_speed.text(
                i + 0.3,
                m["samples_per_s"],
                f"median\n{m['samples_per_s']:,.0f}/s\n{m['step_time_ms']:.3g} ms/step",
                fontsize=9,
                va="center",
            )
    speed = f"speedup {s['speedup']:.2f}x ({modes[1]} / {modes[0]} step time)" if s["speedup"] else "no timed intervals"
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
