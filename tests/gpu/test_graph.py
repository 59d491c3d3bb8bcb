"""CUDA graph capture of a step (mlptrain.step.cuda.graph): a toy step function, and the training step itself."""

import numpy as np
import pytest
from gpu_helpers import HAS_GPU, cp, gpu_trainer, graph_run, train_losses

pytestmark = pytest.mark.gpu

if HAS_GPU:
    from mlptrain.step.cuda.graph import GraphedStep


def test_a_toy_step_function_is_warmed_up_captured_and_replayed():
    """GraphedStep knows nothing of training: any ``step(x, y)`` of device arrays is replayed per batch shape."""
    state = cp.zeros(2, cp.float32)  # state the step updates in place, as an optimizer does its parameters
    restored = []

    def step(x, y):
        out = x.sum(axis=1) * 2 + y  # (B,), a fresh array each call: in the capture, from the graph's pool
        state[...] += out[:2]
        return out

    graphed = GraphedStep(step, keep=lambda: "what the step left", restore=restored.append, warmup=2)
    rng = np.random.default_rng(0)
    expected_state = np.zeros(2)
    outs = []
    with cp.cuda.Stream(non_blocking=True) as stream:
        for i in range(7):
            rows = 4 if i < 6 else 2  # a second batch shape: warmed up on its own
            x = rng.standard_normal((rows, 5)).astype(np.float32)
            y = rng.standard_normal(rows).astype(np.float32)
            out = graphed(cp.asarray(x), cp.asarray(y))
            np.testing.assert_allclose(cp.asnumpy(out), x.sum(axis=1) * 2 + y, rtol=1e-6)  # new inputs each replay
            expected_state += (x.sum(axis=1) * 2 + y)[:2]
            outs.append(out)
        stream.synchronize()
    np.testing.assert_allclose(cp.asnumpy(state), expected_state, rtol=1e-5)  # every call ran exactly once
    assert graphed.num_graphs == 1  # shape (4, 5) captured at its third call; (2, 5) only warmed up
    assert outs[2] is outs[3] is outs[5] and outs[0] is not outs[1] is not outs[2]  # replays rewrite one array
    assert restored == ["what the step left"] * 4  # after every replay, the capture's own included
    xs, ys = graphed.input_buffers((4, 5), np.float32, (4,), np.float32)
    with cp.cuda.Stream(non_blocking=True) as stream:
        xs[...] = 1.0
        ys[...] = 0.5
        assert float(graphed(xs, ys)[0]) == 10.5  # the graph reads its own buffers: no copy needed
        stream.synchronize()


def test_the_legacy_default_stream_runs_the_step_uncaptured():
    graphed = GraphedStep(lambda x, y: x + y, warmup=1)
    for _ in range(3):  # no non-default stream: nothing can be captured, the step still runs
        out = graphed(cp.ones(2), cp.ones(2))
    assert graphed.num_graphs == 0 and float(out[0]) == 2.0


@pytest.mark.parametrize("head", [True, False])
def test_step_is_the_gemms_and_mlptrains_kernels(head):
    """The captured fp16 step: its GEMMs plus exactly mlptrain's small kernels, no CuPy op left.

    With the head kernel the output layer's input gradient is mlptrain_head_dgrad: one GEMM fewer.
    """
    tr = gpu_trainer(
        **{"precision.name": "fp16", "data.drop_last": True, "execution.bgrad": "bgradb", "execution.head_kernel": head}
    )
    assert (tr.head.mode == "kernel") is head
    with tr.stream:
        train_losses(tr, 4)
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


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_graph_replay_equals_uncaptured_steps(precision):
    """Across an epoch boundary (with its smaller last batch) and a changing learning rate."""
    # digits: 21 batches per epoch at 64, the last of 14 samples: it warms up at steps 20 and 41,
    # is captured at step 62 and replayed at step 83
    steps = 84
    tg, lg = graph_run(True, steps, **{"precision.name": precision})
    te, le = graph_run(False, steps, **{"precision.name": precision})
    tc, lc = graph_run(True, steps, buffers=False, **{"precision.name": precision})  # batches copied in
    assert tg.graphed is not None and tg.graphed.num_graphs == 2  # full batch and last batch
    assert tg.step_count == te.step_count == steps
    np.testing.assert_array_equal(lg, le)
    np.testing.assert_array_equal(lc, le)
    for pg, pe, pc in zip(tg.model.params, te.model.params, tc.model.params, strict=True):
        cp.testing.assert_array_equal(pg.value, pe.value)
        cp.testing.assert_array_equal(pc.value, pe.value)
    assert float(tg.schedule.lr) == float(te.schedule.lr) != float(tg.schedule.host(0))


