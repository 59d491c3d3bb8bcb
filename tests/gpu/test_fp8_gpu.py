"""precision=fp8 on the GPU (mlptrain.nn.cuda.fp8_kernels, fp8_gemm) against the NumPy FP8 contract (mlptrain.nn.fp8).

Needs compute capability 8.9+ (Hopper): every test here is skipped on an older GPU.
"""

import ml_dtypes
import numpy as np
import pytest
from gpu_helpers import HAS_GPU, cp, f64, graph_run

from mlptrain.nn.epilogs import Epilog, pack_relu_mask, unpack_relu_mask
from mlptrain.nn.epilogs_fp8 import FORMATS, quantize
from mlptrain.nn.execution import NumpyGemm
from mlptrain.nn.fp8 import Fp8Gemm, Fp8Scaling

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8_GPU = HAS_GPU and int(cp.cuda.Device().compute_capability) >= 89
needs_fp8 = pytest.mark.skipif(not FP8_GPU, reason="FP8 needs compute capability 8.9 or higher")

if HAS_GPU:
    from mlptrain.nn.cuda.fp8_gemm import GpuFp8Gemm
    from mlptrain.nn.cuda.fp8_kernels import GpuFp8Scaling
    from mlptrain.nn.cuda.gemm import NvmathGemm


def _bf16(shape, seed, scale=1.0, order="C"):
    a = np.random.default_rng(seed).standard_normal(shape) * scale
    return np.asarray(a.astype(BF16), order=order)


def _fp8_values(q_uint8, fmt):
    """The float64 values of FP8 bytes (a CuPy uint8 array) in format ``fmt``."""
    return cp.asnumpy(q_uint8).view(FORMATS[fmt]).astype(np.float64)


