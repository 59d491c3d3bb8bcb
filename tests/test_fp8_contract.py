"""The FP8 epilog contract (mlptrain.nn.epilogs_fp8) against float64 formulas applied to the rounded operands."""

import ml_dtypes
import numpy as np
import pytest

from mlptrain.nn.epilogs import Epilog, gelu, gelu_aux_shape, gelu_grad, pack_relu_mask, unpack_relu_mask
from mlptrain.nn.epilogs_fp8 import FP8_EPILOGS, FP8_MAX, amax, dequantize, fits_fp8, matmul_fp8, quantize

BF16 = np.dtype(ml_dtypes.bfloat16)
BF16_EPS = 2.0**-8  # bfloat16 keeps 8 significant bits: one rounding is within half of this, relative


def test_quantize_rounds_to_nearest_even_as_the_hardware():
    # e4m3 in [1, 2) is spaced 1/8: 1.0625 and 1.1875 are ties, which go to the even mantissa
    x = np.array([1.0625, 1.1875, 1.3, -2.75], np.float32)
    q = quantize(x, 1.0, "e4m3").astype(np.float64)
    np.testing.assert_array_equal(q, [1.0, 1.25, 1.25, -2.75])
    # e5m2 in [1, 2) is spaced 1/4: 1.125 is a tie between 1.0 and 1.25
    np.testing.assert_array_equal(quantize(np.array([1.125, 1.375], np.float32), 1.0, "e5m2").astype(float), [1, 1.5])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_scales_and_saturates_and_keeps_non_finite_visible(fmt):
    top = FP8_MAX[fmt]
    x = np.array([3.0, 10 * top, -10 * top, np.inf, -np.inf, np.nan], np.float32)
    q = quantize(x, 0.5, fmt).astype(np.float64)
    assert q[0] == 1.5  # the scale multiplies before the cast
    assert q[1] == top and q[2] == -top  # saturated, not inf or NaN (plain casts give NaN/inf)
    assert np.isnan(q[3:]).all()  # inf and NaN reach the GEMM as NaN: the step will be skipped


def test_dequantize_and_amax():
    x = np.array([[0.3, -7.0], [2.0, 0.0]], np.float32)
    q = quantize(x, 4.0, "e4m3")
    np.testing.assert_allclose(dequantize(q, 0.25), x, rtol=2.0**-4)  # e4m3: 3 mantissa bits
    assert amax(x) == np.float32(7.0) and amax(x).dtype == np.float32
    assert np.isnan(amax(np.array([1.0, np.nan])))


def _operands(m, k, n, seed, b_fmt="e4m3"):
    """Rounded FP8 operands with non-trivial scales, and their float64 values."""
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((m, k)) * 3.0, rng.standard_normal((k, n)) * 0.01
    sa, sb = 448.0 / np.abs(a).max(), FP8_MAX[b_fmt] / np.abs(b).max() / 4
    a8, b8 = quantize(a.astype(np.float32), sa, "e4m3"), quantize(b.astype(np.float32), sb, b_fmt)
    a64 = a8.astype(np.float64) / np.float32(sa).astype(np.float64)
    b64 = b8.astype(np.float64) / np.float32(sb).astype(np.float64)
    return a8, b8, np.float32(1 / np.float32(sa)), np.float32(1 / np.float32(sb)), a64, b64


def _close(d, ref, scale):
    """Within two bfloat16 roundings of the float64 reference (the product, then the bias)."""
    np.testing.assert_allclose(d.astype(np.float64), ref, rtol=2 * BF16_EPS, atol=2 * BF16_EPS * scale)


