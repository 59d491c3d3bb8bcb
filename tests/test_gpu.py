"""GPU tests: the nvmath engine against the NumPy epilog contract, and training on the GPU.

Marked ``gpu``; skipped where CuPy, nvmath or a CUDA device is missing (see conftest.py).
Run them with ``make test-gpu``; docs/bench/gpu-tests.log is the output of the last run on the H200.
"""

import json
import re
from collections import Counter

import numpy as np
import pytest

from mlptrain.backend import probe_gpu
from mlptrain.epilogs import Epilog, matmul, pack_relu_mask, relu_aux_shape, unpack_relu_mask

pytestmark = pytest.mark.gpu

if probe_gpu()[0]:  # imported only where they exist
    import cupy as cp

    from mlptrain.gpu import NvmathGemm

SHAPES = [(37, 19, 23), (128, 256, 64), (1000, 784, 256), (9, 130, 8)]  # (M, K, N), odd sizes included
DTYPES = ["float32", "float16", "bfloat16"]
TOL = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 6e-2}


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _rand(rng, shape, dtype, order="C"):
    a = rng.standard_normal(shape).astype(np.float32)
    return np.asarray(a.astype(_dtype(dtype)), order=order)


def _f64(a):
    return np.asarray(cp.asnumpy(a) if isinstance(a, cp.ndarray) else a).astype(np.float64)


def _close(actual, expected, dtype, what):
    actual, expected = _f64(actual), _f64(expected)
    scale = max(np.abs(expected).max(), 1e-6)
    err = np.abs(actual - expected).max() / scale
    assert err < TOL[dtype], f"{what}: max error {err:.3g} relative to max |ref| {scale:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_forward_relu_aux_bias_matches_contract(m, k, n, dtype):
    rng = np.random.default_rng(m + k + n)
    W, xT = _rand(rng, (m, k), dtype), _rand(rng, (n, k), dtype).T  # xT: F-order (K, N) view, as layers pass it
    bias = _rand(rng, (m,), dtype)
    gemm = NvmathGemm()
    d, aux = gemm("t.fwd", cp.asarray(W), cp.asarray(xT.T).T, Epilog.RELU_AUX_BIAS, bias=cp.asarray(bias))
    assert d.shape == (m, n) and d.flags.f_contiguous and d.dtype == W.dtype
    relu_aux = aux["relu_aux"]
    assert relu_aux.dtype == cp.uint8 and relu_aux.shape == relu_aux_shape(m, n)
    assert relu_aux.strides == (1, relu_aux_shape(m, n)[0])
    z = _f64(W) @ _f64(xT) + _f64(bias)[:, None]
    _close(d, np.maximum(z, 0), dtype, "RELU_AUX_BIAS result")
    # Mask bits equal the contract except where rounding can flip the sign of a near-zero z.
    bits = unpack_relu_mask(cp.asnumpy(relu_aux), m)
    decided = np.abs(z) > TOL[dtype] * np.abs(z).max()
    np.testing.assert_array_equal(bits[decided], (z >= 0)[decided])
    # And the mask is the one the GPU's own output implies.
    np.testing.assert_array_equal(bits[_f64(d) > 0], True)

    # Same GEMM, plan reused with new operands (reset_operands_unchecked), gives the new result.
    W2 = _rand(rng, (m, k), dtype)
    d2, _ = gemm("t.fwd", cp.asarray(W2), cp.asarray(xT.T).T, Epilog.RELU_AUX_BIAS, bias=cp.asarray(bias))
    assert gemm.num_plans == 1
    _close(d2, np.maximum(_f64(W2) @ _f64(xT) + _f64(bias)[:, None], 0), dtype, "re-executed plan")


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
    WT = _rand(rng, (k, m), dtype).T  # (M, K) F-order view: W^T of a (K, M) weight
    dzT = _rand(rng, (n, k), dtype).T  # (K, N) F-order view of a C-order (N, K) gradient
    mask = rng.random((m, n)) > 0.5
    relu_aux = pack_relu_mask(mask)
    gemm = NvmathGemm()
    g_WT, g_dzT = cp.asarray(WT.T).T, cp.asarray(dzT.T).T
    ref = _f64(WT) @ _f64(dzT) * mask
    d, aux = gemm("t.dgrad", g_WT, g_dzT, Epilog.DRELU_BGRAD, relu_aux=cp.asarray(relu_aux))
    assert d.flags.f_contiguous and aux["drelu_bgrad"].shape == (m,) and aux["drelu_bgrad"].dtype == d.dtype
    _close(d, ref, dtype, "DRELU_BGRAD result")
    _close(aux["drelu_bgrad"], ref.sum(axis=1), dtype, "drelu_bgrad")
    d, _ = gemm("t.drelu", g_WT, g_dzT, Epilog.DRELU, relu_aux=cp.asarray(relu_aux))
    _close(d, ref, dtype, "DRELU result")

    # Weight gradient with BGRADB: A = X^T (F-order view), B = dZ (C-order (K=batch, N=out)).
    xT = _rand(rng, (k, m), dtype).T  # (M, K)
    dz = _rand(rng, (k, n), dtype)  # (K, N)
    d, aux = gemm("t.wgrad", cp.asarray(xT.T).T, cp.asarray(dz), Epilog.BGRADB)
    assert d.flags.f_contiguous and aux["bgradb"].shape == (n,)
    _close(d, _f64(xT) @ _f64(dz), dtype, "BGRADB result")
    _close(aux["bgradb"], _f64(dz).sum(axis=0), dtype, "bgradb")


