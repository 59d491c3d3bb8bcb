"""A new loss from outside the package: one function, registered (#29).

L1 against the one-hot labels: ``loss = mean |z - onehot(y)|``, ``dlogits = sign(z - onehot) / (B C)``;
a classification loss only (it declares no regression targets).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlptrain import train
from mlptrain.base.errors import ConfigError
from mlptrain.cli.help import settings_help
from mlptrain.cli.main import compose_config
from mlptrain.nn.losses import LOSSES, LossSpec
from mlptrain.run.metrics import read_metrics

CALLS: list[tuple[np.ndarray, np.ndarray, float]] = []  # (logits, labels, loss) of every call


def l1(logits: Any, y: Any, grad_scale: Any = 1.0, *, bias_grad: bool = False, inplace: bool = False) -> tuple:
    B, C = logits.shape
    z = logits.astype(np.float64)
    CALLS.append((z.copy(), np.array(y), np.nan))
    r = z - (np.arange(C)[None, :] == y[:, None])
    loss = np.abs(r).mean()
    CALLS[-1] = (*CALLS[-1][:2], float(loss))
    correct = (logits.argmax(axis=1) == y).sum()
    g = np.sign(r) * (grad_scale / (B * C))
    d = g.astype(logits.dtype)
    if inplace:
        logits[...] = d
        d = logits
    return (loss, d, correct, g.sum(axis=0).astype(logits.dtype)) if bias_grad else (loss, d, correct)


@pytest.fixture
def registered() -> Iterator[list[str]]:
    LOSSES.add("l1", LossSpec(l1), "mean absolute error to the one-hot labels")
    CALLS.clear()
    try:
        yield ["model.loss=l1", "device=cpu", "progress=false"]
    finally:
        LOSSES.remove("l1")


def test_a_run_trains_with_it(registered: list[str], tmp_path: Path) -> None:
    # 4 epochs: digits' nearly constant pixels are standardised since #47, and 3 reached 0.103
    cfg = compose_config([*registered, "model.hidden=[32]", "epochs=4", "log_every=1", "optimizer.lr=0.5"])
    train(cfg, tmp_path / "run")
    records = list(read_metrics(tmp_path / "run" / "metrics.jsonl"))
    first = next(r for r in records if r["kind"] == "step")
    logits, y, loss = CALLS[0]  # the first step's loss: the run called l1, on its real logits
    onehot = np.arange(10)[None, :] == y[:, None]
    assert logits.shape == (64, 10) and loss == pytest.approx(np.abs(logits - onehot).mean(), rel=1e-12)
    assert first["step"] == 0 and first["train/loss"] == pytest.approx(loss, rel=1e-6)
    val = [r["val/loss"] for r in records if r["kind"] == "epoch"]
    assert len(val) == 4 and val[0] > val[1] > val[2] > val[3], val
    assert val[3] < 0.1  # below what all-zero logits score (1/C)


def test_help_and_the_checks_know_it(registered: list[str]) -> None:
    line = next(x for x in settings_help().splitlines() if "model.loss =" in x)
    assert "cross_entropy (classification), mse (regression, or one-hot) or l1 (mean absolute error" in line
    with pytest.raises(ConfigError, match="model.loss='l2' is unknown; expected one of cross_entropy, mse, l1"):
        compose_config(["model.loss=l2"])
    # not a regression loss: data.target_scaling (a regression's) is not used with it
    with pytest.raises(ConfigError, match=r"not used with model.loss=l1: it applies to regressions \(model.loss=mse\)"):
        compose_config([*registered, "data.target_scaling=none"])


def test_gone_once_removed() -> None:
    assert LOSSES.names() == ("cross_entropy", "mse")
