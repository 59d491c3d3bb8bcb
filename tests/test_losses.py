import numpy as np
import pytest

from mlptrain.nn.losses import mse, softmax_cross_entropy


def reference_ce(z, y):
    z = z.astype(np.float64)
    logp = z - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)) - z.max(1, keepdims=True)
    return -logp[np.arange(len(y)), y].mean(), np.exp(logp)


def test_cross_entropy_value_gradient_and_accuracy():
    rng = np.random.default_rng(0)
    z, y = rng.standard_normal((7, 5)), rng.integers(0, 5, 7)
    loss, d, correct = softmax_cross_entropy(z, y)
    ref, p = reference_ce(z, y)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-12)
    onehot = np.eye(5)[y]
    np.testing.assert_allclose(d, (p - onehot) / 7, rtol=1e-10, atol=1e-14)
    assert int(correct) == int((z.argmax(1) == y).sum())


def test_cross_entropy_is_stable_for_huge_logits():
    z = np.array([[1000.0, -1000.0, 0.0], [5e4, 5e4, -5e4]], dtype=np.float32)
    loss, d, _ = softmax_cross_entropy(z, np.array([1, 0]))
    assert np.isfinite(float(loss)) and np.isfinite(d).all()
    np.testing.assert_allclose(float(loss), (2000.0 + np.log(2)) / 2, rtol=1e-5)


def test_grad_scale_multiplies_the_gradient_only():
    rng = np.random.default_rng(1)
    z, y = rng.standard_normal((4, 3)), rng.integers(0, 3, 4)
    l1, d1, _ = softmax_cross_entropy(z, y)
    l2, d2, _ = softmax_cross_entropy(z, y, np.array(1024.0))
    assert float(l1) == float(l2)
    np.testing.assert_allclose(d2, d1 * 1024.0, rtol=1e-12)


@pytest.mark.parametrize("fn", [softmax_cross_entropy, mse])
def test_gradient_matches_finite_differences(fn):
    rng = np.random.default_rng(2)
    z, y = rng.standard_normal((3, 4)), np.array([3, 0, 1])
    _, d, _ = fn(z, y)
    num = np.zeros_like(z)
    for i in np.ndindex(z.shape):
        zp, zm = z.copy(), z.copy()
        zp[i] += 1e-6
        zm[i] -= 1e-6
        num[i] = (float(fn(zp, y)[0]) - float(fn(zm, y)[0])) / 2e-6
    np.testing.assert_allclose(d, num, rtol=1e-6, atol=1e-9)


def test_mse_value():
    z = np.array([[0.5, 0.0], [0.0, 2.0]])
    loss, _, _ = mse(z, np.array([0, 1]))
    assert float(loss) == pytest.approx((0.25 + 0 + 0 + 1.0) / 4)


@pytest.mark.parametrize("fn", [softmax_cross_entropy, mse])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("bias_grad", [False, True])
def test_inplace_writes_the_same_gradient_over_the_logits(fn, dtype, bias_grad):
    """The training step's loss writes dlogits over the logits: the same values, loss, count and sums."""
    rng = np.random.default_rng(5)
    z, y = (rng.standard_normal((9, 6)) * 3).astype(dtype), rng.integers(0, 6, 9)
    ref = fn(z.copy(), y, 8.0, bias_grad=bias_grad)
    logits = z.copy()
    out = fn(logits, y, 8.0, bias_grad=bias_grad, inplace=True)
    assert out[1] is logits, "the gradient is the logits' array"
    np.testing.assert_array_equal(logits, ref[1])
    assert not np.array_equal(logits, z)
    assert float(out[0]) == float(ref[0]) and int(out[2]) == int(ref[2]) == int((z.argmax(1) == y).sum())
    if bias_grad:
        np.testing.assert_array_equal(out[3], ref[3])