def _gpu_trainer(**overrides):
    from mlptrain.config import TrainConfig
    from mlptrain.train import Trainer

    cfg = TrainConfig()
    cfg.device = type(cfg.device)("gpu")
    cfg.progress = False
    for key, value in overrides.items():
        obj = cfg
        *path, last = key.split(".")
        for p in path:
            obj = getattr(obj, p)
        field_type = type(getattr(obj, last))
        setattr(obj, last, field_type(value) if hasattr(field_type, "__members__") else value)
    return Trainer(cfg)


@pytest.mark.parametrize(("mode", "head"), [("fused", False), ("naive", False), ("fused", True)])
@pytest.mark.parametrize("bgrad", ["bgradb", "drelu_bgrad"])
def test_whole_network_gradients_against_float64_cpu(mode, head, bgrad):
    from mlptrain.execution import FusedExecution, NumpyGemm
    from mlptrain.losses import softmax_cross_entropy
    from mlptrain.network import MLP

    widths, B = [45, 130, 77, 10], 61
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((B, widths[0])).astype(np.float32), rng.integers(0, 10, B)
    tr = _gpu_trainer(**{"execution.mode": mode, "execution.bgrad": bgrad})
    net = MLP(
        widths,
        execution=tr.execution,
        xp=cp,
        rng=np.random.default_rng(5),
        param_dtype=cp.float32,
        compute_dtype=cp.float32,
        bgrad=bgrad,
    )
    ref = MLP(
        widths,
        execution=FusedExecution(NumpyGemm()),
        xp=np,
        rng=np.random.default_rng(5),
        param_dtype=np.float64,
        compute_dtype=np.float64,
        bgrad=bgrad,
    )
    for lg, lr in zip(net.layers, ref.layers, strict=True):  # non-zero biases
        b = rng.standard_normal(lr.out_features) * 0.1
        lr.bias.value[...] = b
        lg.bias.value[...] = cp.asarray(b, cp.float32)
    logits = net.forward(cp.asarray(x))
    if head:  # the loss kernel computes the output layer's input gradient (mlptrain.head)
        from mlptrain.head import cross_entropy_head

        top, below = net.layers[-1], net.layers[-2]
        want = not below.bias_grad_in_wgrad
        _, d, _, db, dz, db_below = cross_entropy_head(
            logits, cp.asarray(y), 1.0, top.weight.compute, below.mask, bias_grad_below=want
        )
        net.backward(d, output_bias_grad=db, head_grad=(dz, db_below))
    else:
        _, d, _ = softmax_cross_entropy(logits, cp.asarray(y))
        net.backward(d)
    _, d, _ = softmax_cross_entropy(ref.forward(x.astype(np.float64)), y)
    ref.backward(d)
    for pg, pr in zip(net.params, ref.params, strict=True):
        _close(pg.grad, pr.grad, "float32", pg.name)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("compute", ["float32", "float16", "bfloat16"])
