"""An ensemble on the GPU (ensemble.size=K): nvmath's batched GEMMs with the epilogs against the NumPy batched
contract, and the batched step (graphed) against the CPU's members. Written on a CPU machine: the GPU issue runs it."""

from typing import Any

import numpy as np
import pytest
from gpu_helpers import HAS_GPU, cp

from mlptrain.config.schema import Device, TrainConfig
from mlptrain.nn.batched import BatchedNumpyGemm
from mlptrain.nn.epilogs import Epilog, relu_aux_shape, unpack_relu_mask

pytestmark = pytest.mark.gpu

if HAS_GPU:
    from mlptrain.nn.cuda.gemm import NvmathGemm

K = 4


def stacks(rng: np.random.Generator, m: int, kd: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``A (K, M, Kd)`` C-order per member, ``B (K, Kd, N)`` column-major per member (as the layers pass ``X^T``),
    ``bias (K, M, 1)`` with unit stride along M (the transposed view of a ``(K, 1, M)`` array)."""
    a = rng.standard_normal((K, m, kd)).astype(np.float32)
    b = rng.standard_normal((K, n, kd)).astype(np.float32).swapaxes(-1, -2)
    bias = rng.standard_normal((K, 1, m)).astype(np.float32).swapaxes(-1, -2)
    return a, b, bias


def on_gpu(x: np.ndarray) -> "cp.ndarray":
    """``x`` on the device with the same strides (each member's matrix in the same order)."""
    if x.ndim == 3 and x.strides[-2] < x.strides[-1]:  # column-major matrices
        return cp.ascontiguousarray(cp.asarray(x.swapaxes(-1, -2))).swapaxes(-1, -2)
    return cp.asarray(x)


@pytest.mark.parametrize(("m", "kd", "n"), [(64, 30, 128), (10, 256, 96), (256, 64, 32)])
def test_batched_relu_aux_bias_matches_the_batched_contract(m: int, kd: int, n: int) -> None:
    a, b, bias = stacks(np.random.default_rng(m + n), m, kd, n)
    d, aux = NvmathGemm()("e.fwd", on_gpu(a), on_gpu(b), Epilog.RELU_AUX_BIAS, bias=on_gpu(bias))
    d_ref, aux_ref = BatchedNumpyGemm()("e.fwd", a, b, Epilog.RELU_AUX_BIAS, bias=bias)
    assert d.shape == (K, m, n)
    np.testing.assert_allclose(cp.asnumpy(d), d_ref, rtol=1e-4, atol=1e-4)
    assert aux["relu_aux"].shape == (K, *relu_aux_shape(m, n))
    for k in range(K):  # the bits where the sign is decided (not a rounding away from zero)
        z = a[k].astype(np.float64) @ b[k] + bias[k]
        decided = np.abs(z) > 1e-4 * np.abs(z).max()
        bits = unpack_relu_mask(cp.asnumpy(aux["relu_aux"][k]), m)
        np.testing.assert_array_equal(bits[decided], unpack_relu_mask(aux_ref["relu_aux"][k], m)[decided])


@pytest.mark.parametrize("epilog", [Epilog.BGRADB, Epilog.DRELU_BGRAD])
def test_batched_bias_gradients_come_back_as_batch_l_1(epilog: Epilog) -> None:
    m, kd, n = 96, 64, 48
    rng = np.random.default_rng(7)
    a, b, bias = stacks(rng, m, kd, n)
    inputs = {}
    if epilog is Epilog.DRELU_BGRAD:  # the mask of a forward of the same M and N
        _, fwd = BatchedNumpyGemm()("e.fwd", a, b, Epilog.RELU_AUX_BIAS, bias=bias)
        mask = fwd["relu_aux"]
        inputs = {"relu_aux": mask}
        gpu_inputs = {"relu_aux": on_gpu(mask)}
    else:  # the weight-gradient GEMM's layouts: X^T (K, in, B) column-major, dZ (K, B, out) C-order
        gpu_inputs = {}  # (cuBLASLt refused BGRADB with the forward's layouts, A C-order and B column-major)
        a = np.ascontiguousarray(a.swapaxes(-1, -2)).swapaxes(-1, -2)
        b = np.ascontiguousarray(b)
    d, aux = NvmathGemm()("e.bwd", on_gpu(a), on_gpu(b), epilog, **gpu_inputs)
    d_ref, aux_ref = BatchedNumpyGemm()("e.bwd", a, b, epilog, **inputs)
    name = "bgradb" if epilog is Epilog.BGRADB else "drelu_bgrad"
    assert aux[name].shape == aux_ref[name].shape == (K, n if epilog is Epilog.BGRADB else m, 1)
    np.testing.assert_allclose(cp.asnumpy(d), d_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cp.asnumpy(aux[name]), aux_ref[name], rtol=1e-4, atol=1e-3)


def ensemble_cfg(device: str, graph: bool = True) -> TrainConfig:
    cfg = TrainConfig()
    cfg.device, cfg.progress, cfg.seed, cfg.epochs, cfg.graph = Device(device), False, 3, 1, graph
    cfg.model.hidden = [64, 64]
    cfg.data.batch_size = 64
    cfg.ensemble.size = K
    return cfg


@pytest.mark.parametrize("graph", [False, True])
def test_the_batched_step_on_the_gpu_follows_the_cpus_members(graph: bool) -> None:
    from mlptrain.run.ensemble import EnsembleTrainer

    gpu, cpu = EnsembleTrainer(ensemble_cfg("gpu", graph)), EnsembleTrainer(ensemble_cfg("cpu"))
    with gpu.stream:
        ours = [cp.asnumpy(gpu.step(x, y)[0]) for x, y in gpu.train_batches(0)][:10]
    theirs = [np.asarray(cpu.step(x, y)[0]) for x, y in cpu.train_batches(0)][:10]
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=2e-3)  # fp32: rounding order only
    scores = gpu.evaluate("val")
    assert {f"member{k}/val/acc" for k in range(K)} <= set(scores) and "val/acc" in scores


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize(("dtype", "tol"), [(np.float32, 1e-5), (np.float16, 2e-3), (np.float64, 1e-12)])
def test_the_members_loss_on_the_gpu_is_one_stacked_cross_entropy(dtype: Any, tol: float, inplace: bool) -> None:
    """fp16/bf16/fp32: a row kernel over the K * B rows (10 classes: a thread a row); float64: the array operations."""
    from mlptrain.nn.members import MemberHead

    rng = np.random.default_rng(5)
    logits = (3 * rng.standard_normal((K, 256, 10))).astype(dtype)
    y = rng.integers(0, 10, (K, 256))
    head = MemberHead("cross_entropy")
    on = cp.asarray(logits)
    loss, correct, dlogits = head.losses(on, cp.asarray(y), cp.asarray(1.0), inplace=inplace)
    assert (dlogits is on) == inplace and dlogits.dtype == dtype and loss.shape == correct.shape == (K,)
    ref_loss, ref_correct, ref_grad = head.losses(logits.astype(np.float64), y, np.array(1.0))
    np.testing.assert_allclose(cp.asnumpy(loss), ref_loss, rtol=tol)
    np.testing.assert_allclose(cp.asnumpy(dlogits).astype(np.float64), ref_grad, rtol=tol, atol=tol / 100)
    np.testing.assert_array_equal(cp.asnumpy(correct), ref_correct)
