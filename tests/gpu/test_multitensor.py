"""One kernel over every parameter (mlptrain.step.cuda.multitensor): the optimizer update, the overflow check,
the loss-scaler update and the end-of-step bookkeeping, against their NumPy versions."""

import numpy as np
import pytest
from gpu_helpers import cp, f64, np_dtype

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("compute", ["float32", "float16", "bfloat16"])
def test_multi_tensor_optimizer_kernel_matches_numpy(name, compute):
    """One kernel over tensors of very different sizes (one element to many blocks), with a skipped step."""
    from mlptrain.config.schema import OptimizerConfig
    from mlptrain.nn.layers import Param
    from mlptrain.step.build import optimizer as make_optimizer

    rng = np.random.default_rng(11)
    shapes = [(37, 5), (1,), (300, 70), (3,)]
    w0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    cfg = OptimizerConfig(name=name, lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01)
    pg = [Param(f"w{i}", cp.asarray(w), np_dtype(compute)) for i, w in enumerate(w0)]
    pc = [Param(f"w{i}", w.copy(), np.float32) for i, w in enumerate(w0)]
    og, oc = make_optimizer(cfg, pg), make_optimizer(cfg, pc)
    for i in range(4):
        for a, b in zip(pg, pc, strict=True):
            g_half = (rng.standard_normal(a.value.shape).astype(np.float32) * 100).astype(np_dtype(compute))
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
            np.testing.assert_array_equal(f64(a.compute), f64(cp.asnumpy(a.value).astype(np_dtype(compute))))
        for s in og.state_names:
            np.testing.assert_allclose(cp.asnumpy(og.state[a.name][s]), oc.state[b.name][s], rtol=1e-5, atol=1e-6)


def test_nonfinite_check_and_scaler_update_kernels():
    from mlptrain.step.precision import LossScaler

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
    from mlptrain.step.cuda.multitensor import NonfiniteScan
    from mlptrain.step.precision import LossScaler

    s = LossScaler(cp, enabled=True)
    grads = [cp.ones(n + 1, np_dtype(dtype))[0 if aligned else 1 :][:n] for n in (5, 1, 2_000_000, 77)]
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
    from mlptrain.step.precision import LossScaler
    from mlptrain.step.schedule import LRSchedule, StepClock
    from mlptrain.step.steplog import StepLog

    logs = {}
    for xp in (np, cp):
        scaler = LossScaler(xp, enabled=True, init_scale=256.0, growth_interval=3)
        sched = LRSchedule(
            xp, StepClock(xp), base_lr=0.1, total_steps=12, schedule="cosine", warmup_steps=3, min_ratio=0.1
        )
        log = StepLog(xp, 4, scaler, sched)
        log.start_epoch(1.5, 7)
        lrs = []
        for k in range(11):
            scaler.found_inf[...] = int(k in (2, 5, 6))
            lrs.append(float(sched.lr))
            log.end_step(xp.asarray(0.5 + k, dtype=xp.float32), xp.asarray(k, dtype=xp.int64), 10 + k)
        logs[xp.__name__] = (log, lrs, log.read(7, 4), float(scaler.scale), int(sched.clock.device))
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
    from mlptrain.config.schema import OptimizerConfig
    from mlptrain.nn.layers import Param
    from mlptrain.step.build import optimizer as make_optimizer
    from mlptrain.step.precision import LossScaler
    from mlptrain.step.schedule import LRSchedule, StepClock
    from mlptrain.step.steplog import StepLog

    scaler = LossScaler(cp, enabled=True, init_scale=256.0, growth_interval=3)
    sched = LRSchedule(cp, StepClock(cp), base_lr=0.1, total_steps=12, schedule="cosine", warmup_steps=3, min_ratio=0.1)
    log = StepLog(cp, 4, scaler, sched)
    log.start_epoch(1.5, 7)
    p = Param("w", cp.ones(5000, cp.float32), cp.float16)  # several blocks: the tail runs once, in the last
    p.grad = cp.ones(5000, cp.float16)
    opt = make_optimizer(OptimizerConfig(momentum=0.0), [p])
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
    assert int(sched.clock.device) == 11 and int(log.epoch_correct) == 62 and float(opt.t) == 8


def lr_at_ref(k):
    from mlptrain.step.schedule import lr_at

    return lr_at(k, base_lr=0.1, total_steps=12, schedule="cosine", warmup_steps=3, min_ratio=0.1)
