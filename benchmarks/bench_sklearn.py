"""mlptrain.sklearn against scikit-learn's own MLP on datasets scikit-learn ships: accuracy (R^2) and time.

    python benchmarks/bench_sklearn.py                       # CPU, seeds 0 1 2, a markdown table on stdout
    python benchmarks/bench_sklearn.py --device gpu --out docs/bench/sklearn-gpu.md

Both estimators get scikit-learn's defaults (one hidden layer of 100, ReLU, Adam at 1e-3, batches of
200, up to 200 epochs, the same ``tol`` and ``n_iter_no_change``) and the same ``random_state``, on
the same 75/25 split (``train_test_split(random_state=seed)``). scikit-learn's MLP gets its
features through a ``StandardScaler`` (it does not normalise); mlptrain's takes the raw rows (it
standardises with the train split's statistics itself). The regression (diabetes, targets 25-346)
standardises the targets for both (``TransformedTargetRegressor``): neither MLP scales them. Fit
and predict times are wall-clock medians over the seeds; BLAS runs on ``--blas-threads`` threads
(1 by default: on a shared 2-core machine more threads only contend).

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sklearn.compose import TransformedTargetRegressor
from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier as SkClassifier
from sklearn.neural_network import MLPRegressor as SkRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from mlptrain.sklearn import MLPClassifier, MLPRegressor

DATASETS: dict[str, tuple[Callable[..., Any], str]] = {
    "digits": (load_digits, "classification"),
    "breast_cancer": (load_breast_cancer, "classification"),
    "diabetes": (load_diabetes, "regression"),
}


def estimators(task: str, seed: int, device: str) -> dict[str, Any]:
    """``{name: estimator}``: scikit-learn's MLP (standardised features) and mlptrain's (raw rows)."""
    if task == "classification":
        return {
            "scikit-learn": make_pipeline(StandardScaler(), SkClassifier(random_state=seed)),
            "mlptrain": MLPClassifier(random_state=seed, device=device),
        }
    scaled = lambda est: TransformedTargetRegressor(est, transformer=StandardScaler())
    return {
        "scikit-learn": scaled(make_pipeline(StandardScaler(), SkRegressor(random_state=seed))),
        "mlptrain": scaled(MLPRegressor(random_state=seed, device=device)),
    }


def epochs(est: Any) -> int:
    """``n_iter_`` of the MLP inside a pipeline or a target transformer."""
    est = getattr(est, "regressor_", est)
    return int(est[-1].n_iter_ if hasattr(est, "steps") else est.n_iter_)


def measure(name: str, seeds: list[int], device: str) -> list[dict[str, Any]]:
    """One row per estimator: the test score (accuracy or R^2), fit and predict seconds, epochs; medians."""
    loader, task = DATASETS[name]
    x, y = loader(return_X_y=True)
    runs: dict[str, list[tuple[float, float, float, int]]] = {}
    for seed in seeds:
        x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed)
        for who, est in estimators(task, seed, device).items():
            t0 = time.perf_counter()
            est.fit(x_tr, y_tr)
            t1 = time.perf_counter()
            est.predict(x_te)
            t2 = time.perf_counter()
            runs.setdefault(who, []).append((est.score(x_te, y_te), t1 - t0, t2 - t1, epochs(est)))
    rows = []
    for who, got in runs.items():
        score, fit_s, predict_s, n_iter = (statistics.median(v) for v in zip(*got, strict=True))
        spread = f"{min(g[0] for g in got):.3f}-{max(g[0] for g in got):.3f}"
        rows.append(
            {
                "dataset": name,
                "rows": len(x),
                "task": task,
                "who": who,
                "score": score,
                "spread": spread,
                "fit_s": fit_s,
                "predict_s": predict_s,
                "epochs": n_iter,
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| dataset (rows) | estimator | test score (median; min-max) | fit s | predict ms | epochs |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        metric = "accuracy" if r["task"] == "classification" else "R^2"
        lines.append(
            f"| {r['dataset']} ({r['rows']}) | {r['who']} | {metric} {r['score']:.3f}; {r['spread']} | "
            f"{r['fit_s']:.2f} | {r['predict_s'] * 1e3:.1f} | {r['epochs']:g} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu", "auto"), help="mlptrain's device")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    ap.add_argument("--blas-threads", type=int, default=1, help="BLAS threads for both (threadpoolctl)")
    ap.add_argument("--out", type=Path, help="also write the table to this markdown file")
    args = ap.parse_args()
    rows = []
    with threadpool_limits(args.blas_threads), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # both MLPs warn alike when max_iter ends a fit
        for name in args.datasets:
            rows += measure(name, args.seeds, args.device)
    md = table(rows)
    print(md)
    if args.out:
        args.out.write_text(md + "\n")


if __name__ == "__main__":
    main()
