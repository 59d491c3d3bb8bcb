"""cuBLASLt's GELU epilogs (through mlptrain.nn.cuda.gemm) against the NumPy epilog contract, the oracle
cases of issue #17 on the hardware, and GELU models trained on the GPU."""

import copy

import numpy as np
import pytest
from gpu_helpers import DTYPES, HAS_GPU, close, cp, f64, graph_run, np_dtype, rand

from mlptrain.nn.epilogs import Epilog, gelu, gelu_aux_shape, gelu_grad, matmul, pack_relu_mask, unpack_relu_mask

pytestmark = pytest.mark.gpu

if HAS_GPU:
    from mlptrain.nn.cuda.gemm import NvmathGemm

SHAPES = [(37, 19, 23), (128, 256, 64), (1000, 784, 256), (9, 130, 8)]  # (M, K, N): M not a multiple of 8 too
# cuBLASLt's GELU is held to the same tolerances as its ReLU epilogs (gpu_helpers.TOL: 1e-5 of the
# largest value in float32); a wrong formula is far outside them: the erf form of GELU differs from
# the tanh form by up to 4.7e-4, a wrong derivative by order 1e-1.


def _operands(rng, m, k, n, dtype):
    W = rand(rng, (m, k), dtype)  # (M, K) C-order, a layer's weight
    xT = rand(rng, (n, k), dtype).T  # (K, N): the F-order view of a (N, K) batch, as layers pass it
    bias = rand(rng, (m,), dtype)
    return W, xT, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_gelu_forward_epilogs_match_the_contract(m, k, n, dtype):
    rng = np.random.default_rng(m + 3 * k + n)
    W, xT, bias = _operands(rng, m, k, n, dtype)
    gemm = NvmathGemm()
    gW, gx, gb = cp.asarray(W), cp.asarray(xT.T).T, cp.asarray(bias)
    z = f64(W) @ f64(xT) + f64(bias)[:, None]  # (M, N) in float64
    for epilog, inputs in (
        (Epilog.GELU, {}),
        (Epilog.GELU_AUX, {}),
        (Epilog.GELU_BIAS, {"bias": gb}),
        (Epilog.GELU_AUX_BIAS, {"bias": gb}),
    ):
        d, aux = gemm(f"t.{epilog.name}", gW, gx, epilog, **inputs)
        want_z = z if "bias" in inputs else f64(W) @ f64(xT)
        ref = matmul(W, xT, epilog=epilog, epilog_inputs={k_: cp.asnumpy(v) for k_, v in inputs.items()})
        ref, ref_aux = ref if isinstance(ref, tuple) else (ref, {})  # a tuple only where the epilog has an aux
        assert d.shape == (m, n) and d.dtype == W.dtype
        # with an aux output the result is column-major, as the aux; without one nvmath may choose row-major
        assert d.flags.f_contiguous or "AUX" not in epilog.name, (epilog, d.strides)
        close(d, gelu(want_z), dtype, f"{epilog.name} result against the float64 formula")
        close(d, ref, dtype, f"{epilog.name} result against the contract")
        if epilog in (Epilog.GELU_AUX, Epilog.GELU_AUX_BIAS):
            g_aux = aux["gelu_aux"]
            mp = gelu_aux_shape(m, n)[0]
            assert g_aux.shape == (mp, n) == ref_aux["gelu_aux"].shape and g_aux.dtype == W.dtype
            assert g_aux.strides == (g_aux.itemsize, mp * g_aux.itemsize)  # column-major, as the contract
            close(g_aux[:m], want_z, dtype, f"{epilog.name} gelu_aux (the pre-activation)")
        else:
            assert aux == {}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_dgelu_epilogs_match_the_contract_with_a_real_gelu_aux(m, k, n, dtype):
    """DGELU and DGELU_BGRAD, fed the gelu_aux of a real GELU_AUX_BIAS forward (padding rows included)."""
    rng = np.random.default_rng(11 * m + n)
    W, xT, bias = _operands(rng, m, k, n, dtype)  # the layer below: M = its outputs
    gemm = NvmathGemm()
    _, aux = gemm("below.fwd", cp.asarray(W), cp.asarray(xT.T).T, Epilog.GELU_AUX_BIAS, bias=cp.asarray(bias))
    g_aux = aux["gelu_aux"]
    # The layer above (out 33): dX^T (M, N) = W_above^T (M, 33) @ dZ_above^T (33, N), times gelu'(Z)
    WT = rand(rng, (33, m), dtype).T  # (M, 33) F-order view
    dzT = rand(rng, (n, 33), dtype).T  # (33, N) F-order view
    g_WT, g_dzT = cp.asarray(WT.T).T, cp.asarray(dzT.T).T
    zb = f64(g_aux)[:m]
    want = f64(WT) @ f64(dzT) * gelu_grad(zb)
    host_aux = np.asfortranarray(cp.asnumpy(g_aux))
    d, out = gemm("t.dgelu_bgrad", g_WT, g_dzT, Epilog.DGELU_BGRAD, gelu_aux=g_aux)
    ref, ref_out = matmul(WT, dzT, epilog=Epilog.DGELU_BGRAD, epilog_inputs={"gelu_aux": host_aux})
    assert d.flags.f_contiguous and out["dgelu_bgrad"].shape == (m,) and out["dgelu_bgrad"].dtype == d.dtype
    close(d, want, dtype, "DGELU_BGRAD result against the float64 formula")
    close(d, ref, dtype, "DGELU_BGRAD result against the contract")
    close(out["dgelu_bgrad"], want.sum(axis=1), dtype, "dgelu_bgrad against the float64 formula")
    close(out["dgelu_bgrad"], ref_out["dgelu_bgrad"], dtype, "dgelu_bgrad against the contract")
    d, out = gemm("t.dgelu", g_WT, g_dzT, Epilog.DGELU, gelu_aux=g_aux)
    assert out == {}
    close(d, ref, dtype, "DGELU result against the contract")