def test_multi_tensor_optimizer_kernel_matches_numpy(name, compute):
    """One kernel over tensors of very different sizes (one element to many blocks), with a skipped step."""
    from mlptrain.config import OptimizerConfig, OptimizerName
    from mlptrain.layers import Param
    from mlptrain.optim import make_optimizer

    rng = np.random.default_rng(11)
    shapes = [(37, 5), (1,), (300, 70), (3,)]
    w0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    cfg = OptimizerConfig(name=OptimizerName(name), lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01)
    pg = [Param(f"w{i}", cp.asarray(w), _dtype(compute)) for i, w in enumerate(w0)]
    pc = [Param(f"w{i}", w.copy(), np.float32) for i, w in enumerate(w0)]
    og, oc = make_optimizer(name, pg, cfg), make_optimizer(name, pc, cfg)
    for i in range(4):
        for a, b in zip(pg, pc, strict=True):
            g_half = (rng.standard_normal(a.value.shape).astype(np.float32) * 100).astype(_dtype(compute))
            a.grad = cp.asarray(g_half)
            b.grad = g_half.astype(np.float32) / 128.0
        skip = cp.asarray(1 if i == 1 else 0, dtype=cp.int32)
        og.step(cp.asarray(0.01), inv_scale=cp.asarray(1 / 128.0), skip=skip)
        if i != 1:
            oc.step(np.asarray(0.01))
    assert float(og.t) == float(oc.t) == 3  # applied steps: the skipped one does not count
    for a, b in zip(pg, pc, strict=True):
        np.testing.assert_allclose(cp.asnumpy(a.value), b.value, rtol=1e-5, atol=1e-6, err_msg=a.name)
        if a.has_compute_copy:
            np.testing.assert_array_equal(_f64(a.compute), _f64(cp.asnumpy(a.value).astype(_dtype(compute))))
        for s in og.state_names:
            np.testing.assert_allclose(cp.asnumpy(og.state[a.name][s]), oc.state[b.name][s], rtol=1e-5, atol=1e-6)


def _train_losses(tr, steps):
    losses = []
    for epoch in range(100):
        for x, y in tr.train_loader.epoch(epoch):
            loss, _ = tr.step(x, y)
            losses.append(loss)
            if len(losses) == steps:
                return np.array([float(v) for v in losses])
    return np.array([float(v) for v in losses])


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_fused_and_naive_train_alike_on_the_gpu(precision):
    runs = {}
    for mode in ("fused", "naive"):
        tr = _gpu_trainer(**{"execution.mode": mode, "precision.name": precision, "epochs": 10})
        losses = _train_losses(tr, 10 * tr.steps_per_epoch)
        runs[mode] = (losses, tr.evaluate("test")["test/acc"])
    (lf, af), (ln, an) = runs["fused"], runs["naive"]
    assert af > 0.95 and an > 0.95, (af, an)
    assert abs(af - an) <= 0.02
    early = slice(0, 50)  # before rounding differences compound: the curves must coincide
    rtol, atol = {"fp32": (1e-4, 0), "fp16": (3e-2, 5e-3), "bf16": (6e-2, 1e-2)}[precision]
    np.testing.assert_allclose(lf[early], ln[early], rtol=rtol, atol=atol)
    # whole curve: epoch means agree
    n = len(lf) // 10 * 10
    np.testing.assert_allclose(lf[:n].reshape(10, -1).mean(1), ln[:n].reshape(10, -1).mean(1), rtol=0.25, atol=0.02)


def test_fp16_loss_scaling_survives_injected_overflow():
    """Start with a loss scale far beyond fp16's range: every first step overflows."""
    tr = _gpu_trainer(**{"precision.name": "fp16", "precision.init_scale": 2.0**40, "epochs": 8})
    before = [p.value.copy() for p in tr.model.params]
    x, y = next(iter(tr.train_loader.epoch(0)))
    tr.step(x, y)
    assert int(tr.scaler.found_inf) == 1 and float(tr.scaler.scale) == 2.0**39
    for p, b in zip(tr.model.params, before, strict=True):
        cp.testing.assert_array_equal(p.value, b)  # skipped: weights untouched
    skipped = 1
    for epoch in range(8):
        for x, y in tr.train_loader.epoch(epoch):
            tr.step(x, y)
            skipped += int(tr.scaler.found_inf)
    assert 10 <= skipped <= 40  # about log2(2**40 / 2**16): backs off until gradients fit
    assert float(tr.scaler.scale) < 2.0**30
    assert tr.evaluate("test")["test/acc"] > 0.9


