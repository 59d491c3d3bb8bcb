"""The nvmath GEMM engine (mlptrain.nn.cuda.gemm) against the NumPy epilog contract; plans, plan cache, autotune."""

import numpy as np
import pytest
from gpu_helpers import DTYPES, HAS_GPU, TOL, close, cp, f64, rand

from mlptrain.nn.epilogs import Epilog, matmul, pack_relu_mask, relu_aux_shape, unpack_relu_mask

pytestmark = pytest.mark.gpu

if HAS_GPU:
    from mlptrain.nn.cuda.gemm import NvmathGemm
    from mlptrain.nn.cuda.plan_cache import PlanCache

SHAPES = [(37, 19, 23), (128, 256, 64), (1000, 784, 256), (9, 130, 8)]  # (M, K, N), odd sizes included


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_forward_relu_aux_bias_matches_contract(m, k, n, dtype):
    rng = np.random.default_rng(m + k + n)
    W, xT = rand(rng, (m, k), dtype), rand(rng, (n, k), dtype).T  # xT: F-order (K, N) view, as layers pass it
    bias = rand(rng, (m,), dtype)
    gemm = NvmathGemm()
    d, aux = gemm("t.fwd", cp.asarray(W), cp.asarray(xT.T).T, Epilog.RELU_AUX_BIAS, bias=cp.asarray(bias))
    assert d.shape == (m, n) and d.flags.f_contiguous and d.dtype == W.dtype
    relu_aux = aux["relu_aux"]
    assert relu_aux.dtype == cp.uint8 and relu_aux.shape == relu_aux_shape(m, n)
    assert relu_aux.strides == (1, relu_aux_shape(m, n)[0])
    z = f64(W) @ f64(xT) + f64(bias)[:, None]
    close(d, np.maximum(z, 0), dtype, "RELU_AUX_BIAS result")
    # Mask bits equal the contract except where rounding can flip the sign of a near-zero z.
    bits = unpack_relu_mask(cp.asnumpy(relu_aux), m)
    decided = np.abs(z) > TOL[dtype] * np.abs(z).max()
    np.testing.assert_array_equal(bits[decided], (z >= 0)[decided])
    # And the mask is the one the GPU's own output implies.
    np.testing.assert_array_equal(bits[f64(d) > 0], True)

    # Same GEMM, plan reused with new operands (reset_operands_unchecked), gives the new result.
    W2 = rand(rng, (m, k), dtype)
    d2, _ = gemm("t.fwd", cp.asarray(W2), cp.asarray(xT.T).T, Epilog.RELU_AUX_BIAS, bias=cp.asarray(bias))
    assert gemm.num_plans == 1
    close(d2, np.maximum(f64(W2) @ f64(xT) + f64(bias)[:, None], 0), dtype, "re-executed plan")


