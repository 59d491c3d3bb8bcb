"""``python -m mlptrain.compare``: a sweep's report (compare.png, compare.md, compare.json), or the
index of several comparisons (``--index DIR``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mlptrain.base.fs import json_ready
from mlptrain.tools.compare.arms import arms
from mlptrain.tools.compare.figure import plot
from mlptrain.tools.compare.index import write_index
from mlptrain.tools.compare.report import commands, verdict, write_markdown
from mlptrain.tools.compare.runs import CompareError, load_runs
from mlptrain.tools.compare.summary import summarize


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description="Compare the two arms of a comparison sweep: fused and naive (`make compare`), fp8 and bf16 "
        "(conf/compare_fp8.yaml), or the two values of another config key."
    )
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
    parser.add_argument(
        "--axis",
        default=None,
        metavar="KEY[=A,B]",
        help="the config key the two arms differ in (precision, execution.mode, optimizer.lr), optionally with its "
        "values, candidate first (precision=fp8,bf16); default: the one key besides the seed the runs differ in",
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
        if args.out is not None or args.axis is not None:
            parser.error("--out and --axis apply to a sweep, not to --index")
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
        pairs = load_runs(args.sweep_dir, args.axis)
        s = summarize(pairs)
        out.mkdir(parents=True, exist_ok=True)
        plot(pairs, s, out / "compare.png")
        made_by = commands(args.sweep_dir, argv)
        write_markdown(s, out / "compare.md", made_by)
        (out / "compare.json").write_text(
            json.dumps(json_ready({**s, "commands": made_by}), indent=2, allow_nan=False) + "\n", encoding="utf-8"
        )
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(verdict(s))
    cand, ref = arms(s)
    if s["speedup"] is not None:
        print(f"speedup ({ref} / {cand} median time per step): {s['speedup']:.2f}x on {s['device']}")
    print(f"wrote {out / 'compare.png'}, {out / 'compare.md'}, {out / 'compare.json'}")
    return 0
