"""One-hot against learned embeddings (``model.embedding_dim``) for categorical columns with many levels (#49).

    python benchmarks/bench_embeddings.py --out docs/bench                  # CPU, seeds 0 1 2
    python benchmarks/bench_embeddings.py --tables products --seeds 0 --variants one-hot d=8
    python benchmarks/bench_embeddings.py --tables --others --stem bench-embeddings-cpu-others --out docs/bench

Each table is written as ``train.csv`` and ``test.csv`` (raw cells) and trained through the command line at
``data=file``'s defaults, with nothing but the files, ``data.target``, ``data.drop``, a regression's
``data.task=regression`` and the variant's settings; ``python -m mlptrain predict`` scores the raw test rows
(through the folded network), compared here with the test file's target. Per variant: the median over the
seeds of the test accuracy / balanced accuracy (RMSE for a regression), of the epochs run and of the seconds
per epoch (the run's training wall time over its epochs); beside them scikit-learn's usual pipeline (one-hot) in
front of its MLP (128, 128), bench_tables.py's reference.

The tables: :data:`mlptrain.tools.bench.tables.MANY_LEVELS` (a product id of 1,000 levels, a zip code of 800,
Zipf frequencies), and with ``--others`` those of ``benchmarks/bench_tables.py`` that have text columns (at most
20 levels each: at the default ``model.embedding_min_levels`` nothing of theirs is embedded, so they are
measured with ``model.embedding_min_levels=8``, which embeds what they have).

Run from the repository's root with ``PYTHONPATH=.``; pandas and scikit-learn (and palmerpenguins for its
table) must be installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import record
from sklearn.compose import ColumnTransformer, TransformedTargetRegressor
from sklearn.impute import SimpleImputer
from sklearn.metrics import accuracy_score, balanced_accuracy_score, root_mean_squared_error
from sklearn.neural_network import MLPClassifier, MLPRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler

from mlptrain.tools.bench.tables import MANY_LEVELS, TABLES, Table

REPO = Path(__file__).resolve().parent.parent
OTHERS = ["penguins", "customers", "houses", "fraud", "churn"]  # bench_tables.py's tables with text columns


def embedded(dim: int, least: int = 64) -> list[str]:
    return [f"model.embedding_dim={dim}", f"model.embedding_min_levels={least}"]


VARIANTS: dict[str, list[str]] = {
    "one-hot": [],
    "d=4": embedded(4),
    "d=8": embedded(8),
    "d=16": embedded(16),
    "d=32": embedded(32),
    "d=128": embedded(128),  # hidden[0]: no narrower than one-hot's first layer
    "d=8, min_levels=8": embedded(8, 8),  # the table's smaller text columns too
    "d=16, min_levels=8": embedded(16, 8),
}
OTHER_VARIANTS: dict[str, list[str]] = {
    "one-hot": [],
    "d=8, min_levels=8": embedded(8, 8),
    "d=16, min_levels=8": embedded(16, 8),
}


def cli(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "mlptrain", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m mlptrain {' '.join(args)} failed:\n{proc.stderr[-3000:]}")


def run(table: Table, folder: Path, seed: int, name: str, settings: list[str]) -> dict[str, Any]:
    """Train one variant at one seed, predict the raw test rows, score them."""
    out = folder / f"run-{''.join(c if c.isalnum() else '-' for c in name)}-{seed}"
    shutil.rmtree(out, ignore_errors=True)
    args = ["data=file", f"data.path={folder / 'train.csv'}", f"data.test_path={folder / 'test.csv'}"]
    args += [f"data.target={table.target}", *([f"data.drop=[{','.join(table.drop)}]"] if table.drop else [])]
    args += ["data.task=regression"] if table.task == "regression" else []
    args += [f"data.categorical=[{','.join(table.categorical)}]"] if table.categorical else []
    t0 = time.perf_counter()
    cli(*args, *settings, "device=cpu", "progress=false", f"seed={seed}", f"hydra.run.dir={out}")
    fit_s = time.perf_counter() - t0
    cli("predict", f"ckpt={out}", f"input={folder / 'test.csv'}", f"output={out / 'predictions.csv'}", "device=cpu")
    summary = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    predicted = pd.read_csv(out / "predictions.csv", dtype=str, keep_default_na=False)
    if table.task == "regression":
        scores = score(table, predicted[next(c for c in predicted.columns if c != "row")])
    else:
        scores = score(table, predicted["class_name"].to_numpy())
    epochs = summary["epochs"]
    return {**scores, "epochs": epochs, "s_per_epoch": summary["wall_s"] / epochs, "fit_s": fit_s}


def score(table: Table, got: Any) -> dict[str, float]:
    truth = table.test[table.target]
    if table.task == "regression":
        return {"rmse": float(root_mean_squared_error(truth, got.astype(float)))}
    want = truth.astype(str).to_numpy()
    return {"acc": float(accuracy_score(want, got)), "balanced_acc": float(balanced_accuracy_score(want, got))}


def sklearn_mlp(table: Table, seed: int) -> dict[str, Any]:
    """bench_tables.py's reference, one-hot: scikit-learn's usual pipeline in front of an MLP (128, 128) with early
    stopping (a regression's target standardised)."""
    feats = [c for c in table.train.columns if c != table.target and c not in table.drop]
    text = [c for c in feats if not pd.api.types.is_numeric_dtype(table.train[c]) or c in table.categorical]
    num = make_pipeline(SimpleImputer(strategy="median", add_indicator=True), StandardScaler())
    cat = make_pipeline(
        SimpleImputer(strategy="constant", fill_value="<empty>"), OneHotEncoder(handle_unknown="ignore")
    )
    pre = ColumnTransformer([("num", num, [c for c in feats if c not in text]), ("cat", cat, text)])
    kw = {"hidden_layer_sizes": (128, 128), "early_stopping": True, "random_state": seed}
    if table.task == "regression":
        model: Any = TransformedTargetRegressor(make_pipeline(pre, MLPRegressor(**kw)), transformer=StandardScaler())
    else:
        model = make_pipeline(pre, MLPClassifier(**kw))
    y = table.train[table.target]
    t0 = time.perf_counter()
    x_train, x_test = (f[feats].astype({c: str for c in text}) for f in (table.train, table.test))
    model.fit(x_train, y.astype(float) if table.task == "regression" else y.astype(str))
    fit_s = time.perf_counter() - t0
    epochs = int(model.regressor_[-1].n_iter_ if table.task == "regression" else model[-1].n_iter_)
    return {**score(table, model.predict(x_test)), "epochs": epochs, "s_per_epoch": fit_s / epochs}


def measure(table: Table, seeds: list[int], work: Path, variants: dict[str, list[str]], sklearn: bool) -> dict:
    folder = work / table.name
    folder.mkdir(parents=True, exist_ok=True)
    table.train.to_csv(folder / "train.csv", index=False)
    table.test.to_csv(folder / "test.csv", index=False)
    table.train, table.test = (pd.read_csv(folder / f"{s}.csv") for s in ("train", "test"))  # as pandas reads them
    results = {}
    for name, settings in variants.items():
        runs = [run(table, folder, s, name, settings) for s in seeds]
        results[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"runs": runs}
        print(f"{table.name} {name}: {results[name]}", file=sys.stderr, flush=True)
    if sklearn:
        runs = [sklearn_mlp(table, s) for s in seeds]
        results["scikit-learn MLP, one-hot"] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"table": table.name, "task": table.task, "rows": table.rows, "what": table.what, "results": results}