@pytest.mark.parametrize("epilog", [e for e in FP8_EPILOGS if e is None or "BIAS" in e.name and "BGRAD" not in e.name])
def test_forward_epilogs_against_float64(epilog):
    m, k, n = 48, 64, 32
    a8, b8, ia, ib, a64, b64 = _operands(m, k, n, seed=1)
    bias = (np.random.default_rng(2).standard_normal(m) * 0.05).astype(BF16)
    inputs = {"bias": bias} if epilog is not None else {}
    out = matmul_fp8(a8, b8, scale_a_inv=ia, scale_b_inv=ib, epilog=epilog, epilog_inputs=inputs)
    d, aux = out if isinstance(out, tuple) else (out, {})
    z = a64 @ b64 + (bias.astype(np.float64)[:, None] if epilog is not None else 0)  # (M, N)
    assert d.dtype == BF16 and d.shape == (m, n)
    scale = np.abs(z).max()
    if epilog is None or epilog is Epilog.BIAS:
        _close(d, z, scale)
    elif epilog in (Epilog.RELU_BIAS, Epilog.RELU_AUX_BIAS):
        _close(d, np.maximum(z, 0), scale)
    else:
        _close(d, gelu(z), scale)
    if epilog is not None:
        assert d.flags.f_contiguous  # the bias epilogs write D column-major
    if epilog is Epilog.RELU_AUX_BIAS:
        clear = np.abs(z) > 4 * BF16_EPS * scale  # away from 0, where the rounding cannot flip the sign
        np.testing.assert_array_equal(unpack_relu_mask(aux["relu_aux"], m)[clear], (z >= 0)[clear])
    if epilog is Epilog.GELU_AUX_BIAS:
        assert aux["gelu_aux"].shape == gelu_aux_shape(m, n) and aux["gelu_aux"].dtype == BF16
        _close(aux["gelu_aux"][:m], z, scale)  # the pre-activation itself


@pytest.mark.parametrize("epilog", [Epilog.DRELU, Epilog.DRELU_BGRAD, Epilog.DGELU, Epilog.DGELU_BGRAD])
def test_backward_epilogs_against_float64_with_an_e5m2_gradient(epilog):
    m, k, n = 32, 48, 64  # dX^T (in, B) = W^T (in, out) @ dZ^T (out, B)
    a8, b8, ia, ib, a64, b64 = _operands(m, k, n, seed=3, b_fmt="e5m2")
    rng = np.random.default_rng(4)
    prod = a64 @ b64
    if epilog in (Epilog.DRELU, Epilog.DRELU_BGRAD):
        mask = rng.random((m, n)) > 0.4
        inputs = {"relu_aux": pack_relu_mask(mask)}
        ref = prod * mask
    else:
        z = np.zeros(gelu_aux_shape(m, n), BF16, order="F")
        z[:m] = rng.standard_normal((m, n)).astype(BF16)
        inputs = {"gelu_aux": z}
        ref = prod * gelu_grad(z[:m].astype(np.float64))
    out = matmul_fp8(a8, b8, scale_a_inv=ia, scale_b_inv=ib, epilog=epilog, epilog_inputs=inputs)
    d, aux = out if isinstance(out, tuple) else (out, {})
    scale = np.abs(prod).max()
    _close(d, ref, scale)
    if epilog.name.endswith("BGRAD"):
        (db,) = aux.values()  # drelu_bgrad / dgelu_bgrad: row sums of D over N, in float32
        np.testing.assert_allclose(db.astype(np.float64), ref.sum(axis=1), rtol=4 * BF16_EPS, atol=n * BF16_EPS * scale)


def test_the_scales_multiply_the_accumulator():
    a8, b8, ia, ib, _, _ = _operands(16, 32, 16, seed=5)
    d1 = matmul_fp8(a8, b8, scale_a_inv=ia, scale_b_inv=ib).astype(np.float64)
    d8 = matmul_fp8(a8, b8, scale_a_inv=ia * 2, scale_b_inv=ib * 4).astype(np.float64)
    np.testing.assert_array_equal(d8, 8 * d1)  # powers of two: exact
    assert np.abs(d1).max() > 0


def test_what_cublaslt_refuses_in_fp8():
    a8, b8, ia, ib, _, _ = _operands(16, 32, 16, seed=6)
    with pytest.raises(ValueError, match="NOT_SUPPORTED"):
        matmul_fp8(a8, b8, scale_a_inv=ia, scale_b_inv=ib, epilog=Epilog.BGRADB)
    g8 = quantize(np.ones((16, 32), np.float32), 1.0, "e5m2")
    with pytest.raises(ValueError, match="e5m2 x e5m2"):
        matmul_fp8(g8, quantize(np.ones((32, 16), np.float32), 1.0, "e5m2"), scale_a_inv=1.0, scale_b_inv=1.0)
    with pytest.raises(ValueError, match="multiples of 16"):
        matmul_fp8(a8[:10], b8, scale_a_inv=ia, scale_b_inv=ib)
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
        matmul_fp8(a8.astype(np.float32), b8, scale_a_inv=ia, scale_b_inv=ib)
    assert fits_fp8(16, 32, 4096) and not fits_fp8(10, 256, 256)