@pytest.mark.parametrize("dtype", DTYPES)
# one block (B <= 1024, C <= 32, B * C <= 10240: 1024 x 10 and 320 x 32 at the limit) and the two-kernel path
@pytest.mark.parametrize(
    ("B", "C"), [(7, 3), (256, 10), (1024, 10), (320, 32), (1024, 32), (1025, 10), (256, 33), (1000, 4096)]
)
def test_cross_entropy_kernels_match_numpy(dtype, B, C):
    from mlptrain.losses import softmax_cross_entropy

    rng = np.random.default_rng(B + C)
    z = _rand(rng, (B, C), dtype) * 4
    y = rng.integers(0, C, B)
    loss, d, correct = softmax_cross_entropy(cp.asarray(z), cp.asarray(y), cp.asarray(512.0))
    ref_loss, ref_d, ref_correct = softmax_cross_entropy(_f64(z), y, 512.0)
    assert d.dtype == z.dtype and d.shape == (B, C) and d.flags.c_contiguous
    assert abs(float(loss) - float(ref_loss)) < 1e-5 * max(1.0, abs(float(ref_loss)))
    _close(d, ref_d, dtype, "cross-entropy gradient")
    assert int(correct) == int(ref_correct)
    # The output layer's bias gradient from the reduction kernel (both of its paths: C <= 256 and not)
    *_, db = softmax_cross_entropy(cp.asarray(z), cp.asarray(y), cp.asarray(512.0), bias_grad=True)
    assert db.dtype == z.dtype and db.shape == (C,)
    _close(db, _f64(d).sum(axis=0), dtype, "output bias gradient")


def test_nonfinite_check_and_scaler_update_kernels():
    from mlptrain.precision import LossScaler

    s = LossScaler(cp, enabled=True, init_scale=1024.0, growth_interval=2)
    half = cp.ones(1000, cp.float16)
    seq = []
    for bad in [cp.inf, None, None, cp.nan, None]:
        g = half.copy()
        if bad is not None:
            g[537] = bad
        s.check([cp.ones(3, cp.float16), g])
        found = int(s.found_inf)
        s.update()
        seq.append((found, float(s.scale), int(s.growth_tracker), int(s.consecutive_skips)))
    assert seq == [(1, 512.0, 0, 1), (0, 512.0, 1, 0), (0, 1024.0, 0, 0), (1, 512.0, 0, 1), (0, 512.0, 1, 0)]
    assert float(s.inv_scale) == 1 / 512.0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("where", [None, (0, 0), (1, 0), (2, 777_777), (2, 2_000_000 - 1), (3, 0), (3, 76)])
def test_nonfinite_check_finds_one_bad_element_anywhere(where, aligned, dtype):
    """One launch over many blocks: a single inf or NaN in any tensor, in a 16-byte vector or a
    tensor's scalar tail (77 = 9 vectors of 8 + 5), first or last element. Arrays that do not start
    on a 16-byte boundary take the element-by-element kernel, with the same answers."""
    from mlptrain.multitensor import NonfiniteScan
    from mlptrain.precision import LossScaler

    s = LossScaler(cp, enabled=True)
    grads = [cp.ones(n + 1, _dtype(dtype))[0 if aligned else 1 :][:n] for n in (5, 1, 2_000_000, 77)]
    assert NonfiniteScan.fits(grads) == aligned
    for rep in range(3):  # repeated launches: the last-block counter and the flag reset themselves
        if where is not None:
            grads[where[0]][where[1]] = cp.inf if rep % 2 == 0 else cp.nan
        assert int(s.check(grads)) == (where is not None)
        if where is not None:
            grads[where[0]][where[1]] = 1
        assert int(s.check(grads)) == 0
    assert (type(s._check_kernel) is NonfiniteScan) == aligned


