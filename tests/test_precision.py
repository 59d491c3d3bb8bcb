import numpy as np
import pytest

from mlptrain.base.backend import get_backend
from mlptrain.base.errors import DeviceError
from mlptrain.step.precision import LossScaler, get_precision


def test_loss_scaler_follows_gradscaler_rules():
    s = LossScaler(np, enabled=True, init_scale=65536.0, growth_interval=3)
    seq = []
    for grad in [np.inf, 1.0, 1.0, 1.0, np.nan, 1.0]:
        found = s.check([np.array([1.0, grad]), np.ones(2)])
        s.update()
        seq.append((int(found), float(s.scale), int(s.consecutive_skips)))
    assert seq == [(1, 32768.0, 1), (0, 32768.0, 0), (0, 32768.0, 0), (0, 65536.0, 0), (1, 32768.0, 1), (0, 32768.0, 0)]
    assert float(s.inv_scale) == 1 / 32768.0


def test_disabled_scaler_is_identity():
    s = LossScaler(np, enabled=False)
    assert int(s.check([np.array([np.inf])])) == 0
    s.update()
    assert float(s.scale) == 1.0


def test_state_dict_round_trip():
    a = LossScaler(np, enabled=True, growth_interval=5)
    a.check([np.array([np.inf])])
    a.update()
    b = LossScaler(np, enabled=True, growth_interval=5)
    b.load_state_dict(a.state_dict())
    assert float(b.scale) == float(a.scale) == 32768.0 and float(b.inv_scale) == 1 / 32768.0


@pytest.mark.parametrize("name", ["fp16", "bf16", "tf32"])
def test_half_precision_on_the_cpu_says_what_to_do(name):
    with pytest.raises(DeviceError, match="precision=fp32 or fp64"):
        get_precision(name, get_backend("cpu"))


def test_cpu_precisions():
    cpu = get_backend("cpu")
    assert get_precision("fp64", cpu).compute_dtype == np.float64
    p = get_precision("fp32", cpu)
    assert p.param_dtype == p.compute_dtype == np.float32 and not p.loss_scaling
