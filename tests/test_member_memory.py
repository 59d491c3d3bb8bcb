"""An ensemble's memory per member (mlptrain/step/memory.py: member_bytes, member_account) against the arrays of a
CPU ensemble's step, and as run.json reports it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_ensemble import make_cfg

from mlptrain.run.ensemble import EnsembleTrainer
from mlptrain.run.run import train
from mlptrain.step.memory import member_account, member_bytes

K = 3


def nbytes(arrays) -> int:
    return sum(int(a.nbytes) for a in arrays if a is not None)


@pytest.mark.parametrize(
    ("mode", "activation", "optimizer", "precision"),
    [("fused", "relu", "adam", "fp32"), ("naive", "relu", "sgd", "fp32"), ("fused", "gelu", "sgd", "fp64")],
)
def test_one_members_bytes_are_the_ensembles_arrays_over_k(mode: str, activation: str, optimizer: str, precision: str):
    cfg = make_cfg(size=K, mode=mode, precision=precision)
    cfg.model.hidden, cfg.data.batch_size = [42, 24], 48  # 42: no multiple of 8 (gelu_aux pads it)
    cfg.model.activation, cfg.optimizer.name = activation, optimizer
    cfg.optimizer.momentum = 0.9 if optimizer == "sgd" else 0.0
    tr = EnsembleTrainer(cfg)
    dt = np.dtype(np.float64 if precision == "fp64" else np.float32)
    one = member_bytes(tr.widths, 48, dt, dt, 2 if optimizer == "adam" else 1, activation, mode)
    params = tr.model.params
    assert K * one["master_weights"] == nbytes(p.value for p in params)
    assert K * one["optimizer_state"] == nbytes(a for st in tr.optimizer.state.values() for a in st.values())
    x, y = next(iter(tr.train_batches(0)))
    tr.model.forward(x)  # the forward keeps what the backward reads: the layers' inputs and activation aux
    layers = tr.model.layers
    assert K * one["saved_inputs"] == nbytes(layer.x for layer in layers[1:])  # (layer 0's is the batch itself)
    assert K * one["relu_aux"] == nbytes(layer.mask for layer in layers) > 0
    tr.release_step()
    tr.forward_backward(x, y)
    assert K * one["gradients"] == nbytes(p.grad for p in params)
    acc = member_account(tr)  # gradients held now: measured
    assert acc["per_member"] == one and acc["by_formula"] == ["relu_aux", "saved_inputs"]
    assert acc["total"] == K * sum(one.values()) == K * acc["per_member_total"]


def test_the_run_reports_its_memory_per_member(tmp_path: Path) -> None:
    cfg = make_cfg(size=K, epochs=1)
    cfg.optimizer.name = "adam"
    train(cfg, tmp_path / "run")
    members = json.loads((tmp_path / "run" / "run.json").read_text())["memory"]["members"]
    widths = [64, 32, 16, 10]  # digits: 64 features, 10 classes
    n = sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))
    per = members["per_member"]
    assert members["members"] == K and per["master_weights"] == 4 * n and per["optimizer_state"] == 8 * n
    assert per["saved_inputs"] == 4 * 64 * (32 + 16)  # X_1, X_2 at batch 64, fp32
    assert members["total"] == K * sum(per.values())
