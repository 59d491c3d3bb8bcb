"""Many models in one run against the same models as separate runs: an ensemble and a K-fold cross-validation.

    python benchmarks/bench_ensemble.py                       # CPU, a markdown table on stdout
    python benchmarks/bench_ensemble.py --members 8 --folds 5 --epochs 30

On scikit-learn's bundled tables (digits: 1797 rows, 64 features, 10 classes; breast_cancer: 569 rows,
30 features, 2 classes), each split 80/20 into train and test (seeded), a 64-64 ReLU MLP with SGD:

* ``ensemble.size=M`` in one run against ``M`` runs of seeds ``0..M-1`` (member k *is* the run of seed k,
  bit for bit on the CPU, so the members' accuracies are those runs'): wall clock of :func:`mlptrain.run.run.train`
  in this process (each separate run pays its own set-up, as a separate run does), the ensemble's test accuracy
  and the members' median.
* ``ensemble.folds=K`` in one run against ``K`` runs, run ``k`` trained on the pool (train + val) less fold
  ``k`` and validated on fold ``k`` (the same stratified folds): wall clock, and each fold's best validation
  accuracy, mean and spread.

Wall clock is the whole ``train()`` call (data, build, epochs, evaluation, checkpoints), BLAS on one thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.datasets import load_breast_cancer, load_digits
from threadpoolctl import threadpool_limits

from mlptrain.config.schema import Device, TrainConfig
from mlptrain.data import Dataset, stratified_folds
from mlptrain.run.run import train

TABLES = {"digits": load_digits, "breast_cancer": load_breast_cancer}


def table(name: str, seed: int = 0) -> Dataset:
    """The table split 80/20 into train and test (stratified enough at these sizes), with no validation rows."""
    x, y = TABLES[name](return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.8 * len(y))
    tr, te = order[:cut], order[cut:]
    empty = np.zeros((0, x.shape[1]))
    classes = int(y.max()) + 1
    return Dataset(name, x[tr], y[tr].astype(np.int64), empty, np.zeros(0, np.int64), x[te], y[te], classes)


def config(epochs: int, **ensemble: Any) -> TrainConfig:
    cfg = TrainConfig()
    cfg.device, cfg.progress, cfg.epochs = Device.cpu, False, epochs
    cfg.model.hidden = [64, 64]
    cfg.data.batch_size, cfg.data.val_fraction = 64, 0.0
    for key, value in ensemble.items():
        setattr(cfg.ensemble, key, value)
    return cfg


def timed(cfg: TrainConfig, data: Dataset, out: Path) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    summary = train(cfg, out, data)
    return time.perf_counter() - start, summary


def ensemble_rows(name: str, members: int, epochs: int, tmp: Path) -> list[str]:
    data = table(name)
    together_s, together = timed(config(epochs, size=members), data, tmp / f"{name}-ensemble")
    alone_s, alone = 0.0, []
    for k in range(members):
        cfg = config(epochs)
        cfg.seed = k
        s, summary = timed(cfg, data, tmp / f"{name}-seed{k}")
        alone_s, alone = alone_s + s, [*alone, summary["test/acc"]]
    mine = [together[f"member{k}/test/acc"] for k in range(members)]
    assert mine == alone, (mine, alone)  # member k is the run of seed k
    return [
        f"| {name} | ensemble.size={members} | {together_s:.2f} s | {alone_s:.2f} s ({members} runs) | "
        f"{alone_s / together_s:.2f}x | ensemble {together['test/acc']:.4f}, median member "
        f"{statistics.median(alone):.4f} (min {min(alone):.4f}, max {max(alone):.4f}) |"
    ]


def fold_rows(name: str, folds: int, epochs: int, tmp: Path) -> list[str]:
    data = table(name)
    together_s, _ = timed(config(epochs, folds=folds), data, tmp / f"{name}-cv")
    report = json.loads((tmp / f"{name}-cv" / "folds.json").read_text())
    fold = stratified_folds(data.y_train, folds, np.random.default_rng(0))  # the run's folds (seed 0, no val rows)
    alone_s, alone = 0.0, []
    for k in range(folds):
        keep, held = fold != k, fold == k
        split = Dataset(
            name,
            data.x_train[keep],
            data.y_train[keep],
            data.x_train[held],
            data.y_train[held],
            data.x_test,
            data.y_test,
            data.num_classes,
        )  # the run's fold k held out
        cfg = config(epochs)
        cfg.seed = k
        s, summary = timed(cfg, split, tmp / f"{name}-fold{k}")
        alone_s, alone = alone_s + s, [*alone, summary["best"]["value"]]
    ours = [f["value"] for f in report["folds"]]
    return [
        f"| {name} | ensemble.folds={folds} | {together_s:.2f} s | {alone_s:.2f} s ({folds} runs) | "
        f"{alone_s / together_s:.2f}x | folds {np.mean(ours):.4f} +- {np.std(ours):.4f} in one run, "
        f"{np.mean(alone):.4f} +- {np.std(alone):.4f} as separate runs (folds {_values(ours)}; {_values(alone)}) |"
    ]


def _values(xs: list[float]) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=30)
    args = ap.parse_args()
    rows = [
        "| table | one run | time, one run | time, separate runs | speed-up | accuracy (ensemble: test; folds: best) |",
        "|---|---|---|---|---|---|",
    ]
    with threadpool_limits(1), tempfile.TemporaryDirectory() as tmp:
        for name in TABLES:
            rows += ensemble_rows(name, args.members, args.epochs, Path(tmp))
            rows += fold_rows(name, args.folds, args.epochs, Path(tmp))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
