"""Helpers shared by the tests of runs (checkpoints, reliability): a small config, metrics records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.config.schema import Device, TrainConfig
from mlptrain.run.metrics import read_metrics
from mlptrain.step.precision import Precision

# Keys of metrics records that measure time, and so differ between any two runs.
TIMING = ("samples_per_s", "step_time_ms", "time_s", "wall_s")


def make_cfg(**overrides: Any) -> TrainConfig:
    """A small, quick CPU run: digits, 64-32-10, 3 epochs of 21 steps; ``a__b=v`` sets ``a.b``."""
    cfg = TrainConfig()
    cfg.device = Device.cpu
    cfg.progress = False
    cfg.model.hidden = [32]
    cfg.epochs = 3
    for key, value in overrides.items():
        obj = cfg
        *path, last = key.split("__")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, value)
    return cfg


def records(run_dir: Path) -> list[dict[str, Any]]:
    """``metrics.jsonl`` of a run without the timing keys."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run_dir / "metrics.jsonl")]


FP16 = {"precision__name": "fp16"}  # make_cfg(**FP16, ...) with emulate_fp16


def emulate_fp16(monkeypatch: Any) -> None:
    """Run precision=fp16 on the CPU: float16 GEMMs, float32 master weights, dynamic loss scaling.

    Configs say ``precision=fp16`` (``make_cfg(**FP16)``), so that its loss-scaling settings count as used.

    The NumPy engine computes float16 GEMMs in float32 and rounds once, so the whole fp16 path
    (loss scaling, skipped steps, master and compute copies) runs without a GPU.
    """
    from mlptrain.step import build

    fp16 = Precision("fp16", np.float32, np.float16, loss_scaling=True)
    monkeypatch.setattr(build, "get_precision", lambda name, backend: fp16)
