"""The GELU epilogs of the NumPy contract against independent float64 formulas (issue #17).

The references here do not share code with mlptrain.nn.epilogs: GELU through the logistic function
(``0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u))``) and its derivative by central differences.
"""

import ml_dtypes
import numpy as np
import pytest

from mlptrain.nn.epilogs import Epilog, gelu_aux_shape, matmul

C = np.sqrt(2.0 / np.pi)
BF16 = np.dtype(ml_dtypes.bfloat16)


def ref_gelu(z):
    z = np.asarray(z, np.float64)
    return z / (1.0 + np.exp(-2.0 * C * (z + 0.044715 * z**3)))


def ref_gelu_grad(z, h=1e-5):
    z = np.asarray(z, np.float64)
    return (ref_gelu(z + h) - ref_gelu(z - h)) / (2 * h)


def _f64(x):
    return np.asarray(x).astype(np.float64)


@pytest.mark.parametrize(("m", "mp"), [(1, 8), (8, 8), (13, 16), (1000, 1000), (1001, 1008)])
def test_gelu_aux_is_padded_to_a_multiple_of_8_rows(m, mp):
    assert gelu_aux_shape(m, 5) == (mp, 5)


@pytest.mark.parametrize("dtype", [np.dtype(np.float64), np.dtype(np.float32)])
@pytest.mark.parametrize(("m", "k", "n"), [(13, 7, 9), (1, 3, 4), (16, 2, 1)])
def test_gelu_forward_epilogs(dtype, m, k, n):
    rng = np.random.default_rng(m + 10 * k + 100 * n)
    a, b = rng.standard_normal((m, k)).astype(dtype), 2 * rng.standard_normal((k, n)).astype(dtype)
    bias = rng.standard_normal(m).astype(dtype)
    z = _f64(a) @ _f64(b) + _f64(bias)[:, None]
    tol = 1e-12 if dtype == np.float64 else 2e-6

    d = matmul(a, b, epilog=Epilog.GELU_BIAS, epilog_inputs={"bias": bias})
    assert d.dtype == dtype and d.flags.f_contiguous and d.shape == (m, n)
    np.testing.assert_allclose(_f64(d), ref_gelu(z), rtol=tol, atol=tol)

    d, aux = matmul(a, b, epilog=Epilog.GELU_AUX_BIAS, epilog_inputs={"bias": bias})
    np.testing.assert_allclose(_f64(d), ref_gelu(z), rtol=tol, atol=tol)
    g = aux["gelu_aux"]  # the pre-activation Z, (round_up(M, 8), N), column-major, D's dtype
    assert set(aux) == {"gelu_aux"} and g.shape == gelu_aux_shape(m, n) and g.dtype == dtype
    assert g.flags.f_contiguous
    np.testing.assert_allclose(_f64(g[:m]), z, rtol=tol, atol=tol)

    d = matmul(a, b, epilog=Epilog.GELU)
    np.testing.assert_allclose(_f64(d), ref_gelu(_f64(a) @ _f64(b)), rtol=tol, atol=tol)
    d, aux = matmul(a, b, epilog=Epilog.GELU_AUX)
    np.testing.assert_allclose(_f64(aux["gelu_aux"][:m]), _f64(a) @ _f64(b), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.dtype(np.float64), np.dtype(np.float32)])
