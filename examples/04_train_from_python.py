"""04: a training run from Python: a config, ``mlptrain.train``, and its checkpoint scoring new rows.

``mlptrain.train(cfg, out_dir)`` is what ``python -m mlptrain`` runs: it writes ``run.json``,
``metrics.jsonl`` (a record per log interval and per epoch) and ``checkpoints/{best,last}.npz`` into
``out_dir`` and returns the summary record. A checkpoint holds the model and its preprocessing, so
``mlptrain.predict(ckpt, x)`` takes raw rows.

    python examples/04_train_from_python.py [--device cpu|gpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

import mlptrain
from mlptrain.config.schema import Device, TrainConfig
from mlptrain.data.sources import DIGITS_PATH

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
parser.add_argument("--out", type=Path, default=None, help="the run directory (default: a temporary one)")
args = parser.parse_args()
out = args.out or Path(tempfile.mkdtemp(prefix="mlptrain-example-")) / "run"

# Every setting of `python -m mlptrain --help` is a field of TrainConfig (mlptrain/config.py).
cfg = TrainConfig()  # data: digits (1,797 8x8 images, shipped with mlptrain); model 64-128-128-10
cfg.device = Device(args.device)
cfg.epochs = 10
cfg.progress = False  # no progress bars: this script prints its own lines
summary = mlptrain.train(cfg, out)
print(f"trained {summary['epochs']} epochs, {summary['steps']} steps: test accuracy {summary['test/acc']:.4f}")

# metrics.jsonl: one JSON record per line; "kind" says which (interval, epoch, summary).
records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
epochs = [r for r in records if r["kind"] == "epoch"]
print("val accuracy by epoch:", " ".join(f"{r['val/acc']:.3f}" for r in epochs))
assert epochs[-1]["train/loss"] < epochs[0]["train/loss"], "the training loss should go down"

# The best checkpoint (by val/acc) scores raw rows: the features as the file holds them (pixel values 0-16).
table = np.loadtxt(DIGITS_PATH, delimiter=",")  # (1797, 65), no header: 64 pixels, then the label
x, y = table[:, :-1], table[:, -1].astype(int)
ckpt = out / "checkpoints" / "best.npz"
pred = mlptrain.predict(ckpt, x[:200])  # (200,) class ids
proba = mlptrain.predict(ckpt, x[:200], probabilities=True)  # (200, 10)
assert pred.shape == (200,) and proba.shape == (200, 10)
assert np.array_equal(pred, proba.argmax(1)) and np.allclose(proba.sum(1), 1, atol=1e-5)
acc = float((pred == y[:200]).mean())
print(f"{ckpt.name} on 200 raw rows: accuracy {acc:.3f} (rows the run trained on among them)")
assert acc > 0.9, acc
print(f"04: the run is in {out}")
