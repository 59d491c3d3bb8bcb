"""The training loop on the CPU: fused and naive agree step by step, convergence, determinism."""

import numpy as np
import pytest

from mlptrain.config import Device, Mode, OptimizerName, PrecisionName, TrainConfig
from mlptrain.train import Trainer, train


def make_cfg(mode: str, precision: str, **kw) -> TrainConfig:
    cfg = TrainConfig()
    cfg.device, cfg.progress = Device.cpu, False
    cfg.execution.mode = Mode(mode)
    cfg.precision.name = PrecisionName(precision)
    for key, value in kw.items():
        setattr(cfg, key, value)
    return cfg


def step_losses(cfg: TrainConfig, epochs: int) -> np.ndarray:
    tr = Trainer(cfg)
    losses = []
    for epoch in range(epochs):
        for x, y in tr.train_loader.epoch(epoch):
            loss, _ = tr.step(x, y)
            losses.append(float(loss))
    return np.array(losses)


@pytest.mark.parametrize(("precision", "rtol"), [("fp64", 1e-10), ("fp32", 1e-5)])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fused_and_naive_give_the_same_losses_step_by_step(precision, rtol, optimizer):
    runs = {}
    for mode in ("fused", "naive"):
        cfg = make_cfg(mode, precision)
        cfg.optimizer.name = OptimizerName(optimizer)
        cfg.optimizer.lr = 0.05 if optimizer == "sgd" else 3e-3
        runs[mode] = step_losses(cfg, epochs=3)
    fused, naive = runs["fused"], runs["naive"]
    assert len(fused) == 63 and fused[-1] < 0.5 * fused[0]  # it trained
    rel = np.abs(fused - naive) / np.abs(naive)
    assert rel.max() < rtol, f"largest relative difference {rel.max():.3g} at step {rel.argmax()}"


def test_a_wrong_mask_would_be_caught():
    """The comparison above can fail: a naive path with a ReLU mask of z > 0.5 diverges at once."""
    import mlptrain.execution as ex

    fused = step_losses(make_cfg("fused", "fp64"), epochs=1)
    original = ex.NaiveExecution.forward

    def shifted(self, key, W, b, x, relu):
        z, mask = original(self, key, W, b, x, relu)
        return z, (None if mask is None else z > 0.5)

    ex.NaiveExecution.forward = shifted
    try:
        naive = step_losses(make_cfg("naive", "fp64"), epochs=1)
    finally:
        ex.NaiveExecution.forward = original
    assert np.abs(fused[1:] - naive[1:]).max() / np.abs(naive[1:]).max() > 1e-6


def test_default_run_reaches_96_percent_and_is_deterministic(tmp_path):
    a = train(make_cfg("fused", "fp32"), tmp_path / "a")
    b = train(make_cfg("fused", "fp32"), tmp_path / "b")
    assert a["test/acc"] >= 0.96
    assert a["test/acc"] == b["test/acc"] and a["train/loss"] == b["train/loss"]
    c = train(make_cfg("fused", "fp32", seed=1), tmp_path / "c")
    assert c["train/loss"] != a["train/loss"]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_fp16_step_records_carry_each_steps_loss_scale(tmp_path, monkeypatch):
    """Read back once per interval, the loss scale is still the one after each step."""
    from helpers import emulate_fp16, make_cfg, records

    emulate_fp16(monkeypatch)
    train(make_cfg(precision__init_scale=2.0**30, precision__growth_interval=4, log_every=10), tmp_path)
    steps = [r for r in records(tmp_path) if r["kind"] == "step"]
    scale = 2.0**30
    for r in steps:
        if r["skipped"]:
            scale /= 2
        assert r["loss_scale"] == scale or r["loss_scale"] == 2 * scale, r
        scale = r["loss_scale"]
    assert sum(r["skipped"] for r in steps[:10]) >= 5  # several back-offs inside the first interval
