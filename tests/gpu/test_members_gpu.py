"""An ensemble's per-member update on the GPU (mlptrain/base/member_settings.py, the multi-tensor kernel's per-member
form): each member's rate, weight decay and frozen flag against the CPU's member-by-member update, a member frozen
after the step's CUDA graph was captured, and a batched sweep (ensemble.lr) against the CPU engine's. Written on a
CPU machine: the GPU issue runs it (docs/benchmarks.md lists it)."""

import numpy as np
import pytest
from gpu_helpers import cp, f64, np_dtype

from mlptrain.base.member_settings import MemberSettings
from mlptrain.config.schema import Device, OptimizerConfig, TrainConfig

pytestmark = pytest.mark.gpu

K = 3
SHAPES = [(K, 37, 5), (K, 37), (K, 300, 70), (K, 1)]  # one element per member to many blocks
BASE_LR, LRS, DECAYS = 0.01, [0.05, 0.01, 0.2], [0.0, 1e-3, 3e-2]


@pytest.mark.parametrize("name", ["sgd", "nesterov", "adam", "adamw"])
@pytest.mark.parametrize("compute", ["float32", "float16"])
def test_the_per_member_kernel_is_the_cpus_member_by_member_update(name: str, compute: str) -> None:
    """Three steps (the second skipped, an fp16 overflow), member 1 frozen before the third."""
    from mlptrain.nn.layers import Param
    from mlptrain.step.build import optimizer as make_optimizer

    rng = np.random.default_rng(12)
    cfg = OptimizerConfig(name="sgd" if name == "nesterov" else name, lr=BASE_LR, momentum=0.9, weight_decay=0.5)
    cfg.nesterov = name == "nesterov"
    w0 = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    pg = [Param(f"w{i}", cp.asarray(w), np_dtype(compute)) for i, w in enumerate(w0)]
    pc = [Param(f"w{i}", w.copy(), np.float32) for i, w in enumerate(w0)]
    og, oc = make_optimizer(cfg, pg), make_optimizer(cfg, pc)
    og.members, oc.members = MemberSettings(cp, BASE_LR, LRS, DECAYS), MemberSettings(np, BASE_LR, LRS, DECAYS)
    for i, lr in enumerate([0.01, 0.007, 0.004]):  # the schedule's rate of each step, at optimizer.lr
        if i == 2:
            og.members.freeze(1)
            oc.members.freeze(1)
            compute_before = [f64(a.compute[1]) for a in pg]
        for a, b in zip(pg, pc, strict=True):
            g_half = (rng.standard_normal(a.value.shape).astype(np.float32) * 100).astype(np_dtype(compute))
            a.grad = cp.asarray(g_half)
            b.grad = g_half.astype(np.float32) / 128.0
        og.step(cp.asarray(lr), inv_scale=cp.asarray(1 / 128.0), skip=cp.asarray(1 if i == 1 else 0, dtype=cp.int32))
        if i != 1:
            oc.members.lr = [lr * b / BASE_LR for b in LRS]  # each member's rate of this step, as the trainer sets it
            oc.step(np.asarray(lr))
    assert float(og.t) == float(oc.t) == 2
    for a, b, w in zip(pg, pc, w0, strict=True):
        np.testing.assert_allclose(cp.asnumpy(a.value), b.value, rtol=1e-5, atol=1e-6, err_msg=a.name)
        for s in og.state_names:
            np.testing.assert_allclose(cp.asnumpy(og.state[a.name][s]), oc.state[b.name][s], rtol=1e-5, atol=1e-6)
        assert not np.array_equal(cp.asnumpy(a.value[2]), w[2])  # (member 2 trained)
    for a, before in zip(pg, compute_before, strict=True):  # frozen: its compute copy untouched as well
        np.testing.assert_array_equal(f64(a.compute[1]), before)


def sweep_cfg(device: str, graph: bool = True, folds: int = 0) -> TrainConfig:
    cfg = TrainConfig()
    cfg.device, cfg.progress, cfg.seed, cfg.epochs, cfg.graph = Device(device), False, 3, 1, graph
    cfg.model.hidden = [64, 64]
    cfg.data.batch_size = 64
    cfg.optimizer.name = "adamw"
    if folds:
        cfg.ensemble.folds, cfg.early_stopping.patience = folds, 1
    else:
        cfg.ensemble.size = K
        cfg.ensemble.lr, cfg.ensemble.weight_decay = [1e-3, 3e-3, 1e-2], [0.0, 1e-2, 1e-1]
    return cfg


@pytest.mark.parametrize("graph", [False, True])
def test_a_batched_sweep_on_the_gpu_follows_the_cpus_members(graph: bool) -> None:
    from mlptrain.run.ensemble import EnsembleTrainer

    gpu, cpu = EnsembleTrainer(sweep_cfg("gpu", graph)), EnsembleTrainer(sweep_cfg("cpu"))
    assert gpu.optimizer.members is not None
    with gpu.stream:
        ours = [cp.asnumpy(gpu.step(x, y)[0]) for x, y in gpu.train_batches(0)][:12]
    theirs = [np.asarray(cpu.step(x, y)[0]) for x, y in cpu.train_batches(0)][:12]
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=2e-3)  # fp32: rounding order only
    cpu_state = cpu.model.state_dict()
    for name, a in gpu.model.state_dict().items():  # after the same steps, each member's own weights
        np.testing.assert_allclose(a, cpu_state[name], rtol=2e-3, atol=2e-4, err_msg=name)


def test_a_member_frozen_after_the_graph_was_captured_is_not_updated() -> None:
    """Freezing is a copy into the flags the captured kernel reads: the graph is replayed, not captured again."""
    from mlptrain.run.ensemble import EnsembleTrainer

    tr = EnsembleTrainer(sweep_cfg("gpu", True, folds=4))
    members = tr.optimizer.members
    assert members is not None
    batches = iter(tr.train_batches(0))
    with tr.stream:
        for _ in range(4):  # 2 warm-up steps, the capture, a replay
            tr.step(*next(batches))
        captured = tr.graphed.graphs()
        assert captured, "the step was not captured"
        members.freeze(2)
        before = tr.model.state_dict()
        for _ in range(3):
            tr.step(*next(batches))
        after = tr.model.state_dict()
    assert all(tr.graphed.graphs()[shape] is g for shape, g in captured.items())  # replayed, not captured again
    for name, a in after.items():
        np.testing.assert_array_equal(a[2], before[name][2])
        assert not np.array_equal(a[0], before[name][0])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_memory_account_per_member_on_the_gpu_is_the_formulas(precision: str) -> None:
    """After a few graphed steps: the stacked arrays over K are one member's bytes by the formula (bf16: with the
    compute copies), and the account of the whole run holds the K members' parameters, state and copies."""
    from mlptrain.run.ensemble import EnsembleTrainer
    from mlptrain.step.cuda.memory import account
    from mlptrain.step.memory import member_account, member_bytes

    cfg = sweep_cfg("gpu")
    cfg.precision.name = precision
    tr = EnsembleTrainer(cfg)
    with tr.stream:
        for x, y in list(tr.train_batches(0))[:4]:
            tr.step(x, y)
    acc, whole = member_account(tr), account(tr)
    p = tr.precision
    one = member_bytes(tr.widths, 64, p.param_dtype, p.compute_dtype, 2, "relu", "fused")
    assert acc["per_member"] == one
    assert (precision == "bf16") == (one["compute_copies"] > 0)
    for name in ("master_weights", "compute_copies", "optimizer_state"):
        assert whole["live_bytes"][name] == K * one[name], name
