"""The head kernel (mlptrain.nn.cuda.head): the output layer's input gradient against the DRELU_BGRAD contract."""

import numpy as np
import pytest
from gpu_helpers import DTYPES, HAS_GPU, close, cp, f64, graph_run, rand

from mlptrain.nn.epilogs import Epilog, matmul, pack_relu_mask
from mlptrain.nn.losses import softmax_cross_entropy

pytestmark = pytest.mark.gpu

if HAS_GPU:
    from mlptrain.nn.cuda.gemm import NvmathGemm
    from mlptrain.nn.cuda.head import head_input_grad


def cross_entropy_head(z, y, scale, W, aux, bias_grad_below=True):
    """What OutputHead's "kernel" mode runs: the loss kernel, then the head kernel on its dlogits."""
    loss, d, correct, db = softmax_cross_entropy(z, y, scale, bias_grad=True)
    dz, db_below = head_input_grad(d, W, aux, bias_grad_below=bias_grad_below)
    return loss, d, correct, db, dz, db_below


# (B, C, H): MNIST's, odd sizes, rows beyond one pass of 256 threads, the limits of B and C, a wide layer
HEAD_SHAPES = [(256, 10, 1024), (7, 3, 33), (1024, 10, 100), (320, 32, 64), (1, 2, 5), (300, 10, 2000)]


def _head_inputs(B, C, H, dtype, seed=0):
    rng = np.random.default_rng(seed + B + C + H)
    z = rand(rng, (B, C), dtype) * 4
    y = rng.integers(0, C, B)
    W = rand(rng, (C, H), dtype)
    mask = rng.random((H, B)) > 0.4  # the layer below's Z >= 0, (H, B) as the forward GEMM's result
    aux = pack_relu_mask(mask)  # (Mb, B) uint8 column-major, cuBLASLt's relu_aux layout
    aux_dev = cp.asarray(np.ascontiguousarray(aux.T)).T  # the same layout on the device
    return z, y, W, mask, aux, aux_dev


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("B", "C", "H"), HEAD_SHAPES)
@pytest.mark.parametrize("want_db", [True, False])
def test_head_kernel_matches_loss_then_drelu_bgrad_contract(B, C, H, dtype, want_db):
    """cross_entropy_head = the loss kernel, then DRELU_BGRAD of (dlogits @ W) with relu_aux."""
    z, y, W, mask, aux, aux_dev = _head_inputs(B, C, H, dtype)
    assert aux_dev.strides == (1, aux.shape[0])
    zc, yc, scale = cp.asarray(z), cp.asarray(y), cp.asarray(512.0)
    loss, d, correct, db, dz, db_below = cross_entropy_head(
        zc, yc, scale, cp.asarray(W), aux_dev, bias_grad_below=want_db
    )
    # the loss part is the loss kernel's: the same bits
    ref = softmax_cross_entropy(zc, yc, scale, bias_grad=True)
    for got, want, what in zip((loss, d, correct, db), ref, ("loss", "dlogits", "correct", "db_out"), strict=True):
        np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(want), err_msg=what)
    # the head part against the NumPy epilog contract, from the kernel's own dlogits:
    # dZ_below^T (H, B) = W^T (H, C) @ dlogits^T (C, B), DRELU_BGRAD with relu_aux
    dzt_ref, aux_out = matmul(W.T, cp.asnumpy(d).T, epilog=Epilog.DRELU_BGRAD, epilog_inputs={"relu_aux": aux})
    assert dz.shape == (B, H) and dz.dtype == z.dtype and dz.flags.c_contiguous
    got = f64(dz)
    assert (got[~mask.T] == 0).all()  # dReLU: exactly zero where the layer below's ReLU was off
    close(got, dzt_ref.T, dtype, "dZ_below")
    if dtype == "float32":  # ten float32 products: only the summation order differs
        np.testing.assert_allclose(got, f64(dzt_ref.T), rtol=1e-5, atol=1e-6 * np.abs(got).max())
    if want_db:
        assert db_below.shape == (H,) and db_below.dtype == z.dtype
        close(db_below, got.sum(axis=0), dtype, "db_below")  # sums what dZ_below holds
        close(db_below, f64(aux_out["drelu_bgrad"]), dtype, "db_below against the contract")
    else:
        assert db_below is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_kernel_matches_cublaslt_drelu_bgrad(dtype):
    """The kernel against the GEMM it replaces: nvmath's DRELU_BGRAD at K = 10 on the same operands."""
    from mlptrain.nn.execution import FusedExecution

    z, y, W, mask, aux, aux_dev = _head_inputs(256, 10, 1024, dtype, seed=1)
    Wc = cp.asarray(W)
    _, d, _, _, dz, db_below = cross_entropy_head(cp.asarray(z), cp.asarray(y), 1.0, Wc, aux_dev)
    dz_gemm, db_gemm = FusedExecution(NvmathGemm()).input_grad("t", Wc, d, aux_dev, bias_grad_below=True)
    close(dz, dz_gemm, dtype, "dZ_below against cuBLASLt")
    close(db_below, db_gemm, dtype, "db_below against cuBLASLt")
    assert ((cp.asnumpy(dz) == 0) == (cp.asnumpy(dz_gemm) == 0)).mean() > 0.999  # the same mask applied