def test_end_of_step_kernel_matches_numpy_bookkeeping():
    """StepLog.end_step on the GPU (one kernel) against the same bookkeeping in NumPy."""
    from mlptrain.optim import LRSchedule
    from mlptrain.precision import LossScaler
    from mlptrain.steplog import StepLog

    logs = {}
    for xp in (np, cp):
        scaler = LossScaler(xp, enabled=True, init_scale=256.0, growth_interval=3)
        sched = LRSchedule(xp, base_lr=0.1, total_steps=12, schedule="cosine", warmup_steps=3, min_ratio=0.1)
        log = StepLog(xp, 4, scaler, sched)
        log.start_epoch(1.5, 7)
        lrs = []
        for k in range(11):
            scaler.found_inf[...] = int(k in (2, 5, 6))
            lrs.append(float(sched.lr))
            log.end_step(xp.asarray(0.5 + k, dtype=xp.float32), xp.asarray(k, dtype=xp.int64), 10 + k)
        logs[xp.__name__] = (log, lrs, log.read(7, 4), float(scaler.scale), int(sched.step))
    (lc, lrc, rc, sc, stc), (lg, lrg, rg, sg, stg) = logs["numpy"], logs["cupy"]
    _end_of_step_as_optimizer_tail(rc)
    assert stc == stg == 11 and sc == sg
    np.testing.assert_allclose(lrg, lrc, rtol=1e-15)
    np.testing.assert_allclose(lrc, [lr_at_ref(k) for k in range(11)], rtol=1e-12)
    for key in ("loss", "correct", "skip", "scale"):
        np.testing.assert_array_equal(rg[key], rc[key], err_msg=key)
    assert list(rc["loss"]) == [7.5, 8.5, 9.5, 10.5] and list(rc["skip"]) == [0, 0, 0, 0]
    assert float(lg.epoch_loss) == float(lc.epoch_loss) and int(lg.epoch_correct) == int(lc.epoch_correct) == 62


def _end_of_step_as_optimizer_tail(expected):
    """The same bookkeeping run by the last block of the optimizer kernel, as the training step runs it."""
    from mlptrain.config import OptimizerConfig
    from mlptrain.layers import Param
    from mlptrain.optim import LRSchedule, make_optimizer
    from mlptrain.precision import LossScaler
    from mlptrain.steplog import StepLog

    scaler = LossScaler(cp, enabled=True, init_scale=256.0, growth_interval=3)
    sched = LRSchedule(cp, base_lr=0.1, total_steps=12, schedule="cosine", warmup_steps=3, min_ratio=0.1)
    log = StepLog(cp, 4, scaler, sched)
    log.start_epoch(1.5, 7)
    p = Param("w", cp.ones(5000, cp.float32), cp.float16)  # several blocks: the tail runs once, in the last
    p.grad = cp.ones(5000, cp.float16)
    opt = make_optimizer("sgd", [p], OptimizerConfig(momentum=0.0))
    for k in range(11):
        scaler.found_inf[...] = int(k in (2, 5, 6))
        opt.step(
            sched.lr,
            scaler.inv_scale,
            scaler.found_inf,
            tail=log.tail(cp.asarray(0.5 + k, cp.float32), cp.asarray(k, cp.int64), 10 + k),
        )
    got = log.read(7, 4)
    for key in ("loss", "correct", "skip", "scale"):
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert int(sched.step) == 11 and int(log.epoch_correct) == 62 and float(opt.t) == 8


def lr_at_ref(k):
    from mlptrain.optim import lr_at

    return lr_at(k, base_lr=0.1, total_steps=12, schedule="cosine", warmup_steps=3, min_ratio=0.1)


def test_cross_entropy_kernel_ties_bad_labels_and_tiny_shapes():
    from mlptrain.losses import softmax_cross_entropy

    z = np.array([[1, 3, 3, 0], [2, 2, 2, 2], [0, 0, 5, 5], [-1, -2, -1, -3]], np.float16)  # ties: first index
    for y in ([1, 0, 2, 0], [2, 1, 3, 2]):
        for reps in (1, 300):  # the one-block kernel (B <= 1024) and the warp-per-row kernel
            zz, yy = np.tile(z, (reps, 1)), np.tile(y, reps)
            _, _, correct = softmax_cross_entropy(cp.asarray(zz), cp.asarray(yy))
            assert int(correct) == int((zz.argmax(axis=1) == yy).sum()) == reps * int((z.argmax(axis=1) == y).sum())
    loss, d, correct = softmax_cross_entropy(cp.asarray(np.zeros((1, 1), np.float32)), cp.asarray([0]))
    assert float(loss) == 0.0 and float(d[0, 0]) == 0.0 and int(correct) == 1
    for reps in (1, 300):
        zz, yy = np.tile(z.astype(np.float32), (reps, 1)), np.tile([0, 1, 4, 2], reps)
        loss, _, _ = softmax_cross_entropy(cp.asarray(zz), cp.asarray(yy))
        assert np.isnan(float(loss))  # label 4 of 4 classes: NaN, not a read past the row