def test_a_step_that_gathers_its_own_batch_replays_the_losses_of_uncaptured_steps():
    """Trainer.train_batches (StepBatches.epoch): the graph gathers its batch from the device step count (one launch
    a step); the losses equal those of graph=false (the loader gathering each batch first), short last batches
    included."""
    runs = {}
    for graph in (True, False):
        settings = {"data.batch_size": 100, "optimizer.name": "adam", "optimizer.lr": 1e-3, "epochs": 3}
        tr = gpu_trainer(**settings, **{"execution.bgrad": "bgradb", "graph": graph})
        assert tr.batches.gathers_in_step is graph
        losses = []
        with tr.stream:
            for epoch in range(3):
                for x, y in tr.train_batches(epoch, 1 if epoch == 0 else 0):  # from batch 1, as a resume
                    losses.append(tr.step(x, y)[0].copy())
            tr.stream.synchronize()
        runs[graph] = np.array([float(v) for v in losses])
        if graph:
            names = tr.graphed.kernel_names()
            assert tr.graphed.num_graphs == 2 and any(n.startswith("mlptrain_gather_at_") for n in names), names
    assert len(runs[True]) == 3 * 13 - 1
    np.testing.assert_array_equal(runs[True], runs[False])


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_short_batch_is_captured_before_it_is_met_and_changes_nothing(precision):
    """#31: the short last batch's graph is captured once the first shape's graph exists (step 3 of epoch 0),
    not in the epoch where its warm-ups would end; capturing it takes no step (fp8's amax histories put back),
    so the run's losses, parameters and fp8 scales equal those of graph=false bit for bit."""
    runs = {}
    for graph in (True, False):
        settings = {"data.batch_size": 96, "model.hidden": [256, 256], "precision.name": precision, "epochs": 2}
        tr = gpu_trainer(**settings, **{"execution.bgrad": "bgradb", "graph": graph})
        losses = []
        with tr.stream:
            batches = tr.train_batches(0)
            for _ in range(3):  # two warm-up steps, then the capture of the full batch (and, with it, the short one)
                losses.append(tr.step(*next(batches))[0].copy())
            if graph:
                rows = tr.train_loader.row_counts()
                assert len(rows) == 2 and rows[1] < rows[0]
                assert tr.graphed.num_graphs == 2 and tr.graphed.captured(*tr.batches._own_batches[rows[1]], "gather")
            for x, y in batches:
                losses.append(tr.step(x, y)[0].copy())
            for x, y in tr.train_batches(1):
                losses.append(tr.step(x, y)[0].copy())
            tr.stream.synchronize()
        runs[graph] = {
            "losses": np.array([float(v) for v in losses]),
            "params": {p.name: cp.asnumpy(p.value) for p in tr.model.params},
            "scales": tr.gemm.scaling.state_dict() if precision == "fp8" else {},
        }
    assert len(runs[True]["losses"]) == 2 * tr.steps_per_epoch
    np.testing.assert_array_equal(runs[True]["losses"], runs[False]["losses"])
    for name, value in runs[False]["params"].items():
        np.testing.assert_array_equal(runs[True]["params"][name], value, err_msg=name)
    for key, value in runs[False]["scales"].items():
        np.testing.assert_array_equal(runs[True]["scales"][key], value, err_msg=key)
