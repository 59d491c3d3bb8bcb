"""Helpers of the GPU tests (marked ``gpu``): CuPy where it exists, random data, tolerances, GPU trainers."""

from __future__ import annotations

from typing import Any

import numpy as np

from mlptrain.base.backend import probe_gpu

HAS_GPU = probe_gpu()[0]
if HAS_GPU:  # imported only where it exists: the modules are collected everywhere
    import cupy as cp
else:
    cp = None

DTYPES = ["float32", "float16", "bfloat16"]
TOL = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 6e-2}


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def rand(rng: np.random.Generator, shape: tuple, name: str, order: str = "C") -> np.ndarray:
    a = rng.standard_normal(shape).astype(np.float32)
    return np.asarray(a.astype(np_dtype(name)), order=order)


def f64(a: Any) -> np.ndarray:
    return np.asarray(cp.asnumpy(a) if cp is not None and isinstance(a, cp.ndarray) else a).astype(np.float64)


def close(actual: Any, expected: Any, name: str, what: str) -> None:
    """Max error relative to max |expected|, within the tolerance of dtype ``name``."""
    actual, expected = f64(actual), f64(expected)
    scale = max(np.abs(expected).max(), 1e-6)
    err = np.abs(actual - expected).max() / scale
    assert err < TOL[name], f"{what}: max error {err:.3g} relative to max |ref| {scale:.3g}"


def gpu_trainer(**overrides: Any) -> Any:
    """A Trainer on the GPU for digits; ``{"a.b": v}`` sets ``cfg.a.b`` (enum fields from their values)."""
    from mlptrain.config.schema import TrainConfig
    from mlptrain.step.trainer import Trainer

    cfg = TrainConfig()
    cfg.device = type(cfg.device)("gpu")
    cfg.progress = False
    for key, value in overrides.items():
        obj = cfg
        *path, last = key.split(".")
        for p in path:
            obj = getattr(obj, p)
        field_type = type(getattr(obj, last))
        setattr(obj, last, field_type(value) if hasattr(field_type, "__members__") else value)
    return Trainer(cfg)


def train_losses(tr: Any, steps: int) -> np.ndarray:
    """Per-step losses of ``steps`` steps of ``tr`` over its epochs (host floats: a sync per step)."""
    losses = []
    for epoch in range(100):
        for x, y in tr.train_loader.epoch(epoch):
            loss, _ = tr.step(x, y)
            losses.append(float(loss))
            if len(losses) == steps:
                return np.array(losses)
    return np.array(losses)


def graph_run(graph: bool, steps: int, buffers: bool = True, **overrides: Any) -> tuple[Any, np.ndarray]:
    """``steps`` steps of a digits trainer (batch 64, Adam) on a non-default stream, as the training loop runs them."""
    tr = gpu_trainer(
        **{
            "data.batch_size": 64,
            "optimizer.name": "adam",
            "optimizer.lr": 1e-3,
            "epochs": 4,
            "execution.bgrad": "bgradb",  # not "auto": both runs must make the same (measured) choice
            "graph": graph,
            **overrides,
        }
    )
    losses = []
    with cp.cuda.Stream(non_blocking=True):
        for epoch in range(4):
            # buffers: gathered into the graph's inputs, as the training loop does; else copied in
            for x, y in tr.train_loader.epoch(epoch, out=tr.batch_buffers if buffers else None):
                losses.append(tr.step(x, y)[0].copy())  # a replayed graph rewrites the same loss array
                if len(losses) == steps:
                    break
            if len(losses) == steps:
                break
        cp.cuda.get_current_stream().synchronize()
    return tr, np.array([float(v) for v in losses])
