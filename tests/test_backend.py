import numpy as np
import pytest

from mlptrain.base.backend import get_array_module, get_backend, probe_gpu, scalar
from mlptrain.base.errors import ConfigError, DeviceError


def test_cpu_backend_is_numpy():
    b = get_backend("cpu")
    assert b.xp is np and not b.is_gpu and b.to_host(np.ones(2)).sum() == 2
    assert get_array_module(np.ones(1)) is np


def test_unknown_device_names_the_choices():
    with pytest.raises(ConfigError, match="device='tpu'.*auto, cpu, gpu"):
        get_backend("tpu")


@pytest.mark.skipif(probe_gpu()[0], reason="a GPU is present")
def test_gpu_without_gpu_says_how_to_get_one():
    with pytest.raises(DeviceError) as info:
        get_backend("gpu")
    msg = str(info.value)
    assert "no usable CUDA GPU" in msg and "device=cpu" in msg and "cu12" in msg
    assert get_backend("auto").device == "cpu"


@pytest.mark.parametrize(("value", "dtype"), [(3, np.int64), (0.1, np.float64), (65536.0, np.float64)])
def test_scalar_is_a_writable_0d_array_of_the_dtype(value, dtype):
    a = scalar(np, value, dtype)
    assert a.shape == () and a.dtype == dtype and a == np.asarray(value, dtype)
    a[...] = 2  # the step's bookkeeping is updated in place
    assert a == 2
