"""Optimizer updates against hand-computed values; schedules; state dicts."""

import math

import numpy as np
import pytest

from mlptrain.base.errors import ConfigError
from mlptrain.nn.layers import Param
from mlptrain.step.optim import SGD, Adam
from mlptrain.step.schedule import lr_at


def one_param(value=1.0, grad=0.5):
    p = Param("w", np.array([value]), np.float64)
    p.grad = np.array([grad])
    return p


def run(opt, p, steps, lr=0.1, grad=0.5):
    for _ in range(steps):
        p.grad = np.array([grad])
        opt.step(np.array(lr))
    return float(p.value[0])


def test_sgd_momentum_weight_decay_by_hand():
    p = one_param()
    opt = SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    assert run(opt, p, 1) == pytest.approx(0.949, abs=1e-15)  # g=0.51, buf=0.51
    # g = 0.5 + 0.01 * 0.949 = 0.50949, buf = 0.9 * 0.51 + 0.50949 = 0.96849
    assert run(opt, p, 1) == pytest.approx(0.949 - 0.1 * 0.96849, abs=1e-15)


def test_sgd_nesterov_by_hand():
    p = one_param()
    opt = SGD([p], lr=0.1, momentum=0.9, nesterov=True)
    assert run(opt, p, 1) == pytest.approx(1 - 0.1 * (0.5 + 0.9 * 0.5), abs=1e-15)


def test_plain_sgd_has_no_state():
    p = one_param()
    opt = SGD([p], lr=0.1)
    assert run(opt, p, 2) == pytest.approx(0.9, abs=1e-15)
    assert opt.state["w"] == {}


def test_adam_bias_correction_by_hand():
    p = one_param()
    opt = Adam([p], lr=0.1)
    # step 1: m_hat = 0.5, v_hat = 0.25 exactly; step 2 too (constant gradient)
    assert run(opt, p, 1) == pytest.approx(1 - 0.1 * 0.5 / (0.5 + 1e-8), abs=1e-14)
    assert run(opt, p, 1) == pytest.approx(1 - 0.2 * 0.5 / (0.5 + 1e-8), abs=1e-14)
    assert float(opt.t) == 2


def test_adam_l2_versus_adamw_decoupled():
    p = one_param()
    assert run(Adam([p], lr=0.1, weight_decay=0.1), p, 1) == pytest.approx(1 - 0.1 * 0.6 / (0.6 + 1e-8), abs=1e-14)
    p = one_param()
    assert run(Adam([p], lr=0.1, weight_decay=0.1, decoupled=True), p, 1) == pytest.approx(
        0.99 - 0.1 * 0.5 / (0.5 + 1e-8), abs=1e-14
    )


def test_inverse_scale_and_skip():
    p = one_param(grad=512.0)
    opt = SGD([p], lr=0.1, momentum=0.9)
    opt.step(np.array(0.1), inv_scale=np.array(1 / 1024), skip=np.array(1, np.int32))
    assert float(p.value[0]) == 1.0 and float(opt.t) == 0  # skipped: nothing changes
    opt.step(np.array(0.1), inv_scale=np.array(1 / 1024), skip=np.array(0, np.int32))
    assert float(p.value[0]) == pytest.approx(1 - 0.1 * 0.5, abs=1e-15)


def test_state_dict_round_trip_continues_identically():
    a, b = one_param(), one_param()
    oa, ob = Adam([a], lr=0.1), Adam([b], lr=0.1)
    run(oa, a, 3, grad=0.3)
    ob.load_state_dict(oa.state_dict())
    b.value[...] = a.value
    assert run(oa, a, 2, grad=-0.2) == run(ob, b, 2, grad=-0.2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0.0}, "lr=0.0 must be positive"),
        ({"lr": 0.1, "momentum": 1.5}, "momentum=1.5"),
        ({"lr": 0.1, "nesterov": True}, "nesterov"),
    ],
)
def test_bad_sgd_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SGD([one_param()], **kwargs)


def test_schedules():
    kw = {"base_lr": 1.0, "total_steps": 11}
    assert lr_at(0, schedule="constant", **kw) == 1.0
    assert [lr_at(s, schedule="constant", warmup_steps=4, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(0, schedule="cosine", **kw) == 1.0
    assert lr_at(5, schedule="cosine", **kw) == pytest.approx(0.5)
    assert lr_at(10, schedule="cosine", **kw) == pytest.approx(0.0, abs=1e-15)
    assert lr_at(10, schedule="cosine", min_ratio=0.1, **kw) == pytest.approx(0.1)
    assert lr_at(3, schedule="cosine", warmup_steps=1, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi * 2 / 9)))
