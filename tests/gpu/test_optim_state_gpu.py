"""``optimizer.state_dtype=bfloat16`` on the GPU: the multi-tensor update kernel with its state in bfloat16 (role
placeholder ``S``, CuPy's ``bfloat16``) against the CPU's NumPy update, one model's and an ensemble's per-member
form, and a bf16 run's losses against the same run with a float32 state. Written on a CPU machine, where the
kernel's source is held to the NumPy update bit for bit (tests/test_update_kernel_source.py); here nvcc may fuse
``a * b + c`` into one FMA, so a state element may land a bfloat16 step or two from the CPU's (measured on an
H100: two, after three steps), in a few elements."""

import contextlib

import numpy as np
import pytest
from gpu_helpers import cp, f64, np_dtype

from mlptrain.base.member_settings import MemberSettings
from mlptrain.config.schema import Device, OptimizerConfig, TrainConfig

pytestmark = pytest.mark.gpu

K = 3
SHAPES = [(K, 37, 5), (K, 37), (K, 300, 70), (K, 1)]  # one element per member to many blocks


def _bits_apart(a, b) -> int:
    """The most bfloat16 steps between two bfloat16 arrays of one sign pattern (as the bits' integer distance)."""
    return int(np.abs(a.view(np.uint16).astype(np.int32) - b.view(np.uint16).astype(np.int32)).max())


@pytest.mark.parametrize("name", ["sgd", "nesterov", "adam", "adamw"])
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
@pytest.mark.parametrize("members", [False, True])
def test_the_kernel_with_a_bfloat16_state_is_the_cpus_update(name: str, compute: str, members: bool) -> None:
    from mlptrain.nn.layers import Param
    from mlptrain.step.build import optimizer as make_optimizer

    rng = np.random.default_rng(13)
    cfg = OptimizerConfig(name="sgd" if name == "nesterov" else name, lr=0.01, momentum=0.9, weight_decay=0.05)
    cfg.nesterov, cfg.state_dtype = name == "nesterov", "bfloat16"
    w0 = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    pg = [Param(f"w{i}", cp.asarray(w), np_dtype(compute)) for i, w in enumerate(w0)]
    pc = [Param(f"w{i}", w.copy(), np.float32) for i, w in enumerate(w0)]
    og, oc = make_optimizer(cfg, pg), make_optimizer(cfg, pc)
    on_cpu = MemberSettings(np, 0.01, [0.05, 0.01, 0.2], [0.0, 1e-3, 3e-2])
    if members:
        og.members, oc.members = MemberSettings(cp, 0.01, [0.05, 0.01, 0.2], [0.0, 1e-3, 3e-2]), on_cpu
    for lr in [0.01, 0.007, 0.004]:
        for a, b in zip(pg, pc, strict=True):
            g = rng.standard_normal(a.value.shape).astype(np_dtype(compute))
            a.grad, b.grad = cp.asarray(g), g.astype(np.float32)
        og.step(cp.asarray(lr))
        on_cpu.lr = [lr * v / 0.01 for v in on_cpu.base_lr]  # each member's rate of this step, as the trainer sets it
        oc.step(np.asarray(lr))
    for a, b in zip(pg, pc, strict=True):
        # a state element a bfloat16 step or two from the CPU's (an FMA's rounding, carried into the next steps)
        # moves the weight by lr x that step: ~1e-5 a step at these rates (an H100 measured 1.4e-5 after three)
        np.testing.assert_allclose(cp.asnumpy(a.value), b.value, rtol=1e-5, atol=1e-4, err_msg=a.name)
        if a.has_compute_copy:  # the compute copy is the master's, rounded
            np.testing.assert_array_equal(f64(a.compute), f64(cp.asnumpy(a.value).astype(np_dtype(compute))))
        for s in og.state_names:
            got = cp.asnumpy(og.state[a.name][s])
            assert got.dtype == np_dtype("bfloat16") and got.dtype == oc.state[b.name][s].dtype
            # FMA flips a rounding near a tie, and the state carries it on: at most 2 steps apart (an H100, 3 steps),
            # and rarely (a truncating or unrounded store would put about half the elements a step apart)
            assert _bits_apart(got, oc.state[b.name][s]) <= 2, f"{a.name}/{s}"
            assert np.mean(got != oc.state[b.name][s]) < 0.05, f"{a.name}/{s}: too many elements off the CPU's"


def _cfg(device: str, state_dtype: str | None) -> TrainConfig:
    cfg = TrainConfig()
    cfg.device, cfg.progress, cfg.epochs = Device(device), False, 1
    cfg.model.hidden = [64, 64]
    cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.state_dtype = "adam", 3e-3, state_dtype
    return cfg


def test_a_bfloat16_state_run_on_the_gpu_follows_the_cpus() -> None:
    """fp32, digits, one epoch with Adam's moments in bfloat16: the GPU's step losses against the CPU engine's (the
    GEMMs sum in another order, so the two drift as any GPU and CPU run do), and against a float32 state's."""
    from mlptrain.step.trainer import Trainer

    losses = {}
    for device, state_dtype in [("gpu", "bfloat16"), ("cpu", "bfloat16"), ("gpu", None)]:
        tr = Trainer(_cfg(device, state_dtype))
        with tr.stream if device == "gpu" else contextlib.nullcontext():
            losses[device, state_dtype] = np.array([float(tr.step(x, y)[0]) for x, y in tr.train_batches(0)])
        if state_dtype:
            assert {a.dtype for st in tr.optimizer.state.values() for a in st.values()} == {np_dtype("bfloat16")}
    gpu, cpu, wide = losses["gpu", "bfloat16"], losses["cpu", "bfloat16"], losses["gpu", None]
    np.testing.assert_allclose(gpu, cpu, rtol=2e-2)
    np.testing.assert_allclose(gpu[-5:].mean(), wide[-5:].mean(), rtol=5e-2)
