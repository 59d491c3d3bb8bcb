"""One comparison's report: its title and verdict, the table as markdown (compare.md), and the
commands that made it."""

from __future__ import annotations

import datetime
import math
import re
import shlex
from pathlib import Path
from typing import Any

from mlptrain.tools.compare.arms import (
    arms,
    axis_name,
    equivalence_row,
    other_axis_note,
    other_axis_verdict,
    short_names,
)
from mlptrain.tools.compare.stats import paired_difference

# The largest relative rounding error of one rounding to each precision's GEMM format (TF32 rounds
# the inputs to 11 significant bits, fp16 the outputs to 11, bf16 to 8).
UNIT_ROUNDOFF = {"fp64": 2.0**-53, "fp32": 2.0**-24, "tf32": 2.0**-11, "fp16": 2.0**-11, "bf16": 2.0**-8}
# The command of this report, as the reports record it.
COMMAND = "python -m mlptrain.compare"


def title(s: dict[str, Any]) -> str:
    widths = "-".join(map(str, s["widths"] or []))
    n = len(s["seeds"])
    cand, ref = arms(s)
    precision = "" if axis_name(s) == "precision" else f"{s['precision']}, "
    return (
        f"{cand} vs {ref}: {s['dataset']} {widths} {s.get('activation', 'relu')}, {precision}"
        f"batch {s['batch_size']}, {s['device']}, {n} seed{'s' if n > 1 else ''}"
    )


def verdict(s: dict[str, Any]) -> str:
    """One sentence on whether the curves agree, for the table and the figure."""
    n = f"{s['steps']} steps x {len(s['seeds'])} seed{'s' if len(s['seeds']) > 1 else ''}"
    if axis_name(s) != "execution":
        return other_axis_verdict(s, n)
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


def fmt_stat(stat: dict[str, Any] | None, fmt: str, scale: float = 1.0, unit: str = "") -> str:
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
    lines.append(" ".join([COMMAND, *map(shlex.quote, argv)]))
    return {"ran": lines, "make": make}


def write_markdown(s: dict[str, Any], path: Path, made_by: dict[str, Any], figure: str = "compare.png") -> str:
    """Write the table as markdown to ``path`` and return the text."""
    m = s["modes"]
    n = len(s["seeds"])
    over = f"mean ± std over {n} seeds" if n > 1 else "1 seed"
    cand, ref = arms(s)
    f, r = short_names(s)

    def row(label: str, key: str, fmt: str, scale: float = 1.0, unit: str = "") -> str:
        cells = [fmt_stat(m[mode][key], fmt, scale, unit) for mode in (cand, ref)]
        return f"| {label} | {cells[0]} | {cells[1]} |"

    def timing(key: str, fmt: str) -> str:
        vals = [m[mode][key] for mode in (cand, ref)]
        return " | ".join("n/a" if v is None else f"{v:{fmt}}" for v in vals)

    tol = "not applied (see below)" if s["tolerance"] is None else f"{s['tolerance']:g}"
    speedup = "n/a" if s["speedup"] is None else f"{s['speedup']:.2f}x"
    where = s["max_rel_diff_at"]
    versions = ", ".join(f"{k} {v}" for k, v in {"mlptrain": s["mlptrain"], **s.get("versions", {})}.items())
    at = f" (seed {where['seed']}, step {where['step']})" if s["max_rel_diff"] > 0 and where else ""
    lines = [
        f"# {title(s)}",
        "",
        f"![{cand} vs {ref}]({figure})",
        "",
        f"| {s['precision'] if axis_name(s) != 'precision' else 'precision'}, {s['steps']} steps, "
        f"{s['epochs']} epochs | {cand} | {ref} |",
        "|---|---|---|",
        row(f"final train loss (last-epoch mean; {over})", "train/loss", ".4g"),
        row(f"final test loss ({over})", "test/loss", ".4g"),
        row(f"final test accuracy ({over})", "test/acc", ".2f", 100, "%"),
        *(
            [
                f"| final test accuracy, {cand} - {ref} paired by seed (95 % interval) | {gap_cell(accuracy_gap(s))} "
                f"(no difference at 95 %: {verdict_cell(accuracy_gap(s))}) | |"
            ]
            if n > 1 and accuracy_gap(s) is not None
            else []
        ),
        *equivalence_row(s),
        f"| median time per step (ms) | {timing('step_time_ms', '.4g')} |",
        f"| median samples/s | {timing('samples_per_s', ',.0f')} |",
        "",
        f"| {cand} vs {ref} | |",
        "|---|---|",
        f"| largest relative training-loss difference, max over steps and seeds of abs({f} - {r}) / abs({r}) "
        f"| {s['max_rel_diff']:.3g}{at} |",
        f"| largest absolute training-loss difference | {s['max_abs_diff']:.3g} |",
        f"| first step where the relative difference passes {divergence_header(s)} (earliest seed) "
        f"| {divergence_cells(s)} |",
        f"| tolerance ({s['precision'] if axis_name(s) == 'execution' else f'{cand} vs {ref}'}) | {tol} |",
        f"| verdict | {verdict(s)} |",
        f"| speedup ({ref} / {cand} median time per step) | {speedup} |",
        "",
        f"Time per step is the median over the timed log intervals of all seeds (log_every={s['log_every']}; "
        "the first interval, warm-up, and intervals that cross an epoch boundary are left out).",
    ]
    lines += device_note(s)
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


def accuracy_gap(s: dict[str, Any]) -> dict[str, Any] | None:
    """The paired fused - naive difference of the final test accuracy (:func:`paired_difference`),
    or None where the accuracies are missing (a compare.json of before the field: recomputed from
    the per-seed accuracies, which pair by position as both modes list the same seeds)."""
    paired = (s.get("paired") or {}).get("test/acc")
    if paired is not None:
        return paired
    cand, ref = arms(s)
    f, n = s["modes"][cand].get("test/acc"), s["modes"][ref].get("test/acc")
    if not f or not n:
        return None
    return paired_difference(f["per_seed"], n["per_seed"])


def gap_cell(gap: dict[str, Any] | None) -> str:
    if gap is None or gap.get("mean") is None:
        return "n/a"
    half = "" if gap.get("half_width") is None else f" ± {gap['half_width'] * 100:.2f}"
    return f"{gap['mean'] * 100:+.2f}{half} pp"


def verdict_cell(gap: dict[str, Any] | None) -> str:
    if gap is None or gap.get("mean") is None:
        return "n/a"
    if gap.get("contains_zero") is None:
        return "n/a (1 seed)" if gap.get("n", 0) < 2 else "n/a (no spread over the seeds)"
    return "yes" if gap["contains_zero"] else "NO"


def device_note(s: dict[str, Any]) -> list[str]:
    """The paragraph of compare.md on what the device's numbers mean (CPU, GPU in fp32/fp64, or half precision)."""
    lines: list[str] = []
    if axis_name(s) != "execution":
        lines += ["", other_axis_note(s)]
    elif str(s["device"]).startswith("cpu"):
        lines += [
            "",
            "On the CPU the fused engine is the NumPy epilog contract (`mlptrain/nn/epilogs.py`): it computes what "
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
    return lines
