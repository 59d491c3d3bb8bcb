"""The NumPy epilog contract as an oracle: at least as exact as cuBLASLt, as strict as nvmath.

The cases nvmath-python's own epilog tests cover (test_epilog.py, test_matmul_with_hypothesis.py)
that the first contract tests did not: wide accumulators in the bias-gradient reductions, stride
checks, M, N or K = 1, odd M, bias shaped (M, 1), relu_aux from a real forward pass and with random
padding bits, float16 and bfloat16 through every epilog, the two roundings of the bias epilogs in
half precision, relu'(0) = 1, and random shape sweeps, each against an independent float64 formula.
"""

import ml_dtypes
import numpy as np
import pytest

from mlptrain.nn.epilogs import Epilog, matmul, pack_relu_mask, relu_aux_shape, unpack_relu_mask

BF16 = np.dtype(ml_dtypes.bfloat16)
HALF = [np.dtype(np.float16), BF16]


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _ref_product(a, b):
    """The product as the contract defines it: float64 here, rounded once to the inputs' dtype."""
    return (_f64(a) @ _f64(b)).astype(a.dtype).astype(np.float64)


def test_drelu_bgrad_of_3000_ones_in_float16_is_3000():
    """Summed in float16 the row sum stops at 2048 (2048 + 1 rounds back to 2048); cuBLASLt reduces in float32."""
    a = np.full((2, 2), 0.5, np.float16)
    b = np.ones((2, 3000), np.float16)
    aux = pack_relu_mask(np.ones((2, 3000), bool))
    _, out = matmul(a, b, epilog=Epilog.DRELU_BGRAD, epilog_inputs={"relu_aux": aux})
    assert out["drelu_bgrad"].dtype == np.float16
    np.testing.assert_array_equal(out["drelu_bgrad"], np.float16(3000))


def test_float32_row_sums_over_65536_columns_stay_within_nvmaths_tolerance():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((4, 65536)).astype(np.float32)
    mask = rng.random((3, 65536)) > 0.3
    d, out = matmul(a, b, epilog=Epilog.DRELU_BGRAD, epilog_inputs={"relu_aux": pack_relu_mask(mask)})
    want = (_f64(d) * mask).sum(axis=1)  # the sum of the very values D holds, in float64
    err = np.abs(_f64(out["drelu_bgrad"]) - want).max() / np.abs(want).max()
    assert err < 1e-7, err  # a float32 accumulator gives about 1e-4 here; one rounding of the result, 6e-8


@pytest.mark.parametrize("dtype", HALF)
def test_bgrada_and_bgradb_accumulate_wide_in_half_precision(dtype):
    a = np.ones((3, 5000), dtype)
    b = np.ones((5000, 4), dtype)
    _, out_a = matmul(a, b, epilog=Epilog.BGRADA)
    _, out_b = matmul(a, b, epilog=Epilog.BGRADB)
    np.testing.assert_array_equal(_f64(out_a["bgrada"]), _f64(np.array([5000] * 3).astype(dtype)))
    np.testing.assert_array_equal(_f64(out_b["bgradb"]), _f64(np.array([5000] * 4).astype(dtype)))


def test_epilog_inputs_with_a_stride_along_m_are_refused_as_nvmath_does():
    a, b = np.ones((30, 4), np.float32), np.ones((4, 6), np.float32)
    with pytest.raises(ValueError, match="bias with unit stride along M"):
        matmul(a, b, epilog=Epilog.BIAS, epilog_inputs={"bias": np.ones(60, np.float32)[::2]})
    c_order = np.ascontiguousarray(pack_relu_mask(np.ones((30, 6), bool)))  # (16, 6), strides (6, 1)
    with pytest.raises(ValueError, match="relu_aux with unit stride along M"):
        matmul(a, b, epilog=Epilog.DRELU, epilog_inputs={"relu_aux": c_order})
    # the layouts cuBLASLt writes and reads pass: a (M,) or (M, 1) bias, a column-major mask
    matmul(a, b, epilog=Epilog.BIAS, epilog_inputs={"bias": np.ones((30, 1), np.float32)})
    matmul(a, b, epilog=Epilog.DRELU, epilog_inputs={"relu_aux": pack_relu_mask(np.ones((30, 6), bool))})


@pytest.mark.parametrize(("dtype", "tiny"), [(np.dtype(np.float16), 2.0**-13), (BF16, 2.0**-10)])
def test_bias_epilogs_round_twice_in_half_precision_as_the_h200_does(dtype, tiny):
    """A@B = 1 - tiny rounds to 1 in the half dtype; adding bias -1 then gives exactly 0, so the
    mask bit is set. One rounding of A@B + bias would give -tiny and a clear bit. cuBLASLt's
    RELU_AUX_BIAS sets it (measured on the H200, issue #17; tests/gpu/test_gemm.py holds the GPU to it)."""
    a = np.array([[1.0, -tiny]]).astype(dtype)
    b = np.array([[1.0], [1.0]]).astype(dtype)
    bias = np.array([-1.0]).astype(dtype)
    d, aux = matmul(a, b, epilog=Epilog.RELU_AUX_BIAS, epilog_inputs={"bias": bias})
    assert unpack_relu_mask(aux["relu_aux"], 1)[0, 0]
    assert _f64(d)[0, 0] == 0.0
    d = matmul(a, b, epilog=Epilog.BIAS, epilog_inputs={"bias": bias})
    assert _f64(d)[0, 0] == 0.0