def cell(r: dict[str, Any], task: str) -> str:
    score = f"RMSE {r['rmse']:.4g}" if task == "regression" else f"{r['acc']:.3f} / {r['balanced_acc']:.3f}"
    return f"{score} ({r['epochs']:g} ep, {r['s_per_epoch']:.3f} s/ep)"


def markdown(rows: list[dict[str, Any]], stamp: dict[str, Any]) -> str:
    lines = [
        f"# One-hot against learned embeddings ({stamp['date']}, {stamp['device']})",
        "",
        f"`{stamp['command']}` (tree {stamp['commit']}; {stamp['stack']}). Median of seeds {stamp['seeds']}; "
        "classification: test accuracy / balanced accuracy, regression: test RMSE; the medians of the epochs run "
        "(early stopping) and of the seconds per epoch.",
        "",
    ]
    for r in rows:
        lines += [f"**{r['table']}** ({r['rows']} rows; {r['what']})", "", "| variant | score (epochs, s/epoch) |"]
        lines += ["|---|---|"] + [f"| {n} | {cell(v, r['task'])} |" for n, v in r["results"].items()] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tables", nargs="*", default=list(MANY_LEVELS), choices=list(MANY_LEVELS), help="none: --others only"
    )
    ap.add_argument("--others", action="store_true", help="also bench_tables.py's tables with text columns")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", type=Path, help="where the CSVs and runs go (default: a temporary folder)")
    ap.add_argument("--out", type=Path, help="write <stem>.md and .json here")
    ap.add_argument("--stem", default="bench-embeddings-cpu", help="the files' name (default: bench-embeddings-cpu)")
    args = ap.parse_args(argv)
    versions = record.versions("numpy", "sklearn", "pandas", "hydra")
    stamp = {
        "date": record.today(),
        "command": record.command(argv),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "device": "CPU",
        "seeds": args.seeds,
        "stack": ", ".join(f"{k} {v}" for k, v in versions.items()),
    }
    chosen = {n: VARIANTS[n] for n in args.variants}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        rows += [measure(MANY_LEVELS[n](), args.seeds, work, chosen, True) for n in args.tables]
        if args.others:
            rows += [measure(TABLES[n](), args.seeds, work, OTHER_VARIANTS, False) for n in OTHERS]
    md = markdown(rows, stamp)
    if args.out:
        record.write(args.out, args.stem, {**stamp, "tables": rows}, md)
    else:
        print(md, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
