"""Timing helpers of the prediction benchmark (``benchmarks/bench_predict.py``): a random checkpoint,
CUDA events on a stream, and the forward GEMMs' floor."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mlptrain.base.backend import get_backend
from mlptrain.run import checkpoint

if TYPE_CHECKING:
    from mlptrain.inference.predictor import Predictor


def random_checkpoint(widths: list[int], precision: str, seed: int = 0) -> checkpoint.Checkpoint:
    """A checkpoint of random He-initialised weights and a random normalisation (nothing trained)."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for i in range(len(widths) - 1):
        fan_in = widths[i]
        w = rng.standard_normal((widths[i + 1], fan_in)) * np.sqrt(2.0 / fan_in)
        arrays[f"param/layer{i}.weight"] = w.astype(np.float32)
        arrays[f"param/layer{i}.bias"] = (0.1 * rng.standard_normal(widths[i + 1])).astype(np.float32)
    arrays["data/shift"] = rng.standard_normal(widths[0])
    arrays["data/scale"] = rng.uniform(0.5, 2.0, widths[0])
    meta = {
        "format_version": checkpoint.FORMAT_VERSION,
        "mlptrain": "bench",
        "widths": widths,
        "precision": precision,
        "config": {"model": {"activation": "relu"}},
        "data": {"task": "classification", "feature_names": None, "class_names": None, "target_names": None},
    }
    return checkpoint.Checkpoint(Path(f"random-{'-'.join(map(str, widths))}.npz"), arrays, meta)


def time_passes(fn, stream_events, reps: int) -> list[float]:
    """Seconds of ``fn()`` per call, by CUDA events on its stream, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start, end, elapsed = stream_events()
        start()
        fn()
        end()
        times.append(elapsed())
    return times


def cupy_events(stream):
    cp = get_backend("gpu").xp

    def make():
        a, b = cp.cuda.Event(), cp.cuda.Event()
        return (
            (lambda: a.record(stream)),
            (lambda: (b.record(stream), b.synchronize())),
            (lambda: cp.cuda.get_elapsed_time(a, b) / 1e3),
        )

    return make


def forward_floor(p: Predictor, xb, batch: int, chain: int = 20) -> dict:
    """The forward GEMMs alone (RELU_BIAS ... BIAS, no normalisation, no argmax): the floor per batch."""
    cp = get_backend("gpu").xp

    xc = xb.astype(p.precision.compute_dtype)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(3):
            p.model.forward(xc, keep=False)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(chain):
            p.model.forward(xc, keep=False)
        end.record(stream)
        end.synchronize()
    s = cp.cuda.get_elapsed_time(start, end) / 1e3 / chain
    return {"s_per_batch": s, "rows_per_s": batch / s}
