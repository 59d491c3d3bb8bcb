"""mlptrain.step.cuda.nonfinite: per-tensor inf/NaN flags from the exponent bits, every dtype in one module."""

import numpy as np
import pytest
from gpu_helpers import cp, np_dtype

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
def test_flags_exactly_the_tensors_with_inf_or_nan(name: str) -> None:
    from mlptrain.step.cuda.nonfinite import nonfinite_flags

    dt = np_dtype(name)
    rng = np.random.default_rng(0)
    shapes = [(3,), (1000, 7), (65537,), (4, 5), (300, 300), (1,)]
    host = [rng.standard_normal(s).astype(dt) for s in shapes]
    big = {"float16": 60000.0, "bfloat16": 3e38, "float32": 3e38, "float64": 1e300}[name]
    host[0][1] = big  # large but finite: not flagged
    host[1][999, 6] = np.inf  # the very last element
    host[2][12345] = np.nan
    host[4][0, 0] = -np.inf
    arrays = [cp.asarray(h) for h in host]
    arrays[3] = cp.asfortranarray(arrays[3])  # another layout, same memory extent
    assert nonfinite_flags(arrays) == [False, True, True, False, True, False]


def test_mixed_dtypes_keep_their_order() -> None:
    from mlptrain.step.cuda.nonfinite import nonfinite_flags

    a = cp.ones(10, cp.float32)
    b = cp.full(10, cp.nan, cp.float16)
    c = cp.ones((4, 4), cp.float64)[:, ::2]  # not contiguous: copied first
    c[1, 1] = cp.inf
    assert nonfinite_flags([a, b, c, a]) == [False, True, True, False]
