"""The index of several comparisons (one folder each, ``<panel>/compare.json`` and, for the speed task,
``<panel>/speed/compare.json``): ``<DIR>/README.md`` with the recipes, a table of accuracies and one
of times per step with a row per panel, how fused and naive differ (:data:`DIFFERENCES`), and each
panel's figure (:func:`write_index`)."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlptrain.tools.compare.differences import DIFFERENCES
from mlptrain.tools.compare.report import COMMAND, accuracy_gap, first_step_above, fmt_stat, gap_cell, verdict_cell
from mlptrain.tools.compare.runs import MODES, CompareError

INDEX_NAME = "README.md"
ACTIVATION_ORDER = ("relu", "gelu", "none")
PRECISION_ORDER = ("fp64", "fp32", "tf32", "fp16", "bf16")


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
        raise CompareError(f"{path} is not a compare.json of mlptrain.compare ({type(exc).__name__}: {exc})") from None
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
            f"no comparisons in {root}: expected <panel>/compare.json files ({COMMAND} SWEEP --out {root}/<panel>)"
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
        acc = [fmt_stat(s["modes"][m].get("test/acc"), ".2f", 100, "%") for m in MODES]
        first_1 = first_step_above(s, 1e-2)
        parted = "n/a" if first_1 is None else ("never" if first_1["step"] is None else str(first_1["step"]))
        lines.append(
            f"| [{p.name}]({p.name}/compare.md) | {s.get('activation', 'relu')} | {s['precision']} "
            f"| {acc[0]} | {acc[1]} "
            f"| {gap_cell(gap)} | {verdict_cell(gap)} | {parted} "
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
