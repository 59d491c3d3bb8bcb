"""The NumPy epilog contract against independent float64 references."""

import numpy as np
import pytest

from mlptrain.nn.epilogs import Epilog, matmul, pack_relu_mask, relu_aux_shape, unpack_relu_mask


@pytest.mark.parametrize(("m", "mb"), [(1, 16), (8, 16), (30, 16), (129, 32), (256, 32), (1000, 128), (65536, 8192)])
def test_relu_aux_shape_pads_bits_to_16_bytes(m, mb):
    assert relu_aux_shape(m, 7) == (mb, 7)


@pytest.mark.parametrize(("m", "n"), [(1, 1), (7, 3), (30, 5), (130, 9)])
def test_pack_matches_an_independent_bit_by_bit_reading(m, n):
    mask = np.random.default_rng(m * n).random((m, n)) > 0.5
    aux = pack_relu_mask(mask)
    mb = relu_aux_shape(m, n)[0]
    assert aux.dtype == np.uint8 and aux.shape == (mb, n)
    assert aux.strides == (1, mb)  # column-major, as cuBLASLt writes it
    raw = aux.T.tobytes()  # memory order: column j is bytes [j*mb, (j+1)*mb)
    for j in range(n):
        for i in range(mb * 8):
            bit = (raw[j * mb + i // 8] >> (i % 8)) & 1  # LSB first
            expected = int(mask[i, j]) if i < m else 0  # padding bits are zero here
            assert bit == expected, (i, j)
    np.testing.assert_array_equal(unpack_relu_mask(aux, m), mask)


def _ref(a, b):
    return a.astype(np.float64) @ b.astype(np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("m", "k", "n"), [(5, 3, 4), (33, 17, 9)])
def test_forward_epilogs(dtype, m, k, n):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    bias = rng.standard_normal(m).astype(dtype)
    z = _ref(a, b) + bias[:, None]
    tol = 1e-12 if dtype == np.float64 else 1e-5

    d = matmul(a, b, epilog=Epilog.BIAS, epilog_inputs={"bias": bias})
    assert d.dtype == dtype and d.flags.f_contiguous
    np.testing.assert_allclose(d, z, rtol=tol, atol=tol)

    d = matmul(a, b, epilog=Epilog.RELU_BIAS, epilog_inputs={"bias": bias})
    np.testing.assert_allclose(d, np.maximum(z, 0), rtol=tol, atol=tol)

    d, aux = matmul(a, b, epilog=Epilog.RELU_AUX_BIAS, epilog_inputs={"bias": bias})
    assert set(aux) == {"relu_aux"} and d.flags.f_contiguous
    np.testing.assert_allclose(d, np.maximum(z, 0), rtol=tol, atol=tol)
    np.testing.assert_array_equal(unpack_relu_mask(aux["relu_aux"], m), z >= 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_epilogs(dtype):
    rng = np.random.default_rng(1)
    m, k, n = 19, 6, 11
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    mask = rng.random((m, n)) > 0.4
    aux = pack_relu_mask(mask)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    g = _ref(a, b) * mask

    d = matmul(a, b, epilog=Epilog.DRELU, epilog_inputs={"relu_aux": aux})
    np.testing.assert_allclose(d, g, rtol=tol, atol=tol)

    d, out = matmul(a, b, epilog=Epilog.DRELU_BGRAD, epilog_inputs={"relu_aux": aux})
    np.testing.assert_allclose(d, g, rtol=tol, atol=tol)
    assert out["drelu_bgrad"].shape == (m,) and out["drelu_bgrad"].dtype == dtype
    np.testing.assert_allclose(out["drelu_bgrad"], g.sum(axis=1), rtol=tol, atol=tol)

    d, out = matmul(a, b, epilog=Epilog.BGRADA)
    np.testing.assert_allclose(out["bgrada"], a.astype(np.float64).sum(axis=1), rtol=tol, atol=tol)
    d, out = matmul(a, b, epilog=Epilog.BGRADB)
    assert out["bgradb"].shape == (n,) and d.flags.f_contiguous
    np.testing.assert_allclose(out["bgradb"], b.astype(np.float64).sum(axis=0), rtol=tol, atol=tol)
    np.testing.assert_allclose(d, _ref(a, b), rtol=tol, atol=tol)


def test_plain_gemm_follows_a_order():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((4, 3)), rng.standard_normal((3, 5))
    assert matmul(a, b).flags.c_contiguous
    assert matmul(np.asfortranarray(a), b).flags.f_contiguous
    np.testing.assert_allclose(matmul(np.asfortranarray(a), b), a @ b)


def test_half_inputs_are_computed_in_float32_and_rounded_once():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((8, 64)).astype(np.float16), rng.standard_normal((64, 8)).astype(np.float16)
    d = matmul(a, b)
    assert d.dtype == np.float16
    np.testing.assert_array_equal(d, (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16))


def test_bad_inputs_are_rejected_with_the_expected_shape():
    a, b = np.ones((30, 4)), np.ones((4, 6))
    with pytest.raises(ValueError, match=r"bias of shape \(30,\)"):
        matmul(a, b, epilog=Epilog.BIAS, epilog_inputs={"bias": np.ones(6)})
    with pytest.raises(ValueError, match=r"relu_aux of dtype uint8 and shape \(16, 6\)"):
        matmul(a, b, epilog=Epilog.DRELU, epilog_inputs={"relu_aux": np.zeros((16, 5), np.uint8)})
    with pytest.raises(ValueError, match="K=1"):
        matmul(
            np.ones((30, 1)),
            np.ones((1, 6)),
            epilog=Epilog.DRELU,
            epilog_inputs={"relu_aux": np.zeros((16, 6), np.uint8)},
        )
    with pytest.raises(ValueError, match="needs epilog_inputs"):
        matmul(a, b, epilog=Epilog.BIAS)
    with pytest.raises(ValueError, match=r"A \(M, K\) and B \(K, N\)"):
        matmul(a, np.ones((5, 6)))
