"""The training step and run: fused and naive agree step by step, convergence, determinism; on the GPU too."""

import numpy as np
import pytest
from gpu_helpers import cp, gpu_trainer, train_losses

from mlptrain.config.schema import Device, Mode, TrainConfig
from mlptrain.run.run import train
from mlptrain.step.trainer import Trainer


def make_cfg(mode: str, precision: str, **kw) -> TrainConfig:
    cfg = TrainConfig()
    cfg.device, cfg.progress = Device.cpu, False
    cfg.execution.mode = Mode(mode)
    cfg.precision.name = precision
    for key, value in kw.items():
        setattr(cfg, key, value)
    return cfg


def step_losses(cfg: TrainConfig, epochs: int) -> np.ndarray:
    return step_losses_of(Trainer(cfg), epochs)


def step_losses_of(tr: Trainer, epochs: int) -> np.ndarray:
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
        cfg.optimizer.name = optimizer
        cfg.optimizer.lr = 0.05 if optimizer == "sgd" else 3e-3
        runs[mode] = step_losses(cfg, epochs=3)
    fused, naive = runs["fused"], runs["naive"]
    assert len(fused) == 63 and fused[-1] < 0.5 * fused[0]  # it trained
    rel = np.abs(fused - naive) / np.abs(naive)
    assert rel.max() < rtol, f"largest relative difference {rel.max():.3g} at step {rel.argmax()}"


def test_a_wrong_mask_would_be_caught():
    """The comparison above can fail: a naive path with a ReLU mask of z > 0.5 diverges at once."""
    import mlptrain.nn.execution as ex

    fused = step_losses(make_cfg("fused", "fp64"), epochs=1)
    original = ex.NaiveExecution.forward

    def shifted(self, key, W, b, x, relu, mask=True):
        z, kept = original(self, key, W, b, x, relu, mask)
        return z, (None if kept is None else z > 0.5)

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


@pytest.mark.parametrize("hidden", [[32], [48, 24]])
def test_compute_copy_cast_takes_the_steps_of_the_kept_copy(monkeypatch, hidden):
    """precision.compute_copy=cast keeps no half-precision copy: each layer's parameters are cast into one
    shared buffer just before its GEMMs (the output layer's weight read again by the backward from the
    forward's cast). The cast rounds as the kept copy's refresh does, so every step's loss and the weights
    agree bit for bit; a buffer holding another layer's weight, or a stale one, would not."""
    from helpers import emulate_fp16

    from mlptrain.config.schema import ComputeCopy

    emulate_fp16(monkeypatch)
    runs = {}
    for copy in ("kept", "cast"):
        cfg = make_cfg("fused", "fp16")
        cfg.model.hidden, cfg.precision.compute_copy = hidden, ComputeCopy(copy)
        tr = Trainer(cfg)
        runs[copy] = (tr, step_losses_of(tr, epochs=2))
    (kept, kept_losses), (cast, cast_losses) = runs["kept"], runs["cast"]
    assert all(p.has_compute_copy for p in kept.model.params) and kept.model.cast_buffer is None
    assert not any(p.has_compute_copy or p.compute is not None for p in cast.model.params)
    widths = [64, *hidden, 10]
    largest_weight = max(a * b for a, b in zip(widths, widths[1:], strict=False))
    assert cast.model.cast_buffer.nbytes == 2 * (largest_weight + max(widths[1:]))  # float16
    from mlptrain.step.memory import expected_bytes

    formula = expected_bytes(widths, 64, np.float32, np.float16, 1, compute_copy="cast")["compute_copies"]
    assert formula == cast.model.cast_buffer.nbytes
    assert len(kept_losses) == 42 and len(set(kept_losses.tolist())) > 30  # it trains
    np.testing.assert_array_equal(cast_losses, kept_losses)
    for p, q in zip(kept.model.params, cast.model.params, strict=True):
        np.testing.assert_array_equal(q.value, p.value, err_msg=p.name)


def test_cast_buffer_refuses_to_reuse_a_parameter_cast_over():
    from mlptrain.nn.layers import CastBuffer

    buf = CastBuffer(np, np.float16, {"weight": 12})
    a, b = np.full((3, 4), 1.0 / 3, np.float32), np.full((2, 5), 2.0, np.float32)
    view = buf.cast("weight", a)
    assert view.dtype == np.float16 and view.shape == (3, 4) and (view == np.float16(1.0 / 3)).all()
    buf.cast("weight", b)
    with pytest.raises(RuntimeError, match="cast over"):
        buf.cast("weight", a, again=False)
    assert (buf.cast("weight", b, again=False) == 2).all()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_fp16_step_records_carry_each_steps_loss_scale(tmp_path, monkeypatch):
    """Read back once per interval, the loss scale is still the one after each step."""
    from helpers import FP16, emulate_fp16, make_cfg, records

    emulate_fp16(monkeypatch)
    train(make_cfg(**FP16, precision__init_scale=2.0**30, precision__growth_interval=4, log_every=10), tmp_path)
    steps = [r for r in records(tmp_path) if r["kind"] == "step"]
    scale = 2.0**30
    for r in steps:
        if r["skipped"]:
            scale /= 2
        assert r["loss_scale"] == scale or r["loss_scale"] == 2 * scale, r
        scale = r["loss_scale"]
    assert sum(r["skipped"] for r in steps[:10]) >= 5  # several back-offs inside the first interval


