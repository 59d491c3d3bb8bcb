"""mlptrain.data.cuda.gather: the loader's batch gather, whole rows of any dtype, against NumPy's take."""

import numpy as np
import pytest
from gpu_helpers import cp

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((1294, 64), np.float32),  # digits' features: 256-byte rows, 16-byte units
        ((1294,), np.int64),  # class labels: 8-byte rows
        ((500, 3), np.float32),  # regression targets: 12-byte rows, 4-byte units
        ((500, 7), np.float16),  # 14-byte rows, 2-byte units
        ((300, 5), np.uint8),  # 5-byte rows, 1-byte units
        ((200, 4, 3), np.float64),  # rows of more than one axis
    ],
)
def test_take_rows_equals_numpy_take(shape, dtype):
    from mlptrain.data.cuda.gather import take_rows

    rng = np.random.default_rng(1)
    host = (rng.standard_normal(shape) * 100).astype(dtype)
    idx = rng.permutation(shape[0])[:197].astype(np.int64)  # a batch with repeats of nothing, any order
    idx[-1] = idx[0]  # and a row taken twice
    src, d_idx = cp.asarray(host), cp.asarray(idx)
    want = np.take(host, idx, axis=0)
    np.testing.assert_array_equal(cp.asnumpy(take_rows(src, d_idx)), want)
    out = cp.full(want.shape, 7, dtype)  # into given buffers, as the graph's inputs
    assert take_rows(src, d_idx, out) is out
    np.testing.assert_array_equal(cp.asnumpy(out), want)


def test_rows_at_odd_addresses_use_narrower_units():
    from mlptrain.data.cuda.gather import take_rows

    raw = cp.arange(4 * 65, dtype=cp.float32)
    src = raw[4:].reshape(64, 4)  # 16-byte rows starting 16 bytes in: still aligned
    odd = cp.arange(1 + 64 * 16, dtype=cp.uint8)[1:].reshape(64, 16)  # 16-byte rows at an odd address
    idx = cp.asarray(np.arange(63, -1, -1, dtype=np.int64))
    np.testing.assert_array_equal(cp.asnumpy(take_rows(src, idx)), cp.asnumpy(src)[::-1])
    np.testing.assert_array_equal(cp.asnumpy(take_rows(odd, idx)), cp.asnumpy(odd)[::-1])
    eight = cp.arange(2 + 64 * 4, dtype=cp.float32)[2:].reshape(64, 4)  # 16-byte rows, 8-byte aligned only
    np.testing.assert_array_equal(cp.asnumpy(take_rows(eight, idx)), cp.asnumpy(eight)[::-1])
    out = cp.zeros(1 + 64 * 16, dtype=cp.uint8)[1:].reshape(64, 16)  # an output at an odd address
    take_rows(raw[:256].view(cp.uint8).reshape(64, 16), idx, out)
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(raw[:256].view(cp.uint8).reshape(64, 16))[::-1])


def test_bad_buffers_are_refused():
    from mlptrain.data.cuda.gather import take_rows

    src, idx = cp.zeros((10, 4), cp.float32), cp.arange(3, dtype=cp.int64)
    with pytest.raises(ValueError, match="out float64 must be"):
        take_rows(src, idx, cp.zeros((3, 4), cp.float64))
    with pytest.raises(ValueError, match=r"out \(3, 4\)"):
        take_rows(src, idx, cp.zeros((4, 4), cp.float32))
    with pytest.raises(ValueError, match="contiguous int64"):
        take_rows(src, idx.astype(cp.int32))
    with pytest.raises(ValueError, match="C-contiguous"):
        take_rows(cp.asfortranarray(src), idx)  # the loader stores its arrays in C order
    assert take_rows(src, cp.zeros(0, cp.int64)).shape == (0, 4)  # a rank with no rows of a short batch


@pytest.mark.parametrize(("shape", "dtype"), [((1294, 64), np.float32), ((1294,), np.int64), ((500, 7), np.float16)])
def test_take_rows_at_reads_the_batch_of_the_device_step_count(shape, dtype):
    """The gather of a step that gathers its own batch: rows order[(step - base) * batch + offset + r]."""
    from mlptrain.data.cuda.gather import take_rows_at

    rng = np.random.default_rng(2)
    host = (rng.standard_normal(shape) * 100).astype(dtype)
    order = rng.permutation(shape[0]).astype(np.int64)
    src, d_order = cp.asarray(host), cp.asarray(order)
    step, base = cp.asarray(np.array(7, np.int64)), cp.asarray(np.array([4], np.int64))  # batch 3 of the epoch
    out = cp.zeros((50, *shape[1:]), dtype)
    assert take_rows_at(src, d_order, out, step, base, batch=64, offset=5) is out
    np.testing.assert_array_equal(cp.asnumpy(out), host[order[3 * 64 + 5 : 3 * 64 + 55]])
    step += 1  # the next step: the next batch, with the same kernel arguments
    take_rows_at(src, d_order, out, step, base, batch=64, offset=5)
    np.testing.assert_array_equal(cp.asnumpy(out), host[order[4 * 64 + 5 : 4 * 64 + 55]])


def test_take_rows_at_wraps_past_the_end_of_the_order():
    from mlptrain.data.cuda.gather import take_rows_at

    host = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    order = np.arange(10)[::-1].astype(np.int64)
    out = cp.zeros((4, 3), cp.float32)
    step, base = cp.asarray(np.array(2, np.int64)), cp.asarray(np.array([0], np.int64))  # rows 8..11: 8, 9, 0, 1
    take_rows_at(cp.asarray(host), cp.asarray(order), out, step, base, batch=4)
    np.testing.assert_array_equal(cp.asnumpy(out), host[order[[8, 9, 0, 1]]])