@pytest.mark.parametrize("head", [True, False])
def test_step_is_the_gemms_and_mlptrains_kernels(head):
    """The captured fp16 step: its GEMMs plus exactly mlptrain's small kernels, no CuPy op left.

    With the head kernel the output layer's input gradient is mlptrain_head_dgrad: one GEMM fewer.
    """
    tr = _gpu_trainer(
        **{"precision.name": "fp16", "data.drop_last": True, "execution.bgrad": "bgradb", "execution.head_kernel": head}
    )
    assert tr.head_kernel is head
    with tr.stream:
        _train_losses(tr, 4)
    names = tr.graphed.kernel_names()
    ours = [n for n in names if n.startswith("mlptrain_")]
    assert ours == [
        "mlptrain_xent_small",  # 10 classes: the one-block loss kernel
        *(["mlptrain_head_dgrad"] if head else []),  # the output layer's input gradient
        "mlptrain_check_nonfinite",
        "mlptrain_sgd_step",  # its last block ends the step (StepLog.tail)
    ], names
    assert not [n for n in names if n.startswith("cupy_")], names
    gemms = 3 * len(tr.model.layers) - 1 - head  # fwd and wgrad per layer, dgrad for all but the first
    assert len(names) - len(ours) >= gemms  # at least one kernel per GEMM
    assert tr.gemm.num_plans == gemms


@pytest.mark.parametrize(("graph", "bgrad"), [(True, "bgradb"), (True, "drelu_bgrad"), (False, "bgradb")])
def test_two_stream_backward_equals_one_stream(graph, bgrad):
    """Weight gradients on a side stream: the same kernels on the same operands, so the same bits.

    A missing fork or join, or memory reused while the other stream still reads it, changes the
    gradients of some step; 84 steps span two epochs, a last short batch and its own graph.
    """
    cfg = {"precision.name": "fp16", "execution.bgrad": bgrad}
    t2, l2 = _graph_run(graph, 84, **cfg)
    t1, l1 = _graph_run(graph, 84, **cfg, **{"execution.wgrad_stream": False})
    assert t2.model._wgrad is not None and t1.model._wgrad is None
    np.testing.assert_array_equal(l2, l1)
    for p2, p1 in zip(t2.model.params, t1.model.params, strict=True):
        cp.testing.assert_array_equal(p2.value, p1.value)
    if graph:  # the captured step forks: some node has two successors (dX and dW of the same dZ)
        graph2 = next(g.graph for g in t2.graphed._shapes.values() if g.graph is not None)
        graph1 = next(g.graph for g in t1.graphed._shapes.values() if g.graph is not None)
        assert _max_out_degree(graph2) >= 2 and _max_out_degree(graph1) == 1


def _max_out_degree(graph):
    edges = re.findall(r'"[^"]*?(\d+)"\s*->\s*"', graph.debug_dot_str())
    return max(Counter(edges).values())


def test_plans_are_made_once_and_reused():
    # a fixed bgrad: "auto" times the step both ways at start-up, planning both sets of GEMMs
    tr = _gpu_trainer(**{"data.drop_last": True, "execution.bgrad": "drelu_bgrad"})
    _train_losses(tr, 5)
    n = tr.gemm.num_plans
    # fwd, wgrad per layer; dgrad for all but the first, and not the output layer's (the head kernel's)
    assert tr.head_kernel and n == 3 * len(tr.model.layers) - 2
    _train_losses(tr, 20)
    assert tr.gemm.num_plans == n