# --- on the GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_fused_and_naive_train_alike_on_the_gpu(precision):
    runs = {}
    for mode in ("fused", "naive"):
        tr = gpu_trainer(**{"execution.mode": mode, "precision.name": precision, "epochs": 10})
        losses = train_losses(tr, 10 * tr.steps_per_epoch)
        runs[mode] = (losses, tr.evaluate("test")["test/acc"])
    (lf, af), (ln, an) = runs["fused"], runs["naive"]
    assert af > 0.95 and an > 0.95, (af, an)
    assert abs(af - an) <= 0.02
    early = slice(0, 50)  # before rounding differences compound: the curves must coincide
    rtol, atol = {"fp32": (1e-4, 0), "fp16": (3e-2, 5e-3), "bf16": (6e-2, 1e-2)}[precision]
    np.testing.assert_allclose(lf[early], ln[early], rtol=rtol, atol=atol)
    # whole curve: epoch means agree
    n = len(lf) // 10 * 10
    np.testing.assert_allclose(lf[:n].reshape(10, -1).mean(1), ln[:n].reshape(10, -1).mean(1), rtol=0.25, atol=0.02)


@pytest.mark.gpu
def test_fp16_loss_scaling_survives_injected_overflow():
    """Start with a loss scale far beyond fp16's range: every first step overflows."""
    tr = gpu_trainer(**{"precision.name": "fp16", "precision.init_scale": 2.0**40, "epochs": 8})
    before = [p.value.copy() for p in tr.model.params]
    x, y = next(iter(tr.train_loader.epoch(0)))
    tr.step(x, y)
    assert int(tr.scaler.found_inf) == 1 and float(tr.scaler.scale) == 2.0**39
    for p, b in zip(tr.model.params, before, strict=True):
        cp.testing.assert_array_equal(p.value, b)  # skipped: weights untouched
    skipped = 1
    for epoch in range(8):
        for x, y in tr.train_loader.epoch(epoch):
            tr.step(x, y)
            skipped += int(tr.scaler.found_inf)
    assert 10 <= skipped <= 40  # about log2(2**40 / 2**16): backs off until gradients fit
    assert float(tr.scaler.scale) < 2.0**30
    assert tr.evaluate("test")["test/acc"] > 0.9


@pytest.mark.gpu
def test_plans_are_made_once_and_reused():
    # a fixed bgrad: "auto" times the step both ways at start-up, planning both sets of GEMMs
    tr = gpu_trainer(**{"data.drop_last": True, "execution.bgrad": "drelu_bgrad"})
    train_losses(tr, 5)
    n = tr.gemm.num_plans
    # fwd, wgrad per layer; dgrad for all but the first, and not the output layer's (the head kernel's)
    assert tr.head.mode == "kernel" and n == 3 * len(tr.model.layers) - 2
    train_losses(tr, 20)
    assert tr.gemm.num_plans == n


def test_the_weight_gradients_stream_is_chosen_by_the_steps_size_unless_set():
    """execution.wgrad_stream: true/false as said; null: two streams for latency-bound steps (below
    TWO_STREAMS_MAX_FLOPS) and data-parallel runs, one stream where the GEMMs fill the GPU."""
    from types import SimpleNamespace

    from mlptrain.step.build import TWO_STREAMS_MAX_FLOPS, step_flops, wgrad_stream

    small, big = ([784, 1024, 1024, 10], 256), ([4096] * 5, 8192)
    assert step_flops(*small) == 6 * 256 * (784 * 1024 + 1024 * 1024 + 1024 * 10)
    assert step_flops(*small) < TWO_STREAMS_MAX_FLOPS < step_flops(*big)
    auto, on, off = (SimpleNamespace(wgrad_stream=v) for v in (None, True, False))
    assert wgrad_stream(auto, *small, False) and not wgrad_stream(auto, *big, False)
    assert wgrad_stream(auto, *big, True), "data parallel: the all-reduces start on the side stream"
    assert wgrad_stream(on, *big, False) and not wgrad_stream(off, *small, True)


def test_the_trainer_holds_every_part_the_builder_makes_and_builds_none():
    """build.trainer makes the parts of a trainer, in order; the trainer holds each (a part added to the builder
    and not to the trainer fails here) and constructs nothing itself: its __init__ calls only the builder, the
    runtime's prepare, the step's batches and the set-up that needs the whole step."""
    import ast
    import dataclasses
    import inspect
    import textwrap

    from mlptrain.step import build

    tr = Trainer(make_cfg("fused", "fp32", max_steps=5))
    fields = [f.name for f in dataclasses.fields(build.TrainerParts)]
    assert all(getattr(tr, name) is not None for name in fields if name != "grad_sync")
    assert tr.grad_sync is None and tr.total_steps == 5 and tr.steps_per_epoch == len(tr.train_loader)
    tree = ast.parse(textwrap.dedent(inspect.getsource(Trainer.__init__)))
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert calls == {"build.trainer", "self.runtime.prepare", "StepBatches", "mark", "self._finish_setup", "len"}