def test_relu_aux_bit_at_exact_zero_follows_the_contract():
    """z == 0 exactly (zero weights and bias): the contract says the bit is set (z >= 0)."""
    m, k, n = 16, 8, 4
    W = np.zeros((m, k), np.float32)
    W[::2] = 1.0  # even rows: z = sum(x) + 0 > 0; odd rows: z == 0 exactly
    x = np.abs(np.random.default_rng(0).standard_normal((n, k))).astype(np.float32)
    _, aux = NvmathGemm()("z.fwd", cp.asarray(W), cp.asarray(x).T, Epilog.RELU_AUX_BIAS, bias=cp.zeros(m, cp.float32))
    _, ref = matmul(W, x.T, epilog=Epilog.RELU_AUX_BIAS, epilog_inputs={"bias": np.zeros(m, np.float32)})
    np.testing.assert_array_equal(
        unpack_relu_mask(cp.asnumpy(aux["relu_aux"]), m), unpack_relu_mask(ref["relu_aux"], m)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_backward_epilogs_match_contract(m, k, n, dtype):
    rng = np.random.default_rng(7 * m + n)
    WT = rand(rng, (k, m), dtype).T  # (M, K) F-order view: W^T of a (K, M) weight
    dzT = rand(rng, (n, k), dtype).T  # (K, N) F-order view of a C-order (N, K) gradient
    mask = rng.random((m, n)) > 0.5
    relu_aux = pack_relu_mask(mask)
    gemm = NvmathGemm()
    g_WT, g_dzT = cp.asarray(WT.T).T, cp.asarray(dzT.T).T
    ref = f64(WT) @ f64(dzT) * mask
    d, aux = gemm("t.dgrad", g_WT, g_dzT, Epilog.DRELU_BGRAD, relu_aux=cp.asarray(relu_aux))
    assert d.flags.f_contiguous and aux["drelu_bgrad"].shape == (m,) and aux["drelu_bgrad"].dtype == d.dtype
    close(d, ref, dtype, "DRELU_BGRAD result")
    close(aux["drelu_bgrad"], ref.sum(axis=1), dtype, "drelu_bgrad")
    d, _ = gemm("t.drelu", g_WT, g_dzT, Epilog.DRELU, relu_aux=cp.asarray(relu_aux))
    close(d, ref, dtype, "DRELU result")

    # Weight gradient with BGRADB: A = X^T (F-order view), B = dZ (C-order (K=batch, N=out)).
    xT = rand(rng, (k, m), dtype).T  # (M, K)
    dz = rand(rng, (k, n), dtype)  # (K, N)
    d, aux = gemm("t.wgrad", cp.asarray(xT.T).T, cp.asarray(dz), Epilog.BGRADB)
    assert d.flags.f_contiguous and aux["bgradb"].shape == (n,)
    close(d, f64(xT) @ f64(dz), dtype, "BGRADB result")
    close(aux["bgradb"], f64(dz).sum(axis=0), dtype, "bgradb")


def test_plan_cache_skips_planning_in_a_second_run(tmp_path):

    path = tmp_path / "plans.npz"
    rng = cp.random.default_rng(0)
    W, x, b = (rng.standard_normal(s, dtype=cp.float32).astype(cp.float16) for s in ((96, 40), (33, 40), (96,)))
    first = NvmathGemm(plan_cache=PlanCache(path))
    d1, _ = first("c.fwd", W, x.T, Epilog.RELU_AUX_BIAS, bias=b)
    assert path.is_file() and first.plans_from_cache == 0
    second = NvmathGemm(plan_cache=PlanCache(path))
    d2, _ = second("c.fwd", W, x.T, Epilog.RELU_AUX_BIAS, bias=b)
    assert second.plans_from_cache == 1
    cp.testing.assert_array_equal(d1, d2)


def test_graph_autotune_picks_a_candidate_that_computes_the_contract(tmp_path):
    """execution.autotune: every candidate is timed in a CUDA graph; the chosen one must still be exact."""

    rng = np.random.default_rng(8)
    W, x, b = rand(rng, (1024, 784), "float16"), rand(rng, (256, 784), "float16"), rand(rng, (1024,), "float16")
    cache = PlanCache(tmp_path / "plans.npz")
    gemm = NvmathGemm(autotune=True, plan_cache=cache)
    d, aux = gemm("t.fwd", cp.asarray(W), cp.asarray(x).T, Epilog.RELU_AUX_BIAS, bias=cp.asarray(b))
    ref, ref_aux = matmul(f64(W), f64(x).T, epilog=Epilog.RELU_AUX_BIAS, epilog_inputs={"bias": f64(b)})
    close(d, ref, "float16", "autotuned RELU_AUX_BIAS")
    assert (
        unpack_relu_mask(cp.asnumpy(aux["relu_aux"]), 1024) == unpack_relu_mask(ref_aux["relu_aux"], 1024)
    ).mean() > 0.999
    assert any(k.startswith("tuned-") for k in PlanCache(tmp_path / "plans.npz")._algos)  # kept for the next run
    gemm.free()
