"""precision=fp8: delayed scaling (mlptrain.nn.fp8), the FP8 GEMM engine, and FP8 training on the CPU."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import make_cfg
from test_checkpoint import assert_same_state, interrupt_at

from mlptrain.base.errors import CheckpointError, TrainingInterrupted
from mlptrain.nn.epilogs import Epilog
from mlptrain.nn.epilogs_fp8 import FP8_MAX, matmul_fp8, quantize
from mlptrain.nn.execution import NumpyGemm
from mlptrain.nn.fp8 import Fp8Gemm, Fp8Scaling
from mlptrain.run import checkpoint
from mlptrain.run.run import train
from mlptrain.step.trainer import Trainer

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = {"precision__name": "fp8"}


# ----------------------------------------------------------------------------- delayed scaling


def test_a_cast_uses_the_scale_of_the_steps_before_and_then_records_its_amax():
    s = Fp8Scaling(np, amax_history=2)
    x = np.full((4, 4), 3.0, np.float32)
    q, inv = s.quantize("t", x, "e4m3")
    assert inv == 1.0 and q.astype(np.float64).max() == 3.0  # step 1: scale 1
    st = s.tensors["t"]
    assert st.scale == np.float32(448 / 3) and list(st.amax_history) == [3.0, 0.0]
    q, inv = s.quantize("t", x / 3, "e4m3")  # amax 1, cast with the scale from amax 3
    assert inv == np.float32(1 / np.float32(448 / 3)) and np.isclose(q.astype(np.float64).max(), 448 / 3, rtol=2**-3)
    assert list(st.amax_history) == [1.0, 3.0] and st.scale == np.float32(448 / 3)  # still the max of the window
    s.quantize("t", x / 3, "e4m3")  # the 3 leaves the 2-step window
    assert list(st.amax_history) == [1.0, 1.0] and st.scale == np.float32(448.0)


def test_the_margin_and_the_format_set_the_scale():
    s = Fp8Scaling(np, amax_history=4, margin=2)
    s.quantize("g", np.full(8, 2.0, np.float32), "e5m2")
    assert s.tensors["g"].scale == np.float32(FP8_MAX["e5m2"] / (4 * 2.0))


def test_a_non_finite_or_zero_amax_leaves_the_scale_as_it_was():
    s = Fp8Scaling(np, amax_history=3)
    s.quantize("t", np.zeros(8, np.float32), "e4m3")
    assert s.tensors["t"].scale == 1.0  # an all-zero history gives no scale: keep 1
    s.quantize("t", np.full(8, 2.0, np.float32), "e4m3")
    before = s.state_dict()
    q, _ = s.quantize("t", np.array([1.0, np.inf, np.nan], np.float32), "e4m3")
    assert np.isnan(q.astype(np.float32)[1:]).all()  # the bad values reach the GEMM, so the step is skipped
    after = s.state_dict()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


def test_inference_casts_with_the_scales_and_records_nothing():
    s = Fp8Scaling(np)
    s.quantize("t", np.full(4, 2.0, np.float32), "e4m3")
    before = s.state_dict()
    q, inv = s.quantize("t", np.full(4, 100.0, np.float32), "e4m3", record=False)
    assert inv == np.float32(2.0 / 448) and q.astype(np.float64).max() == 448.0  # saturated: the scale of amax 2
    np.testing.assert_array_equal(s.state_dict()["fp8/t/amax_history"], before["fp8/t/amax_history"])


def test_scaling_state_round_trips():
    s = Fp8Scaling(np, amax_history=5)
    s.quantize("layer0.fwd.a", np.arange(6, dtype=np.float32), "e4m3")
    arrays = s.state_dict()
    assert s.expected(arrays) == {
        "fp8/layer0.fwd.a/amax_history": ((5,), "float32"),
        "fp8/layer0.fwd.a/scale": ((), "float32"),
    }
    t = Fp8Scaling(np, amax_history=5)
    t.load_state_dict(arrays)
    assert t.tensors["layer0.fwd.a"].scale == np.float32(448 / 5)
    np.testing.assert_array_equal(t.tensors["layer0.fwd.a"].amax_history, [5, 0, 0, 0, 0])


# ----------------------------------------------------------------------------- the engine


def _bf16(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(BF16)


def test_the_engine_casts_each_role_in_its_formats_and_runs_the_contract():
    gemm = Fp8Gemm(NumpyGemm(), Fp8Scaling(np), mode="fused")
    W, dzt = _bf16((32, 48), 0), _bf16((48, 16), 1, 1e-3)  # dX^T (in, B) = W^T (in, out) @ dZ^T (out, B)
    d, aux = gemm("layer1.dgrad", W, dzt)
    assert aux == {} and d.dtype == BF16
    # the first step casts with scale 1: the contract on the same casts
    expected = matmul_fp8(quantize(W, 1.0, "e4m3"), quantize(dzt, 1.0, "e5m2"), scale_a_inv=1.0, scale_b_inv=1.0)
    np.testing.assert_array_equal(d.astype(np.float32), expected.astype(np.float32))
    scales = gemm.scaling.tensors
    assert scales["layer1.dgrad.b"].scale == np.float32(FP8_MAX["e5m2"] / np.abs(dzt.astype(np.float32)).max())
    assert scales["layer1.dgrad.a"].scale == np.float32(FP8_MAX["e4m3"] / np.abs(W.astype(np.float32)).max())


def test_the_naive_engine_casts_the_gradient_operand_of_its_dgrad_in_e5m2():
    gemm = Fp8Gemm(NumpyGemm(), Fp8Scaling(np), mode="naive")
    dz, W = _bf16((16, 32), 2), _bf16((32, 48), 3)  # (B, out) @ (out, in)
    gemm("layer1.dgrad", dz, W)
    a = gemm.scaling.tensors["layer1.dgrad.a"]
    assert a.scale == np.float32(FP8_MAX["e5m2"] / np.abs(dz.astype(np.float32)).max())


def test_dimensions_that_are_not_multiples_of_16_stay_16_bit():
    gemm = Fp8Gemm(NumpyGemm(), Fp8Scaling(np))
    W, xt, b = _bf16((10, 32), 4), _bf16((32, 16), 5), _bf16(10, 6)  # the 10-class head
    d, _ = gemm("layer2.fwd", W, xt, Epilog.BIAS, bias=b)
    ref, _ = NumpyGemm()("layer2.fwd", W, xt, Epilog.BIAS, bias=b)
    np.testing.assert_array_equal(d.astype(np.float32), ref.astype(np.float32))
    assert gemm.scaling.tensors == {}


def test_the_weight_gradient_reduces_the_bias_gradient_from_the_16_bit_dz():
    gemm = Fp8Gemm(NumpyGemm(), Fp8Scaling(np))
    xt, dz = _bf16((32, 64), 7), _bf16((64, 16), 8, 1e-2)  # X^T (in, B) @ dZ (B, out)
    dwt, aux = gemm("layer0.wgrad", xt, dz, Epilog.BGRADB)
    _, ref = NumpyGemm()("layer0.wgrad", xt, dz, Epilog.BGRADB)
    np.testing.assert_array_equal(aux["bgradb"].astype(np.float32), ref["bgradb"].astype(np.float32))
    plain, _ = Fp8Gemm(NumpyGemm(), Fp8Scaling(np))("layer0.wgrad", xt, dz)
    np.testing.assert_array_equal(dwt.astype(np.float32), plain.astype(np.float32))  # the FP8 GEMM, no epilog


def test_the_inference_site_uses_the_training_forwards_scales():
    gemm = Fp8Gemm(NumpyGemm(), Fp8Scaling(np))
    W, b = _bf16((32, 16), 9), _bf16(32, 10)
    gemm("layer0.fwd", W, _bf16((16, 16), 11), Epilog.RELU_AUX_BIAS, bias=b)
    before = gemm.scaling.state_dict()
    gemm("layer0.infer", W, _bf16((16, 32), 12, 50.0), Epilog.RELU_BIAS, bias=b)
    assert set(gemm.scaling.tensors) == {"layer0.fwd.a", "layer0.fwd.b"}
    for key, value in gemm.scaling.state_dict().items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)


# ----------------------------------------------------------------------------- training


def test_fp8_trains_digits_close_to_fp32(tmp_path: Path):
    fp32 = train(make_cfg(model__hidden=[128, 128]), tmp_path / "fp32")
    fp8 = train(make_cfg(model__hidden=[128, 128], **FP8), tmp_path / "fp8")
    assert fp8["test/acc"] >= fp32["test/acc"] - 0.02 and fp8["test/acc"] > 0.9
    arrays = checkpoint.load(tmp_path / "fp8" / "checkpoints" / "last.npz").arrays
    fp8_keys = {k.split("/")[1] for k in arrays if k.startswith("fp8/")}
    # the hidden layers' three GEMMs ran in FP8; the 10-class head (layer2) stayed bf16
    sites = ["layer0.fwd", "layer0.wgrad", "layer1.fwd", "layer1.wgrad", "layer1.dgrad"]  # layer0 has no dgrad
    assert fp8_keys == {f"{site}.{operand}" for site in sites for operand in "ab"}
    assert fp8["test/acc"] != fp32["test/acc"] or fp8["train/loss"] != fp32["train/loss"]  # not fp32 in disguise


@pytest.mark.parametrize("mode", ["fused", "naive"])
def test_fp8_without_a_weight_copy_takes_the_steps_of_the_kept_copy(mode: str):
    """precision=fp8's own compute_copy (auto: cast) keeps no bfloat16 copy of the weights: the layers whose
    widths FP8 takes hand their float32 master to the GEMM engine, which rounds it to bfloat16 before its
    FP8 cast (on the GPU in the cast kernel's registers); the head's weight and every bias go through the
    cast buffer; a GEMM that falls back to 16 bits (the epoch's short last batch of 14 rows) casts the
    master itself. Every loss and weight is the kept copy's bit for bit: a master cast to FP8 without its
    rounding to bfloat16 first (some 3 % of the weights land in another FP8 value), or a 16-bit fallback
    that read the float32 master, would not agree."""
    from test_trainer import step_losses_of

    from mlptrain.config.schema import ComputeCopy
    from mlptrain.step.memory import expected_bytes

    runs = {}
    for copy in ("kept", "auto"):
        cfg = make_cfg(model__hidden=[32, 48], **FP8)
        cfg.execution.mode, cfg.precision.compute_copy = type(cfg.execution.mode)(mode), ComputeCopy(copy)
        tr = Trainer(cfg)
        runs[copy] = (tr, step_losses_of(tr, epochs=2))
    (kept, kept_losses), (cast, cast_losses) = runs["kept"], runs["auto"]
    assert tr.train_loader.num_samples % 64 % 16 != 0 and len(tr.train_loader) == 21  # a short batch: 16 bits
    assert all(p.has_compute_copy for p in kept.model.params) and kept.model.cast_buffer is None
    assert [layer.weight.gemm_casts for layer in cast.model.layers] == [True, True, False]  # 64-32-48 in FP8
    assert all(p.compute is None and not p.has_compute_copy for p in cast.model.params)
    assert cast.model.cast_buffer.nbytes == 2 * (48 * 10 + 48)  # the head's weight and the largest bias
    formula = expected_bytes([64, 32, 48, 10], 64, np.float32, BF16, 1, compute_copy="cast", fp8_weights=True)
    assert formula["compute_copies"] == cast.model.cast_buffer.nbytes
    assert len(set(kept_losses.tolist())) > 30  # it trains
    np.testing.assert_array_equal(cast_losses, kept_losses)
    for p, q in zip(kept.model.params, cast.model.params, strict=True):
        np.testing.assert_array_equal(q.value, p.value, err_msg=p.name)


def test_the_engine_rounds_a_master_weight_to_16_bits_before_its_fp8_cast():
    """Fp8Gemm given a float32 B (a weight's master): its FP8 bytes and recorded amax are those of B in A's
    dtype, not of the float32 values (they differ in a few percent of the elements)."""
    rng = np.random.default_rng(3)
    a = _bf16((32, 48), 1)
    w = rng.standard_normal((48, 16)).astype(np.float32) * np.float32(0.1)
    assert (quantize(w, np.float32(37.0), "e4m3") != quantize(w.astype(BF16), np.float32(37.0), "e4m3")).any()
    outs = []
    for b in (w, w.astype(BF16)):
        gemm = Fp8Gemm(NumpyGemm(), Fp8Scaling(np))
        gemm.scaling.get("l.fwd.b").scale[...] = np.float32(37.0)
        d, _ = gemm("l.fwd", a, b)
        outs.append((d, gemm.scaling.state_dict()))
    (d_master, state_master), (d_copy, state_copy) = outs
    assert d_master.dtype == BF16
    np.testing.assert_array_equal(d_master, d_copy)
    for key, value in state_copy.items():
        np.testing.assert_array_equal(state_master[key], value, err_msg=key)
    head = Fp8Gemm(NumpyGemm(), Fp8Scaling(np))  # 10 columns: the 16-bit GEMM, on B in A's dtype
    w10 = w[:, :10]
    d16, _ = head("h.fwd", a, w10)
    np.testing.assert_array_equal(d16, NumpyGemm()("h.fwd", a, w10.astype(BF16))[0])


def test_an_fp8_run_resumes_bit_for_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    overrides = {**FP8, "precision__amax_history": 4, "epochs": 2}
    train(make_cfg(**overrides), tmp_path / "straight")
    interrupt_at(monkeypatch, 25)  # mid-epoch: the scales of 26 steps are in the checkpoint
    with pytest.raises(TrainingInterrupted):
        train(make_cfg(**overrides), tmp_path / "resumed")
    monkeypatch.undo()
    saved = checkpoint.load(tmp_path / "resumed" / "checkpoints" / "last.npz").arrays
    assert saved["fp8/layer0.fwd.b/amax_history"].shape == (4,) and saved["fp8/layer0.fwd.b/amax_history"].min() > 0
    train(make_cfg(resume="last", **overrides), tmp_path / "resumed")
    assert_same_state(
        tmp_path / "resumed" / "checkpoints" / "last.npz", tmp_path / "straight" / "checkpoints" / "last.npz"
    )


def test_fp8_state_is_refused_by_a_run_that_is_not_fp8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    interrupt_at(monkeypatch, 3)
    with pytest.raises(TrainingInterrupted):
        train(make_cfg(**FP8), tmp_path)
    monkeypatch.undo()
    ckpt = checkpoint.load(tmp_path / "checkpoints" / "last.npz")
    with pytest.raises(CheckpointError, match="fp8/layer0"):  # a trainer that is not fp8 cannot take fp8 state
        Trainer(make_cfg()).load_state_dict(ckpt.arrays, ckpt.meta, step=ckpt.position.step, where="last.npz")
    # resume=last with the run directory alone continues the run with its own settings, fp8 included
    assert train(make_cfg(resume="last"), tmp_path)["steps"] == 63


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_a_non_finite_gradient_skips_the_fp8_step():
    tr = Trainer(make_cfg(**FP8))
    x, y = next(iter(tr.train_loader.epoch(0)))
    tr.step(x, y)  # one clean step: scales from its amaxes
    params = {p.name: p.value.copy() for p in tr.model.params}
    scales = tr.gemm.scaling.state_dict()
    bad = x.copy()
    bad[3, 5] = np.inf
    tr.step(bad, y)
    assert int(tr.scaler.found_inf) == 1 and int(tr.scaler.consecutive_skips) == 1
    for p in tr.model.params:
        np.testing.assert_array_equal(p.value, params[p.name], err_msg=p.name)  # the update was skipped
    assert float(tr.scaler.scale) == 1.0  # fp8 never scales the loss
    np.testing.assert_array_equal(
        tr.gemm.scaling.state_dict()["fp8/layer0.fwd.b/scale"], scales["fp8/layer0.fwd.b/scale"]
    )
    tr.step(x, y)
    assert int(tr.scaler.found_inf) == 0 and int(tr.scaler.consecutive_skips) == 0


def test_an_fp8_checkpoint_predicts_in_bf16_on_a_gpu_and_fp32_on_the_cpu():
    from mlptrain.base.backend import Backend
    from mlptrain.inference.predictor import _precision

    # a GPU backend over NumPy: enough for the choice, which must not ask the device for FP8
    assert _precision(None, "fp8", Backend("gpu", np)).name == "bf16"
    assert _precision(None, "fp8", Backend("cpu", np)).name == "fp32"


@pytest.mark.parametrize(("capability", "ok"), [("86", False), ("89", True), ("90", True)])
def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_a_device_error(capability, ok):
    from types import SimpleNamespace

    from mlptrain.base.backend import Backend
    from mlptrain.base.errors import DeviceError
    from mlptrain.step.precision import get_precision

    # a GPU backend whose device reports ``capability`` (NumPy stands in for CuPy: only the check runs)
    device = SimpleNamespace(compute_capability=capability)
    xp = SimpleNamespace(float32=np.float32, cuda=SimpleNamespace(Device=lambda: device))
    backend = Backend("gpu", xp)  # type: ignore[arg-type]
    if ok:
        assert get_precision("fp8", backend).fp8
    else:
        with pytest.raises(DeviceError, match=r"compute capability 8.9 or higher .* is 8.6; use precision=bf16"):
            get_precision("fp8", backend)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_consecutive_non_finite_fp8_steps_stop_the_run_naming_fp8():
    from mlptrain.base.errors import NonFiniteError
    from mlptrain.run import faults

    tr = Trainer(make_cfg(**FP8, precision__max_consecutive_skips=2))
    x, y = next(iter(tr.train_loader.epoch(0)))
    bad = x.copy()
    bad[0, 0] = np.nan
    for _ in range(2):
        tr.step(bad, y)
    with pytest.raises(NonFiniteError, match="fp8 gradients overflowed on 2 consecutive steps"):
        faults.check_scaler(tr)


def test_the_naive_fp8_twin_takes_the_fused_steps_on_the_cpu():
    """Naive runs the same FP8 GEMMs (its own operand order: dZ @ W casts dZ as A) with bias, ReLU and the
    reductions apart; on the CPU both issue the same products, so they agree bit for bit, as in 16-bit."""
    from mlptrain.config.schema import Mode

    losses = {}
    for mode in ("fused", "naive"):
        tr = Trainer(make_cfg(**FP8, execution__mode=Mode(mode), model__hidden=[64, 32]))
        losses[mode] = [float(tr.step(x, y)[0]) for e in range(2) for x, y in tr.train_loader.epoch(e)]
        assert {k.split("/")[1] for k in tr.gemm.scaling.state_dict()} >= {"layer1.dgrad.a", "layer1.dgrad.b"}
    assert losses["fused"] == losses["naive"] and losses["fused"][-1] < 0.5 * losses["fused"][0]
