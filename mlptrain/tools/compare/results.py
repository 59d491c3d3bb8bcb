"""``python -m mlptrain.tools.compare.results DIR``: one table of the comparisons under ``DIR`` that vary
something other than the execution mode (``<task>/compare.json``, as ``scripts/compare.sh --suite fp8``
writes them for docs/compare-fp8/), written to ``DIR/results.md`` and printed: per task the final
accuracies, the paired difference with its 95 % interval, whether that interval lies inside half a
point, and the time per step."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mlptrain.tools.compare.arms import arms, equivalence_cell
from mlptrain.tools.compare.axis import CompareError
from mlptrain.tools.compare.report import accuracy_gap, fmt_stat, gap_cell

RESULTS_NAME = "results.md"


def load_tasks(root: Path) -> dict[str, dict[str, Any]]:
    """``{task: compare.json}`` for every ``root/<task>/compare.json``, by name."""
    if not root.is_dir():
        raise CompareError(f"results directory {root} does not exist")
    out = {}
    for path in sorted(root.glob("*/compare.json")):
        try:
            out[path.parent.name] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise CompareError(f"{path} is not a compare.json of mlptrain.compare ({exc})") from None
    if not out:
        raise CompareError(f"no comparisons in {root}: expected <task>/compare.json files")
    return out


def _ms(m: dict[str, Any]) -> str:
    return "n/a" if m.get("step_time_ms") is None else f"{m['step_time_ms']:.4g}"


def results_markdown(tasks: dict[str, dict[str, Any]], made_by: str | None = None) -> str:
    """The table of ``tasks``: one row each, the candidate's and the reference's numbers side by side."""
    first = next(iter(tasks.values()))
    cand, ref = arms(first)
    lines = [
        f"| task | model | steps x seeds | final test accuracy, {cand} | {ref} | {cand} - {ref}, paired by seed "
        f"(95 % interval) | interval inside ± 0.5 points | largest relative loss difference | ms per step, {cand} "
        f"| {ref} | speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in tasks.items():
        if tuple(arms(s)) != (cand, ref):
            raise CompareError(f"task {name} compares {' and '.join(arms(s))}, the others {cand} and {ref}")
        m = s["modes"]
        widths = "-".join(map(str, s.get("widths") or []))
        speedup = "n/a" if s.get("speedup") is None else f"{s['speedup']:.2f}x"
        lines.append(
            f"| [{name}]({name}/compare.md) | {s['dataset']} {widths}, batch {s['batch_size']} "
            f"| {s['steps']} x {len(s['seeds'])} | {fmt_stat(m[cand].get('test/acc'), '.2f', 100, '%')} "
            f"| {fmt_stat(m[ref].get('test/acc'), '.2f', 100, '%')} | {gap_cell(accuracy_gap(s))} "
            f"| {equivalence_cell(s)} | {s['max_rel_diff']:.3g} | {_ms(m[cand])} | {_ms(m[ref])} | {speedup} |"
        )
    lines += [
        "",
        f"Device: {first.get('device')}; seeds {', '.join(map(str, first['seeds']))}. Accuracy: mean ± std over the "
        f"seeds of the last epoch's test accuracy; paired: the mean over seeds of {cand} minus {ref}, ± the half-width "
        "of its 95 % interval (Student's t, n - 1 degrees of freedom); speedup: the reference's median time per "
        "step over the candidate's.",
    ]
    if made_by:
        lines += ["", "Made by:", "", "```", made_by, "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The table of the comparisons under DIR (DIR/results.md).")
    parser.add_argument("dir", type=Path, help="a folder of <task>/compare.json (docs/compare-fp8)")
    parser.add_argument("--made-by", default=None, help="the command that made the comparisons")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        text = results_markdown(load_tasks(args.dir), args.made_by)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    (args.dir / RESULTS_NAME).write_text(text, encoding="utf-8")
    print(f"wrote {args.dir / RESULTS_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