def _graph_run(graph, steps, buffers=True, **overrides):
    tr = _gpu_trainer(
        **{
            "data.batch_size": 64,
            "optimizer.name": "adam",
            "optimizer.lr": 1e-3,
            "epochs": 4,
            "execution.bgrad": "bgradb",  # not "auto": both runs must make the same (measured) choice
            "graph": graph,
            **overrides,
        }
    )
    losses = []
    with cp.cuda.Stream(non_blocking=True):
        for epoch in range(4):
            # buffers: gathered into the graph's inputs, as the training loop does; else copied in
            for x, y in tr.train_loader.epoch(epoch, out=tr.batch_buffers if buffers else None):
                losses.append(tr.step(x, y)[0].copy())  # a replayed graph rewrites the same loss array
                if len(losses) == steps:
                    break
            if len(losses) == steps:
                break
        cp.cuda.get_current_stream().synchronize()
    return tr, np.array([float(v) for v in losses])


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_graph_replay_equals_uncaptured_steps(precision):
    """Across an epoch boundary (with its smaller last batch) and a changing learning rate."""
    # digits: 21 batches per epoch at 64, the last of 14 samples: it warms up at steps 20 and 41,
    # is captured at step 62 and replayed at step 83
    steps = 84
    tg, lg = _graph_run(True, steps, **{"precision.name": precision})
    te, le = _graph_run(False, steps, **{"precision.name": precision})
    tc, lc = _graph_run(True, steps, buffers=False, **{"precision.name": precision})  # batches copied in
    assert tg.graphed is not None and tg.graphed.num_graphs == 2  # full batch and last batch
    assert tg.step_count == te.step_count == steps
    np.testing.assert_array_equal(lg, le)
    np.testing.assert_array_equal(lc, le)
    for pg, pe, pc in zip(tg.model.params, te.model.params, tc.model.params, strict=True):
        cp.testing.assert_array_equal(pg.value, pe.value)
        cp.testing.assert_array_equal(pc.value, pe.value)
    assert float(tg.schedule.lr) == float(te.schedule.lr) != float(tg.schedule.host(0))


def test_plan_cache_skips_planning_in_a_second_run(tmp_path):
    from mlptrain.gpu import PlanCache

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
    from mlptrain.gpu import PlanCache

    rng = np.random.default_rng(8)
    W, x, b = _rand(rng, (1024, 784), "float16"), _rand(rng, (256, 784), "float16"), _rand(rng, (1024,), "float16")
    cache = PlanCache(tmp_path / "plans.npz")
    gemm = NvmathGemm(autotune=True, plan_cache=cache)
    d, aux = gemm("t.fwd", cp.asarray(W), cp.asarray(x).T, Epilog.RELU_AUX_BIAS, bias=cp.asarray(b))
    ref, ref_aux = matmul(_f64(W), _f64(x).T, epilog=Epilog.RELU_AUX_BIAS, epilog_inputs={"bias": _f64(b)})
    _close(d, ref, "float16", "autotuned RELU_AUX_BIAS")
    assert (
        unpack_relu_mask(cp.asnumpy(aux["relu_aux"]), 1024) == unpack_relu_mask(ref_aux["relu_aux"], 1024)
    ).mean() > 0.999
    assert any(k.startswith("tuned-") for k in PlanCache(tmp_path / "plans.npz")._algos)  # kept for the next run
    gemm.free()


# (B, C, H): MNIST's, odd sizes, rows beyond one pass of 256 threads, the limits of B and C, a wide layer
HEAD_SHAPES = [(256, 10, 1024), (7, 3, 33), (1024, 10, 100), (320, 32, 64), (1, 2, 5), (300, 10, 2000)]