def test_head_kernel_refuses_operands_that_do_not_fit():
    z, y, W, _, aux, aux_dev = _head_inputs(64, 10, 100, "float16")
    zc, yc, Wc = cp.asarray(z), cp.asarray(y), cp.asarray(W)
    with pytest.raises(ValueError, match=r"relu_aux must be uint8 \(16, 64\) column-major"):
        cross_entropy_head(zc, yc, 1.0, Wc, cp.ascontiguousarray(aux_dev))  # C-order: the bits in the wrong place
    with pytest.raises(ValueError, match=r"relu_aux must be uint8 \(16, 64\).*got uint8 \(16, 63\)"):
        cross_entropy_head(zc, yc, 1.0, Wc, aux_dev[:, :63])
    with pytest.raises(
        ValueError, match=r"output weight must be C-contiguous \(10, hidden\) float16 for dlogits.*float32"
    ):
        cross_entropy_head(zc, yc, 1.0, Wc.astype(cp.float32), aux_dev)
    with pytest.raises(ValueError, match=r"output weight.*\(9, 100\)"):
        cross_entropy_head(zc, yc, 1.0, Wc[:9], aux_dev)
    with pytest.raises(ValueError, match=r"not C-contiguous"):
        cross_entropy_head(zc, yc, 1.0, cp.asfortranarray(Wc), aux_dev)
    with pytest.raises(ValueError, match=r"B <= 1024.*got dlogits \(1025, 10\)"):
        cross_entropy_head(cp.zeros((1025, 10), cp.float16), cp.zeros(1025, cp.int64), 1.0, Wc, aux_dev)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_head_kernel_trains_as_the_head_gemm(precision):
    """84 replayed steps (two epochs, a short last batch, its own graph) with and without the head kernel.

    The two round the ten-term dot products in a different order, so the runs agree to rounding,
    not bit for bit; a wrong mask bit, a wrong column or a lost bias gradient would part them at once.
    """
    runs = {}
    for head in (True, False):
        # drelu_bgrad: the top hidden layer's bias gradient from the head kernel's sums (or DRELU_BGRAD)
        cfg = {"precision.name": precision, "execution.head_kernel": head, "execution.bgrad": "drelu_bgrad"}
        tr, losses = graph_run(True, 84, **cfg)
        assert (tr.head.mode == "kernel") is head and tr.graphed.num_graphs == 2
        runs[head] = (tr, losses)
    (tk, lk), (tg, lg) = runs[True], runs[False]
    rtol = {"fp32": 1e-4, "fp16": 2e-2}[precision]
    np.testing.assert_allclose(lk, lg, rtol=rtol)
    for pk, pg in zip(tk.model.params, tg.model.params, strict=True):
        close(pk.value, pg.value, "float32" if precision == "fp32" else "float16", pk.name)