@needs_fp8
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("shape", [(48, 80), (200, 136), (4096, 2056)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_cast_kernels_round_and_saturate_as_the_contract(fmt, order, shape):
    """Partial 64 x 64 tiles (48 x 80, 200 x 136) and a grid-stride loop of many blocks (4096 x 2056), whose
    last block updates the scale: the bytes and the state equal the contract's."""
    x = _bf16(shape, 1, 30.0)
    x[3, 4], x[5, 6], x[7, 8] = np.inf, -np.inf, np.nan
    x[9, 10] = 1e6  # saturates
    gpu, cpu = GpuFp8Scaling(), Fp8Scaling(np)
    for step in range(3):  # the second and third casts use the scales the first ones recorded
        xs = np.where(np.isfinite(x.astype(np.float32)), x.astype(np.float32) * (step + 1), x).astype(BF16)
        q_gpu, inv_gpu = gpu.quantize("t", cp.asarray(xs), fmt, order=order)
        q_cpu, inv_cpu = cpu.quantize("t", xs, fmt)
        want = "c_contiguous" if order == "C" else "f_contiguous"
        assert q_gpu.dtype == cp.uint8 and q_gpu.shape == xs.shape and getattr(q_gpu.flags, want)
        a, b = _fp8_values(q_gpu, fmt), q_cpu.astype(np.float64)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_array_equal(a[~np.isnan(a)], b[~np.isnan(b)])
        assert float(inv_gpu) == float(inv_cpu)
    # the inf/NaN amaxes entered no history: both states equal bit for bit
    for key, value in cpu.state_dict().items():
        np.testing.assert_array_equal(gpu.state_dict()[key], value, err_msg=key)


@needs_fp8
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("shape", [(48, 80), (4096, 2056)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_cast_of_a_float32_master_is_the_cast_of_its_bfloat16_copy(order, shape):
    """A weight's float32 master (compute_copy=cast) is rounded to bfloat16 in the cast kernel's registers:
    the bytes, the dequantisation scale and the amax history are those of casting the bfloat16 copy. The
    values are drawn so that rounding to FP8 straight from float32 gives other bytes somewhere."""
    w = (np.random.default_rng(5).standard_normal(shape) * 0.05).astype(np.float32)
    w[1, 2] = np.float32(0.1) + np.float32(2.0**-14)  # its bfloat16 rounding decides the amax's low bits
    gpu, copy = GpuFp8Scaling(), GpuFp8Scaling()
    for step in range(3):
        ws = w * np.float32(step + 1)
        q, inv = gpu.quantize("w", cp.asarray(ws), "e4m3", order=order, via=BF16)
        q16, inv16 = copy.quantize("w", cp.asarray(ws.astype(BF16)), "e4m3", order=order)
        assert q.flags.c_contiguous == (order == "C") and q.shape == shape
        assert cp.array_equal(q, q16) and float(inv) == float(inv16), f"step {step}"
        straight = quantize(ws, np.float32(1.0 / float(inv16)), "e4m3").view(np.uint8)  # no bfloat16 first
        assert (straight != cp.asnumpy(q16)).any()  # the test can tell the two roundings apart
    for key, value in copy.state_dict().items():
        np.testing.assert_array_equal(gpu.state_dict()[key], value, err_msg=key)


@needs_fp8
def test_the_cast_refuses_dimensions_that_are_not_multiples_of_8():
    with pytest.raises(ValueError, match=r"multiples of 8; got \(40, 12\)"):
        GpuFp8Scaling().quantize("t", cp.asarray(_bf16((40, 12), 0)), "e4m3", order="C")


@needs_fp8
def test_a_cast_from_an_unaligned_view_equals_the_aligned_one():
    x = cp.asarray(_bf16((17 * 16, 64), 3, 4.0))
    unaligned = x.ravel()[4 : 4 + 256 * 64].reshape(256, 64)  # starts 8 bytes into x's allocation
    assert unaligned.data.ptr % 16 and unaligned.flags.c_contiguous
    got, _ = GpuFp8Scaling().quantize("t", unaligned, "e4m3", order="C")
    want, _ = GpuFp8Scaling().quantize("t", unaligned.copy(), "e4m3", order="C")
    assert cp.array_equal(got, want)


@needs_fp8
def test_the_scale_update_follows_the_amax_history_as_on_the_cpu():
    gpu, cpu = GpuFp8Scaling(amax_history=3, margin=1), Fp8Scaling(np, amax_history=3, margin=1)
    for step, scale in enumerate([1.0, 4.0, 0.5, 0.25, 0.25, 8.0]):
        x = _bf16((32, 32), step, scale)
        gpu.quantize("w", cp.asarray(x), "e4m3", order="C")
        cpu.quantize("w", x, "e4m3")
        for key, value in cpu.state_dict().items():
            np.testing.assert_array_equal(gpu.state_dict()[key], value, err_msg=f"{key} after step {step}")


def _engines(mode="fused"):
    return GpuFp8Gemm(NvmathGemm(), GpuFp8Scaling(), mode), Fp8Gemm(NumpyGemm(), Fp8Scaling(np), mode)


def _compare(d_gpu, d_cpu, what, roundings=2):
    """Within ``roundings`` bfloat16 roundings of the contract (cuBLASLt's float32 accumulation runs in another
    order)."""
    a, b = f64(d_gpu), f64(d_cpu)
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
    assert err < roundings * 2.0**-8, f"{what}: max error {err:.3g} relative to max |contract|"


@needs_fp8
@pytest.mark.parametrize("epilog", [Epilog.BIAS, Epilog.RELU_BIAS, Epilog.RELU_AUX_BIAS, Epilog.GELU_AUX_BIAS])
def test_each_forward_epilog_matches_the_contract(epilog):
    m, k, n = 256, 128, 64  # Z^T (out, B) = W (out, in) @ X^T (in, B)
    W, x, b = _bf16((m, k), 2, 0.1), _bf16((n, k), 3), _bf16(m, 4, 0.1)
    gpu, cpu = _engines()
    for step in range(2):  # step 0 casts with scale 1, step 1 with the recorded scales
        d_gpu, aux_gpu = gpu("l.fwd", cp.asarray(W), cp.asarray(x).T, epilog, bias=cp.asarray(b))
        d_cpu, aux_cpu = cpu("l.fwd", W, x.T, epilog, bias=b)
        assert d_gpu.flags.f_contiguous and d_gpu.dtype == BF16
        _compare(d_gpu, d_cpu, f"{epilog.name} step {step}")
        if epilog is Epilog.RELU_AUX_BIAS:
            z = f64(d_cpu)
            got, want = unpack_relu_mask(cp.asnumpy(aux_gpu["relu_aux"]), m), unpack_relu_mask(aux_cpu["relu_aux"], m)
            clear = z > 0.05 * np.abs(z).max()  # where the rounding cannot flip the sign
            assert (got[clear] == want[clear]).all()
        if epilog is Epilog.GELU_AUX_BIAS:
            _compare(aux_gpu["gelu_aux"][:m], aux_cpu["gelu_aux"][:m], "gelu_aux")


@needs_fp8
@pytest.mark.parametrize("epilog", [Epilog.DRELU, Epilog.DRELU_BGRAD, Epilog.DGELU, Epilog.DGELU_BGRAD])
def test_each_backward_epilog_matches_the_contract_with_an_e5m2_gradient(epilog):
    m, k, n = 128, 256, 64  # dX^T (in, B) = W^T (in, out) @ dZ^T (out, B): W^T an F-order view, as layers pass it
    W, dz = _bf16((k, m), 5, 0.1), _bf16((n, k), 6, 1e-3)
    if epilog in (Epilog.DRELU, Epilog.DRELU_BGRAD):
        inputs = {"relu_aux": pack_relu_mask(np.random.default_rng(7).random((m, n)) > 0.5)}
    else:
        z = np.zeros((m, n), BF16, order="F")
        z[:] = _bf16((m, n), 8)
        inputs = {"gelu_aux": z}
    gpu, cpu = _engines()
    on_gpu = {name: cp.asarray(v) for name, v in inputs.items()}
    d_gpu, aux_gpu = gpu("l.dgrad", cp.asarray(W).T, cp.asarray(dz).T, epilog, **on_gpu)
    d_cpu, aux_cpu = cpu("l.dgrad", W.T, dz.T, epilog, **inputs)
    # DGELU: cuBLASLt evaluates gelu' of the bfloat16 gelu_aux its own way (2.6 bfloat16 roundings of the
    # largest element from the float64 formula on the H200, 2026-12-02); the ReLU family only masks
    _compare(d_gpu, d_cpu, epilog.name, roundings=4 if epilog in (Epilog.DGELU, Epilog.DGELU_BGRAD) else 2)
    for name in aux_cpu:
        _compare(aux_gpu[name], aux_cpu[name], name)


@needs_fp8
@pytest.mark.parametrize("mode", ["fused", "naive"])
def test_plain_fp8_gemms_and_the_bias_gradient_of_the_weight_gradient(mode):
    gpu, cpu = _engines(mode)
    x, dz = _bf16((64, 128), 9), _bf16((64, 32), 10, 1e-2)  # X (B, in), dZ (B, out)
    d_gpu, aux_gpu = gpu("l.wgrad", cp.asarray(x).T, cp.asarray(dz), Epilog.BGRADB)  # dW^T (in, out)
    d_cpu, aux_cpu = cpu("l.wgrad", x.T, dz, Epilog.BGRADB)
    _compare(d_gpu, d_cpu, "dW")
    _compare(aux_gpu["bgradb"], aux_cpu["bgradb"], "bgradb")
    if mode == "naive":  # (B, out) @ (out, in): a C-order result, from the operands swapped
        W = _bf16((32, 128), 11, 0.1)
        d_gpu, _ = gpu("l.dgrad", cp.asarray(dz), cp.asarray(W))
        d_cpu, _ = cpu("l.dgrad", dz, W)
        assert d_gpu.flags.c_contiguous and d_cpu.flags.c_contiguous
        _compare(d_gpu, d_cpu, "naive dX")


@needs_fp8
def test_dims_that_are_not_multiples_of_16_run_the_16_bit_gemm():
    gpu, _ = _engines()
    W, x, b = _bf16((10, 128), 12), _bf16((64, 128), 13), _bf16(10, 14)
    d, _ = gpu("head.fwd", cp.asarray(W), cp.asarray(x).T, Epilog.BIAS, bias=cp.asarray(b))
    ref, _ = NvmathGemm()("head.fwd", cp.asarray(W), cp.asarray(x).T, Epilog.BIAS, bias=cp.asarray(b))
    cp.testing.assert_array_equal(d, ref)
    assert gpu.scaling.tensors == {}


@needs_fp8
def test_fp8_graph_replay_equals_uncaptured_steps():
    steps = 84  # captured at step 62, replayed after (as test_graph.py)
    tg, lg = graph_run(True, steps, **{"precision.name": "fp8"})
    te, le = graph_run(False, steps, **{"precision.name": "fp8"})
    assert tg.graphed is not None and tg.graphed.num_graphs == 2
    np.testing.assert_array_equal(lg, le)
    for pg, pe in zip(tg.model.params, te.model.params, strict=True):
        cp.testing.assert_array_equal(pg.value, pe.value)
    for key, value in te.gemm.scaling.state_dict().items():
        np.testing.assert_array_equal(tg.gemm.scaling.state_dict()[key], value, err_msg=key)
    assert lg[-1] < 0.5 * lg[0]  # it trained


@needs_fp8
def test_a_non_finite_gradient_skips_the_fp8_step_on_the_gpu():
    from gpu_helpers import gpu_trainer

    tr = gpu_trainer(**{"precision.name": "fp8", "graph": False})
    x, y = next(iter(tr.train_loader.epoch(0)))
    with tr.stream:
        tr.step(x, y)
        before = [p.value.copy() for p in tr.model.params]
        bad = x.copy()
        bad[3, 5] = np.inf
        tr.step(bad, y)
        cp.cuda.get_current_stream().synchronize()
    assert int(tr.scaler.found_inf) == 1
    for p, b in zip(tr.model.params, before, strict=True):
        cp.testing.assert_array_equal(p.value, b)


@needs_fp8
def test_the_contract_of_the_first_cast_is_plain_quantisation():
    """Sanity of the oracle itself on the GPU's input: scale 1 casts equal ml_dtypes' saturating casts."""
    x = _bf16((16, 32), 15, 100.0)
    q, _ = GpuFp8Scaling().quantize("t", cp.asarray(x), "e4m3", order="C")
    np.testing.assert_array_equal(_fp8_values(q, "e4m3"), quantize(x, 1.0, "e4m3").astype(np.float64))


@needs_fp8
@pytest.mark.parametrize("m, n", [(16, 8), (272, 1000), (4096, 8192)])
def test_the_drelu_bgrad_kernel_masks_exactly_and_sums_in_float32(m, n):
    """mlptrain_drelu_partial / mlptrain_bgrad_finish: rows not a multiple of a block's 256, slabs that do not
    divide N. D masked bit for bit; db within a float32 sum and one bfloat16 rounding of the float64 sum."""
    from mlptrain.nn.cuda.epilogue_kernels import drelu

    rng = np.random.default_rng(m + n)
    d = np.asarray(rng.standard_normal((m, n)).astype(BF16), order="F")
    mask = rng.random((m, n)) > 0.4
    d_gpu = cp.asarray(d, order="F")
    db = drelu(d_gpu, cp.asarray(pack_relu_mask(mask), order="F"))
    masked = np.where(mask, d.astype(np.float64), 0.0)
    np.testing.assert_array_equal(f64(d_gpu), masked)
    exact = masked.sum(axis=1)
    bound = 2.0**-8 * np.abs(exact) + n * 2.0**-24 * np.abs(masked).sum(axis=1) + 1e-30
    assert db.dtype == d_gpu.dtype and db.shape == (m,)
    assert np.all(np.abs(f64(db) - exact) <= bound)


@needs_fp8
def test_the_own_drelu_bgrad_equals_cublaslts_epilogue_within_its_roundings():
    m, k, n = 256, 512, 128
    W, dz = _bf16((k, m), 11, 0.1), _bf16((n, k), 12, 1e-2)
    aux = cp.asarray(pack_relu_mask(np.random.default_rng(13).random((m, n)) > 0.5), order="F")
    runs = {}
    for own in (True, False):
        gpu = GpuFp8Gemm(NvmathGemm(), GpuFp8Scaling(), "fused", own_drelu_bgrad=own)
        runs[own] = gpu("l.dgrad", cp.asarray(W).T, cp.asarray(dz).T, Epilog.DRELU_BGRAD, relu_aux=aux)
    (d_own, aux_own), (d_lt, aux_lt) = runs[True], runs[False]
    np.testing.assert_array_equal(f64(d_own) == 0, f64(d_lt) == 0)  # the same mask
    _compare(d_own, d_lt, "D", roundings=1)
    _compare(aux_own["drelu_bgrad"], aux_lt["drelu_bgrad"], "drelu_bgrad")


@needs_fp8
@pytest.mark.parametrize("k, n", [(8, 16), (1000, 272), (8192, 4096)])
def test_the_column_sums_of_a_weight_gradient_operand(k, n):
    """BGRADB's bias gradient in FP8 (epilogue_kernels.bgradb): the sum over K of a C-order (K, N)."""
    from mlptrain.nn.cuda.epilogue_kernels import bgradb

    b = _bf16((k, n), k + n)
    before = b.copy()
    b_gpu = cp.asarray(b)
    got = bgradb(b_gpu)
    exact = b.astype(np.float64).sum(axis=0)
    bound = 2.0**-8 * np.abs(exact) + k * 2.0**-24 * np.abs(b.astype(np.float64)).sum(axis=0) + 1e-30
    assert got.shape == (n,) and np.all(np.abs(f64(got) - exact) <= bound)
    np.testing.assert_array_equal(cp.asnumpy(b_gpu), before)  # no mask: b is read, not written


@needs_fp8
@pytest.mark.parametrize("wgrad_stream", [True, False])
def test_fp8_without_a_weight_copy_takes_the_kept_copys_steps_in_less_memory(wgrad_stream):
    """precision=fp8's own compute_copy (auto: cast): the FP8 casts read the float32 weights; the head's weight
    and the biases share a small cast buffer. Captured and replayed, every loss, weight and scale equals the
    kept bfloat16 copy's run bit for bit, with 2 bytes a hidden weight less in the account and everything
    else the same (the peaks: benchmarks/bench_fp8.py, at sizes where the weights are what counts)."""
    import gc

    from gpu_helpers import gpu_trainer, train_losses

    from mlptrain.step.cuda.memory import account, expected_bytes

    runs = {}
    for copy in ("kept", "auto"):
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
        tr = gpu_trainer(
            **{
                "model.hidden": [2048, 2048],
                "data.batch_size": 256,
                "precision.name": "fp8",
                "precision.compute_copy": copy,
                "execution.bgrad": "bgradb",
                "execution.plan_cache": False,
                "execution.wgrad_stream": wgrad_stream,
            }
        )
        with tr.stream:
            losses = train_losses(tr, 12)  # two warm-up steps, the capture, replays
        assert tr.graphed.num_graphs >= 1
        runs[copy] = {
            "losses": losses,
            "params": {p.name: cp.asnumpy(p.value) for p in tr.model.params},
            "scales": tr.gemm.scaling.state_dict(),
            "live": account(tr)["live_bytes"],
            "gemm_casts": [layer.weight.gemm_casts for layer in tr.model.layers],
            "weights": sum(int(p.value.size) for p in tr.model.params),
            "widths": tr.widths,
        }
        del tr
    kept, cast = runs["kept"], runs["auto"]
    kept["copies"], cast["copies"] = kept["live"]["compute_copies"], cast["live"]["compute_copies"]
    assert cast["gemm_casts"] == [True, True, False]  # 64-2048-2048 in FP8, the 10-class head in bf16
    assert kept["gemm_casts"] == [False, False, False]
    assert len(set(kept["losses"].tolist())) > 6  # it trains
    np.testing.assert_array_equal(cast["losses"], kept["losses"])
    for name, value in kept["params"].items():
        np.testing.assert_array_equal(cast["params"][name], value, err_msg=name)
    for key, value in kept["scales"].items():
        np.testing.assert_array_equal(cast["scales"][key], value, err_msg=key)
    assert kept["copies"] == 2 * kept["weights"]
    assert cast["copies"] == 2 * (2048 * 10 + 2048)  # the head's weight and the largest bias
    want = expected_bytes(cast["widths"], 256, np.float32, BF16, 1, compute_copy="cast", fp8_weights=True)
    assert want["compute_copies"] == cast["copies"]
    # everything else the runs hold is the same: the memory saved is the hidden weights' copies less the buffer
    for key, value in kept["live"].items():
        if key not in ("compute_copies", "gemm_workspaces"):
            assert cast["live"][key] == value, key


@needs_fp8
def test_a_16_class_head_read_as_the_master_by_the_head_kernel_takes_the_kept_copys_steps():
    """16 classes: the output layer's widths fit FP8, so its weight is a master too (Param.gemm_casts), and the
    head kernel (mlptrain.nn.head, mode kernel), which reads W in 16 bits, gets it cast: the kept copy's steps."""
    from gpu_helpers import gpu_trainer, train_losses

    runs = {}
    for copy in ("kept", "auto"):
        tr = gpu_trainer(
            **{
                "data.name": "synthetic",
                "data.samples": 4096,
                "data.features": 32,
                "data.classes": 16,
                "data.batch_size": 128,
                "model.hidden": [64],
                "precision.name": "fp8",
                "precision.compute_copy": copy,
                "execution.bgrad": "bgradb",
                "execution.plan_cache": False,
            }
        )
        with tr.stream:
            losses = train_losses(tr, 10)
        assert tr.head.mode == "kernel"
        runs[copy] = (tr, losses)
    (kept, kept_losses), (cast, cast_losses) = runs["kept"], runs["auto"]
    assert [layer.weight.gemm_casts for layer in cast.model.layers] == [True, True]
    assert len(set(kept_losses.tolist())) > 5
    np.testing.assert_array_equal(cast_losses, kept_losses)
    for p, q in zip(kept.model.params, cast.model.params, strict=True):
        np.testing.assert_array_equal(cp.asnumpy(q.value), cp.asnumpy(p.value), err_msg=p.name)