def _head_inputs(B, C, H, dtype, seed=0):
    rng = np.random.default_rng(seed + B + C + H)
    z = _rand(rng, (B, C), dtype) * 4
    y = rng.integers(0, C, B)
    W = _rand(rng, (C, H), dtype)
    mask = rng.random((H, B)) > 0.4  # the layer below's Z >= 0, (H, B) as the forward GEMM's result
    aux = pack_relu_mask(mask)  # (Mb, B) uint8 column-major, cuBLASLt's relu_aux layout
    aux_dev = cp.asarray(np.ascontiguousarray(aux.T)).T  # the same layout on the device
    return z, y, W, mask, aux, aux_dev


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("B", "C", "H"), HEAD_SHAPES)
@pytest.mark.parametrize("want_db", [True, False])
def test_head_kernel_matches_loss_then_drelu_bgrad_contract(B, C, H, dtype, want_db):
    """cross_entropy_head = the loss kernel, then DRELU_BGRAD of (dlogits @ W) with relu_aux."""
    from mlptrain.head import cross_entropy_head
    from mlptrain.losses import softmax_cross_entropy

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
    got = _f64(dz)
    assert (got[~mask.T] == 0).all()  # dReLU: exactly zero where the layer below's ReLU was off
    _close(got, dzt_ref.T, dtype, "dZ_below")
    if dtype == "float32":  # ten float32 products: only the summation order differs
        np.testing.assert_allclose(got, _f64(dzt_ref.T), rtol=1e-5, atol=1e-6 * np.abs(got).max())
    if want_db:
        assert db_below.shape == (H,) and db_below.dtype == z.dtype
        _close(db_below, got.sum(axis=0), dtype, "db_below")  # sums what dZ_below holds
        _close(db_below, _f64(aux_out["drelu_bgrad"]), dtype, "db_below against the contract")
    else:
        assert db_below is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_kernel_matches_cublaslt_drelu_bgrad(dtype):
    """The kernel against the GEMM it replaces: nvmath's DRELU_BGRAD at K = 10 on the same operands."""
    from mlptrain.execution import FusedExecution
    from mlptrain.head import cross_entropy_head

    z, y, W, mask, aux, aux_dev = _head_inputs(256, 10, 1024, dtype, seed=1)
    Wc = cp.asarray(W)
    _, d, _, _, dz, db_below = cross_entropy_head(cp.asarray(z), cp.asarray(y), 1.0, Wc, aux_dev)
    dz_gemm, db_gemm = FusedExecution(NvmathGemm()).input_grad("t", Wc, d, aux_dev, bias_grad_below=True)
    _close(dz, dz_gemm, dtype, "dZ_below against cuBLASLt")
    _close(db_below, db_gemm, dtype, "db_below against cuBLASLt")
    assert ((cp.asnumpy(dz) == 0) == (cp.asnumpy(dz_gemm) == 0)).mean() > 0.999  # the same mask applied


def test_head_kernel_refuses_operands_that_do_not_fit():
    from mlptrain.head import cross_entropy_head

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
        tr, losses = _graph_run(True, 84, **cfg)
        assert tr.head_kernel is head and tr.graphed.num_graphs == 2
        runs[head] = (tr, losses)
    (tk, lk), (tg, lg) = runs[True], runs[False]
    rtol = {"fp32": 1e-4, "fp16": 2e-2}[precision]
    np.testing.assert_allclose(lk, lg, rtol=rtol)
    for pk, pg in zip(tk.model.params, tg.model.params, strict=True):
        _close(pk.value, pg.value, "float32" if precision == "fp32" else "float16", pk.name)


def test_bgrad_probe_times_the_step_and_remembers_its_choice(tmp_path):
    from mlptrain.gpu import choose_bgrad

    tr = _gpu_trainer(**{"execution.bgrad": "bgradb", "precision.name": "fp16"})
    x, y = next(iter(tr.train_loader.epoch(0)))
    calls = []

    def forward_backward():
        calls.append(list(tr.model.bgrad))
        return tr.forward_backward(x, y)

    store = tmp_path / "bgrad.json"
    with tr.stream:
        chosen = choose_bgrad(tr.model, forward_backward, "k", reps=3, store=store)
    hidden = len(tr.model.layers) - 1
    assert len(chosen) == hidden and set(chosen) <= {"drelu_bgrad", "bgradb"}
    assert tr.model.bgrad == chosen
    # each hidden layer was timed both ways (a warm-up and a capture each), the layer above first
    tried = [c for i, c in enumerate(calls) if i % 2 == 0]
    assert len(tried) == 2 * hidden
    assert {t[-1] for t in tried[:2]} == {"drelu_bgrad", "bgradb"}
    assert {t[0] for t in tried[-2:]} == {"drelu_bgrad", "bgradb"}
    assert json.loads(store.read_text()) == {"k": chosen}
    calls.clear()
    tr.model.set_bgrad("drelu_bgrad" if chosen[0] == "bgradb" else "bgradb")
    again = choose_bgrad(tr.model, forward_backward, "k", store=store)
    assert again == chosen and not calls  # remembered: not timed again