@pytest.mark.parametrize(("name", "tiny"), [("float16", 2.0**-13), ("bfloat16", 2.0**-10)])
def test_bias_epilogs_round_twice_on_the_h200_as_the_contract_says(name, tiny):
    """A@B = 1 - tiny rounds to 1 in the half dtype, then bias -1 gives exactly 0: mask bit set, D = 0.

    One rounding of A@B + bias would give -tiny and a clear bit; the contract rounds twice
    (tests/test_epilogs_oracle.py) because cuBLASLt does, and this holds the hardware to it.
    """
    dtype = np_dtype(name)
    a = np.array([[1.0, -tiny]]).astype(dtype)  # (M=1, K=2)
    b = np.asfortranarray(np.array([[1.0], [1.0]]).astype(dtype))  # (K=2, N=1)
    bias = np.array([-1.0]).astype(dtype)
    d, aux = NvmathGemm()("t.fwd", cp.asarray(a), cp.asarray(b), Epilog.RELU_AUX_BIAS, bias=cp.asarray(bias))
    ref, ref_aux = matmul(a, b, epilog=Epilog.RELU_AUX_BIAS, epilog_inputs={"bias": bias})
    assert unpack_relu_mask(cp.asnumpy(aux["relu_aux"]), 1)[0, 0]
    assert unpack_relu_mask(ref_aux["relu_aux"], 1)[0, 0]
    assert f64(d)[0, 0] == f64(ref)[0, 0] == 0.0


def test_drelu_bgrad_of_3000_ones_in_float16_is_3000_on_the_h200():
    """The bias gradient is accumulated wide: a float16 running sum would stop at 2048."""
    a = cp.full((2, 2), 0.5, cp.float16)
    b = cp.asfortranarray(cp.ones((2, 3000), cp.float16))
    aux = cp.asarray(pack_relu_mask(np.ones((2, 3000), bool)), order="F")
    _, out = NvmathGemm()("t.dgrad", a, b, Epilog.DRELU_BGRAD, relu_aux=aux)
    np.testing.assert_array_equal(cp.asnumpy(out["drelu_bgrad"]), np.float16(3000))


def test_a_gelu_model_trains_fused_on_the_gpu_as_the_naive_path_and_the_cpu():
    """fp32, 40 steps of digits: GPU fused (GELU_AUX_BIAS, DGELU_BGRAD/BGRADB), GPU naive and the CPU
    contract give the same losses (fp32 GEMMs on different hardware: to about 1e-5)."""
    from mlptrain.step.trainer import Trainer

    common = {"precision.name": "fp32", "model.activation": "gelu", "execution.bgrad": "drelu_bgrad"}
    fused, lf = graph_run(True, 40, **common)
    _, ln = graph_run(False, 40, **common, **{"execution.mode": "naive"})
    assert [layer.activation for layer in fused.model.layers] == ["gelu", "gelu", "none"]
    np.testing.assert_allclose(lf, ln, rtol=2e-5)
    cpu_cfg = copy.deepcopy(fused.cfg)
    cpu_cfg.device = type(cpu_cfg.device)("cpu")
    cpu = Trainer(cpu_cfg)
    lc = []
    for epoch in range(4):
        for x, y in cpu.train_loader.epoch(epoch):
            lc.append(float(cpu.step(x, y)[0]))
            if len(lc) == 40:
                break
        if len(lc) == 40:
            break
    np.testing.assert_allclose(lf, lc, rtol=2e-5)
    assert lf[-1] < 0.5 * lf[0]  # and it learns


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_gelu_model_replays_its_graph_bit_for_bit_in_half_precision(precision):
    cfg = {"precision.name": precision, "model.activation": "gelu", "execution.bgrad": "bgradb"}
    tg, lg = graph_run(True, 84, **cfg)
    te, le = graph_run(False, 84, **cfg)
    assert tg.graphed is not None and tg.graphed.num_graphs == 2
    np.testing.assert_array_equal(lg, le)
    for pg, pe in zip(tg.model.params, te.model.params, strict=True):
        cp.testing.assert_array_equal(pg.value, pe.value)
    assert np.isfinite(lg).all() and lg[-10:].mean() < lg[:10].mean()


@pytest.mark.parametrize("dtype", [*DTYPES, "float64"])
def test_the_naive_gpu_gelu_kernels_compute_the_formula(dtype):
    """execution=naive on the GPU: GELU and dX * gelu'(Z) as one element-wise kernel each (float32
    inside for the narrower dtypes, float64 for float64), against the float64 formulas."""
    from mlptrain.nn.execution import NaiveExecution

    rng = np.random.default_rng(5)
    z = rand(rng, (300, 70), dtype) * np_dtype(dtype).type(4)  # (B, out): the tails of GELU too
    g = rand(rng, (300, 70), dtype)
    naive = NaiveExecution(NvmathGemm(), cp)
    tol = {"float64": 1e-12, "float32": 2e-6}.get(dtype, 2**-7)  # half: one rounding of the result
    y = naive._gelu(cp.asarray(z))
    assert y.dtype == z.dtype
    np.testing.assert_allclose(f64(y), gelu(f64(z)), rtol=tol, atol=tol)
    dx = naive._gelu_backward(cp.asarray(g), cp.asarray(z))
    assert dx.dtype == g.dtype
    np.testing.assert_allclose(f64(dx), f64(g) * gelu_grad(f64(z)), rtol=tol, atol=tol * 4)
