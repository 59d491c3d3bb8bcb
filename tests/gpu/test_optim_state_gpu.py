"""``optimizer.state_dtype=bfloat16`` on the GPU: the multi-tensor update kernel with its state in bfloat16 (role
placeholder ``S``, CuPy's ``bfloat16``; Adam's second moment stays float32, role ``P``) against the CPU's NumPy
update, one model's and an ensemble's per-member form, and a bf16 run's losses against the same run with a float32
state. Written on a CPU machine, where the kernel's source is held to the NumPy update bit for bit
(tests/test_update_kernel_source.py); here nvcc may fuse ``a * b + c`` into one FMA, so a few state elements land a
bfloat16 step or two from the CPU's (see the test)."""

import contextlib

import numpy as np
import pytest
from gpu_helpers import cp, f64, np_dtype

from mlptrain.base.member_settings import MemberSettings
from mlptrain.config.schema import Device, OptimizerConfig, TrainConfig

pytestmark = pytest.mark.gpu

K = 3
SHAPES = [(K, 37, 5), (K, 37), (K, 300, 70), (K, 1)]  # one element per member to many blocks


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
    # nvcc fuses a * b + c into one FMA where NumPy rounds twice, so a bfloat16 state element may land a step from
    # the CPU's; carried into the next steps, where the two terms of an update cancel, such a step grows (an H100:
    # 0.2% of exp_avg's elements a step off after two steps of bfloat16 gradients, a few of them 1% to 300% off
    # after three, tree 6dc25cd). So each step starts the CPU from the GPU's weights and state, and holds one
    # step's result to the CPU's: the state within one bfloat16 step (2^-7 relative at the bottom of a binade; or
    # an FMA's rounding of the terms, where they cancel), the weights within the rate times that step of an update
    # of up to 4 (2^-5 lr).
    lr_max = 0.01 * (20 if members else 1)  # member 2's base rate 0.2 is 20 x optimizer.lr
    off, total = 0, 0
    for lr in [0.01, 0.007, 0.004]:
        for a, b in zip(pg, pc, strict=True):
            b.value[...] = cp.asnumpy(a.value)  # the CPU starts where the GPU is
            for s in og.state_names:
                oc.state[b.name][s][...] = cp.asnumpy(og.state[a.name][s])
            g = rng.standard_normal(a.value.shape).astype(np_dtype(compute))
            a.grad, b.grad = cp.asarray(g), g.astype(np.float32)
        og.step(cp.asarray(lr))
        on_cpu.lr = [lr * v / 0.01 for v in on_cpu.base_lr]  # each member's rate of this step, as the trainer sets it
        oc.step(np.asarray(lr))
        for a, b in zip(pg, pc, strict=True):
            np.testing.assert_allclose(cp.asnumpy(a.value), b.value, rtol=1e-5, atol=lr_max * 2.0**-5)
            if a.has_compute_copy:  # the compute copy is the master's, rounded
                np.testing.assert_array_equal(f64(a.compute), f64(cp.asnumpy(a.value).astype(np_dtype(compute))))
            for s in og.state_names:
                got, narrow = cp.asnumpy(og.state[a.name][s]), s != "exp_avg_sq"  # (Adam's second moment: float32)
                assert got.dtype == np_dtype("bfloat16" if narrow else "float32") == oc.state[b.name][s].dtype
                ours, cpus = f64(got), f64(oc.state[b.name][s])
                step = 2.0**-7 if narrow else 2.0**-20  # a bfloat16 step; a few float32 ulps (an FMA's rounding)
                bound = step * np.abs(cpus) + 2.0**-20 * np.abs(cpus).max()  # a step, or the terms' rounding
                assert np.all(np.abs(ours - cpus) <= bound), f"{a.name}/{s}: beyond a {got.dtype} step of the CPU's"
                if narrow:  # (float32's last bit differs wherever nvcc fused an FMA)
                    off, total = off + int(np.sum(ours != cpus)), total + ours.size
    # rarely: a truncating store, or one that kept the unrounded value, puts about half the elements off
    assert off < 0.01 * total, f"{off} of {total} state elements differ from the CPU's"


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
        if state_dtype:  # (the first moment in bfloat16, the second in the master dtype)
            dtypes = {s: a.dtype for st in tr.optimizer.state.values() for s, a in st.items()}
            assert dtypes == {"exp_avg": np_dtype("bfloat16"), "exp_avg_sq": np.dtype(np.float32)}
    gpu, cpu, wide = losses["gpu", "bfloat16"], losses["cpu", "bfloat16"], losses["gpu", None]
    np.testing.assert_allclose(gpu, cpu, rtol=2e-2)
    np.testing.assert_allclose(gpu[-5:].mean(), wide[-5:].mean(), rtol=5e-2)
