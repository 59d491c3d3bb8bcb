"""An ensemble's per-member update (mlptrain/base/member_settings.py): the member of an element in the stacked
layout, and a NumPy reference of the GPU kernel's per-member arithmetic (element by element, as the CUDA body of
mlptrain.step.optim writes it) against the CPU's member-by-member update, for SGD with (Nesterov) momentum, Adam
and AdamW, each member with its own rate and weight decay and one member frozen. The kernel itself is
tests/gpu/test_members_gpu.py's."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mlptrain.base.member_settings import MemberSettings, member_index_cuda, member_of, member_update_cuda
from mlptrain.config.schema import OptimizerConfig
from mlptrain.nn.layers import Param
from mlptrain.step.build import optimizer as make_optimizer

K = 3
SHAPES = [(K, 7, 5), (K, 7), (K, 1, 4), (K, 1)]  # (K, out, in), (K, out): a layer, and a one-output layer
BASE_LR, LRS, DECAYS = 0.01, [0.05, 0.01, 0.2], [0.0, 1e-3, 3e-2]


def as_python(expr: str) -> str:
    """The CUDA integer expression of member_index_cuda as Python (``(int)(j / 35LL)`` -> ``int(j // 35)``)."""
    return re.sub(r"(\d+)LL", r"\1", expr.replace("(int)", "int").replace("/", "//"))


@pytest.mark.parametrize("shape", SHAPES)
def test_the_member_of_an_element_is_its_index_on_the_leading_axis(shape: tuple[int, ...]) -> None:
    n = int(np.prod(shape))
    leading = np.indices(shape)[0].reshape(-1)  # C order: the member of each flat element
    np.testing.assert_array_equal(member_of(np.arange(n), n, K), leading)
    code = as_python(member_index_cuda(n, K))
    assert [eval(code, {"j": j}) for j in range(n)] == list(leading)  # the kernel's expression, element by element


def test_a_tensor_that_is_not_k_members_is_refused() -> None:
    with pytest.raises(ValueError, match="10 elements does not hold 3 members"):
        member_of(0, 10, 3)
    assert "member_frozen[member] == 0" in member_update_cuda("$p = $p;")  # a frozen member's element is skipped


def test_freezing_a_member_sets_the_host_mask_and_the_flags_the_kernel_reads() -> None:
    m = MemberSettings(np, BASE_LR, LRS, DECAYS)
    m.freeze(1)
    assert list(m.frozen) == [False, True, False]
    flags = m.frozen_flags
    m.freeze(2)
    assert m.frozen_flags is flags and list(flags) == [0, 1, 1]  # the same array: a captured graph reads it
    np.testing.assert_array_equal(m.lr_ratio, np.array(LRS) / BASE_LR)


def kernel_reference(opt, tensors, settings: MemberSettings, lr: float, inv_scale: float) -> None:
    """The GPU kernel's per-member update of ``tensors`` (name -> (p, g, state)) in NumPy, element by element in the
    parameter dtype (float32) as the CUDA body computes it: member from the stacked layout, ``lr_m = lr * ratio``
    (float64) cast once, weight decay cast once, a frozen member's elements untouched."""
    f = np.float32
    t_now = float(opt.t) + 1.0
    for p, g, st in tensors.values():
        flat_p, flat_g = p.reshape(-1), g.reshape(-1).astype(f)
        member = member_of(np.arange(flat_p.size), flat_p.size, K)
        lr_m = lr * settings.lr_ratio[member]  # float64
        lr_v, wd_d = lr_m.astype(f), settings.decay[member]
        wd_m, live = wd_d.astype(f), settings.frozen_flags[member] == 0
        new = flat_p.copy()
        states = {s: a.reshape(-1).copy() for s, a in st.items()}
        if "exp_avg" in states:  # Adam, AdamW
            g_ = flat_g * f(inv_scale)
            if opt.decoupled:
                new = new * (1.0 - lr_m * wd_d).astype(f)
            else:
                g_ = g_ + wd_m * new
            m, v = states["exp_avg"], states["exp_avg_sq"]
            m[:] = f(opt.beta1) * m + f(1.0 - opt.beta1) * g_
            v[:] = f(opt.beta2) * v + f(1.0 - opt.beta2) * g_ * g_
            bc1, bc2 = f(1.0 - opt.beta1**t_now), f(1.0 - opt.beta2**t_now)
            new = new - lr_v * (m / bc1) / (np.sqrt(v / bc2) + f(opt.eps))
        else:  # SGD
            g_ = flat_g * f(inv_scale) + wd_m * new
            if "momentum" in states:
                buf = states["momentum"]
                buf[:] = f(opt.momentum) * buf + g_
                g_ = g_ + f(opt.momentum) * buf if opt.nesterov else buf.copy()
            new = new - lr_v * g_
        flat_p[live] = new[live]
        for s, a in st.items():
            a.reshape(-1)[live] = states[s][live]


@pytest.mark.parametrize("name", ["sgd", "nesterov", "adam", "adamw"])
def test_the_kernels_per_member_arithmetic_is_the_cpus_member_by_member_update(name: str) -> None:
    rng = np.random.default_rng(4)
    cfg = OptimizerConfig(name="sgd" if name == "nesterov" else name, lr=BASE_LR, momentum=0.9, weight_decay=0.5)
    cfg.nesterov = name == "nesterov"
    start = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    params = [Param(f"w{i}", w.copy(), np.float32) for i, w in enumerate(start)]
    opt = make_optimizer(cfg, params)
    opt.members = MemberSettings(np, BASE_LR, LRS, DECAYS)
    ref = {
        p.name: (w.copy(), None, {s: np.zeros_like(w) for s in opt.state_names})
        for p, w in zip(params, start, strict=True)
    }
    for step, lr in enumerate([0.01, 0.008, 0.003]):  # the schedule's rate of each step (at optimizer.lr)
        if step == 2:
            opt.members.freeze(1)
        grads = {p.name: rng.standard_normal(p.value.shape).astype(np.float32) * 8 for p in params}
        ref = {n: (w, grads[n], st) for n, (w, _, st) in ref.items()}
        kernel_reference(opt, ref, opt.members, lr, 0.125)  # (reads opt.t before the step counts)
        opt.members.lr = [lr * b / BASE_LR for b in LRS]  # what the trainer sets: each member's rate of this step
        for p in params:
            p.grad = grads[p.name]
        opt.step(np.asarray(lr), inv_scale=np.asarray(0.125))
    for p, w0 in zip(params, start, strict=True):
        w, _, st = ref[p.name]
        np.testing.assert_allclose(p.value, w, rtol=2e-6, atol=1e-7, err_msg=p.name)
        for s, a in st.items():
            np.testing.assert_allclose(opt.state[p.name][s], a, rtol=2e-6, atol=1e-7, err_msg=f"{p.name}/{s}")
        assert not np.array_equal(p.value[0], w0[0]) and not np.array_equal(p.value[1], w0[1])  # (they trained)
    frozen_before = {n: w[1].copy() for n, (w, _, _) in ref.items()}
    opt.step(np.asarray(0.01), inv_scale=np.asarray(0.125))  # member 1 frozen: nothing of it moves
    for p in params:
        np.testing.assert_array_equal(p.value[1], frozen_before[p.name])