def test_relu_derivative_at_exactly_zero_is_one_on_the_cpu_engines():
    """relu'(0) = 1 (the mask is Z >= 0, as cuBLASLt's); PyTorch's is 0. Both CPU paths agree."""
    from mlptrain.nn.execution import FusedExecution, NaiveExecution, NumpyGemm

    W = np.array([[1.0, -1.0], [2.0, 0.5]])  # (out 2, in 2)
    b = np.zeros(2)
    x = np.array([[1.0, 1.0], [1.0, -4.0]])  # row 0: z = (0, 2.5); row 1: z = (5, 0)
    for ex in (FusedExecution(NumpyGemm()), NaiveExecution(NumpyGemm(), np)):
        y, mask = ex.forward("t", W, b, x, activation="relu")
        np.testing.assert_array_equal(y, [[0.0, 2.5], [5.0, 0.0]])
        dz_above = np.ones((2, 3))
        W_above = np.ones((3, 2))
        dx, db = ex.input_grad("u", W_above, dz_above, mask, bias_grad_below=True)
        np.testing.assert_array_equal(dx, np.full((2, 2), 3.0))  # every unit passes, the two at z = 0 too
        np.testing.assert_array_equal(db, [6.0, 6.0])


@pytest.mark.parametrize(("m", "k", "n"), [(1, 5, 7), (13, 1, 9), (13, 6, 1), (1, 2, 1), (17, 3, 5), (129, 8, 3)])
@pytest.mark.parametrize("dtype", [np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), BF16])
def test_every_epilog_at_degenerate_and_odd_shapes(m, k, n, dtype):
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    bias = rng.standard_normal((m, 1)).astype(dtype)  # (M, 1) as nvmath also takes it
    p = _ref_product(a, b)
    z = (p.astype(dtype) + bias.astype(dtype)).astype(np.float64)  # the two roundings
    tol = {8: 1e-12, 4: 1e-6}.get(dtype.itemsize, 0.0)  # half: exact to the formula's roundings
    d, aux = matmul(a, b, epilog=Epilog.RELU_AUX_BIAS, epilog_inputs={"bias": bias})
    assert d.dtype == dtype and d.flags.f_contiguous
    np.testing.assert_allclose(_f64(d), np.maximum(z, 0), rtol=tol, atol=tol)
    np.testing.assert_array_equal(unpack_relu_mask(aux["relu_aux"], m), z >= 0)
    # the mask of a real forward pass, with random padding bits (cuBLASLt leaves them undefined)
    relu_aux = aux["relu_aux"].copy(order="F")
    mb = relu_aux_shape(m, n)[0]
    pad = np.zeros((mb * 8, n), bool)
    pad[m:] = True  # the bits past M in each column
    relu_aux |= rng.integers(0, 256, (mb, n), dtype=np.uint8) & pack_relu_mask(pad)
    assert (relu_aux != aux["relu_aux"]).any() or m == mb * 8
    np.testing.assert_array_equal(unpack_relu_mask(relu_aux, m), z >= 0)
    if k > 1:  # cuBLASLt's dReLU epilogs reject K = 1
        g, out = matmul(a, b, epilog=Epilog.DRELU_BGRAD, epilog_inputs={"relu_aux": relu_aux})
        want = p * (z >= 0)
        np.testing.assert_allclose(_f64(g), want, rtol=tol, atol=tol)
        sums = want.sum(axis=1).astype(dtype).astype(np.float64)
        np.testing.assert_allclose(_f64(out["drelu_bgrad"]), sums, rtol=max(tol, 1e-12), atol=max(tol, 1e-12))
    _, out = matmul(a, b, epilog=Epilog.BGRADB)
    np.testing.assert_array_equal(_f64(out["bgradb"]), _f64(b).sum(axis=0).astype(dtype).astype(np.float64))
    _, out = matmul(a, b, epilog=Epilog.BGRADA)
    np.testing.assert_array_equal(_f64(out["bgrada"]), _f64(a).sum(axis=1).astype(dtype).astype(np.float64))


def test_random_shape_sweep_against_float64():
    rng = np.random.default_rng(7)
    for _ in range(40):
        m, k, n = (int(v) for v in rng.integers(1, 70, 3))
        dtype = [np.dtype(np.float32), np.dtype(np.float64)][int(rng.integers(0, 2))]
        a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
        bias = rng.standard_normal(m).astype(dtype)
        z = _f64(a) @ _f64(b) + _f64(bias)[:, None]
        tol = 1e-11 if dtype == np.float64 else 2e-5 * max(1.0, np.abs(z).max())
        d, aux = matmul(a, b, epilog=Epilog.RELU_AUX_BIAS, epilog_inputs={"bias": bias})
        np.testing.assert_allclose(_f64(d), np.maximum(z, 0), atol=tol)
        mask = unpack_relu_mask(aux["relu_aux"], m)
        np.testing.assert_array_equal(mask[np.abs(z) > tol], (z >= 0)[np.abs(z) > tol])