def test_dgelu_epilogs_apply_the_derivative_at_the_saved_pre_activation(dtype):
    rng = np.random.default_rng(5)
    m, k, n = 21, 6, 17
    # the forward of the layer below: its pre-activation Z (m, n) saved by GELU_AUX_BIAS
    x, w = rng.standard_normal((m, 4)).astype(dtype), 2 * rng.standard_normal((4, n)).astype(dtype)
    _, aux = matmul(x, w, epilog=Epilog.GELU_AUX_BIAS, epilog_inputs={"bias": np.zeros(m, dtype)})
    z = _f64(aux["gelu_aux"][:m])
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    want = (_f64(a) @ _f64(b)) * ref_gelu_grad(z)
    tol = 1e-9 if dtype == np.float64 else 5e-6  # the central difference is good to about 1e-10

    d = matmul(a, b, epilog=Epilog.DGELU, epilog_inputs={"gelu_aux": aux["gelu_aux"]})
    assert d.dtype == dtype and d.flags.f_contiguous
    np.testing.assert_allclose(_f64(d), want, rtol=tol, atol=tol)
    d, out = matmul(a, b, epilog=Epilog.DGELU_BGRAD, epilog_inputs={"gelu_aux": aux["gelu_aux"]})
    assert out["dgelu_bgrad"].shape == (m,) and out["dgelu_bgrad"].dtype == dtype
    np.testing.assert_allclose(_f64(out["dgelu_bgrad"]), want.sum(axis=1), rtol=tol, atol=tol * n)


def test_gelu_derivative_formula_against_central_differences_over_a_wide_range():
    from mlptrain.nn.epilogs import gelu, gelu_grad

    z = np.linspace(-12, 12, 4001)
    np.testing.assert_allclose(gelu(z), ref_gelu(z), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(gelu_grad(z), ref_gelu_grad(z), rtol=1e-8, atol=1e-9)
    mid = z[np.abs(z) <= 5]  # the tanh form of cuBLASLt's documentation, where its cancellation is small
    tanh_form = 0.5 * mid * (1 + np.tanh(C * (mid + 0.044715 * mid**3)))
    np.testing.assert_allclose(gelu(mid), tanh_form, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16])
def test_gelu_in_half_precision_rounds_the_product_the_bias_sum_and_the_activation(dtype):
    rng = np.random.default_rng(9)
    m, k, n = 11, 8, 300
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    bias = rng.standard_normal(m).astype(dtype)
    p = (_f64(a) @ _f64(b)).astype(np.float32).astype(dtype)  # computed in float32, rounded once
    z = (p + bias[:, None]).astype(dtype)  # the bias added in D's dtype: a second rounding
    d, aux = matmul(a, b, epilog=Epilog.GELU_AUX_BIAS, epilog_inputs={"bias": bias})
    np.testing.assert_array_equal(_f64(aux["gelu_aux"][:m]), _f64(z))
    np.testing.assert_array_equal(_f64(d), _f64(ref_gelu(_f64(z)).astype(dtype)))
    # DGELU_BGRAD's row sums over 300 columns accumulate wide and round once
    g, out = matmul(a, b, epilog=Epilog.DGELU_BGRAD, epilog_inputs={"gelu_aux": aux["gelu_aux"]})
    sums = _f64(g).sum(axis=1)
    np.testing.assert_allclose(_f64(out["dgelu_bgrad"]), sums, rtol=2 ** -(8 if dtype == BF16 else 11))


def test_bad_gelu_inputs_are_refused_with_what_was_expected():
    a, b = np.ones((13, 4), np.float32), np.ones((4, 6), np.float32)
    good = np.zeros(gelu_aux_shape(13, 6), np.float32, order="F")
    with pytest.raises(ValueError, match=r"gelu_aux of dtype float32 and shape \(16, 6\)"):
        matmul(a, b, epilog=Epilog.DGELU, epilog_inputs={"gelu_aux": np.zeros((13, 6), np.float32, order="F")})
    with pytest.raises(ValueError, match=r"gelu_aux of dtype float32"):
        matmul(a, b, epilog=Epilog.DGELU, epilog_inputs={"gelu_aux": good.astype(np.float64)})
    with pytest.raises(ValueError, match="gelu_aux with unit stride along M"):
        matmul(a, b, epilog=Epilog.DGELU, epilog_inputs={"gelu_aux": np.ascontiguousarray(good)})
    with pytest.raises(ValueError, match="K=1"):
        matmul(
            np.ones((13, 1), np.float32),
            np.ones((1, 6), np.float32),
            epilog=Epilog.DGELU_BGRAD,
            epilog_inputs={"gelu_aux": good},
        )
    with pytest.raises(ValueError, match="needs epilog_inputs"):
        matmul(a, b, epilog=Epilog.GELU_AUX_BIAS)
