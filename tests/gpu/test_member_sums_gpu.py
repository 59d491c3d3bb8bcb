"""An ensemble's per-member sums on the GPU (mlptrain/nn/cuda/members.py): the members' mean row losses and counts
in one block, and the step's tally (the epoch's per-member sums, the step log's two means) in one thread, against
NumPy's formulas; the same bits on every launch; the tally captured in a CUDA graph adds once per replay. Written on
a CPU machine: the GPU issue runs it."""

import functools
import threading
from typing import Any

import numpy as np
import pytest
from gpu_helpers import HAS_GPU, cp

pytestmark = pytest.mark.gpu

if HAS_GPU:
    from mlptrain.nn.cuda.members import member_means, tally_members

# B below, at and above a warp's 32 rows and the 32 W rows a turn takes, none a multiple of the block's 1024
ROWS = [1, 37, 1000, 2049]


def rows_of(rng: np.random.Generator, k: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """``(row_loss (K * B,) float32, row_ok (K * B,) int32)``: each member's losses around its own level (a member
    summed with another's rows, or divided by another B, gets another mean)."""
    level = np.repeat(np.arange(1, k + 1, dtype=np.float64), b)
    row_loss = (level * rng.uniform(0.5, 1.5, k * b)).astype(np.float32)
    return row_loss, (rng.uniform(size=k * b) < 0.3 + 0.4 * rng.uniform()).astype(np.int32)


@pytest.mark.parametrize("b", ROWS)
@pytest.mark.parametrize("k", [1, 3, 32, 45])
def test_the_members_means_are_each_members_mean_and_count(k: int, b: int) -> None:
    row_loss, row_ok = rows_of(np.random.default_rng(k * 10_000 + b), k, b)
    loss, correct = member_means(cp.asarray(row_loss), cp.asarray(row_ok), k)
    assert loss.shape == correct.shape == (k,) and loss.dtype == np.float32 and correct.dtype == np.int64
    want = (row_loss.astype(np.float64).reshape(k, b).sum(axis=1) / b).astype(np.float32)  # float64 sums, as the kernel
    np.testing.assert_allclose(cp.asnumpy(loss), want, rtol=2e-7)  # the order of a float64 sum: under 1 ulp of fp32
    np.testing.assert_array_equal(cp.asnumpy(correct), row_ok.reshape(k, b).sum(axis=1))


def test_the_members_means_are_the_same_bits_on_every_launch() -> None:
    k, b = 5, 3001
    row_loss, row_ok = rows_of(np.random.default_rng(1), k, b)
    on = cp.asarray(row_loss), cp.asarray(row_ok)
    first = cp.asnumpy(member_means(*on, k)[0])
    for _ in range(5):
        np.testing.assert_array_equal(cp.asnumpy(member_means(*on, k)[0]).view(np.uint32), first.view(np.uint32))


def tally_reference(loss: np.ndarray, correct: np.ndarray, rows: int, sums: tuple) -> tuple:
    """The CPU's :meth:`EnsembleTrainer.step_metrics`: ``member_loss += loss * rows`` (the product in ``loss``'s
    dtype), ``member_correct += correct``; the members' mean loss and mean count rounded to a whole row."""
    k = len(loss)
    member_loss = sums[0] + (loss * loss.dtype.type(rows)).astype(np.float64)
    member_correct = sums[1] + correct
    mean_loss = loss.dtype.type(loss.astype(np.float64).sum() / k)
    return member_loss, member_correct, mean_loss, (correct.sum() + k // 2) // k


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", [1, 3, 32])
def test_the_tally_adds_each_members_sums_and_gives_the_step_logs_means(k: int, dtype: Any) -> None:
    rng = np.random.default_rng(k)
    sums = (rng.uniform(0, 1e3, k), rng.integers(0, 10_000, k))
    on_device = cp.asarray(sums[0]), cp.asarray(sums[1])
    for rows in (37, 1000, 37):  # three steps, the epoch's sums growing; the short batch again
        loss, correct = rng.uniform(0.01, 3.0, k).astype(dtype), rng.integers(0, rows + 1, k)
        mean_loss, mean_correct = tally_members(cp.asarray(loss), cp.asarray(correct), rows, *on_device)
        member_loss, member_correct, want_loss, want_correct = tally_reference(loss, correct, rows, sums)
        sums = (member_loss, member_correct)
        np.testing.assert_array_equal(cp.asnumpy(on_device[0]), sums[0])  # bit for bit: the same two roundings
        np.testing.assert_array_equal(cp.asnumpy(on_device[1]), sums[1])
        assert mean_loss.shape == mean_correct.shape == () and mean_loss.dtype == dtype
        rtol = 2.4e-7 if dtype is np.float32 else 1e-13  # fp32: a float64 sum rounded (1 ulp); fp64: the sum's order
        np.testing.assert_allclose(float(mean_loss), float(want_loss), rtol=rtol)
        assert int(mean_correct) == int(want_correct)


def test_the_tally_in_a_cuda_graph_adds_once_per_replay() -> None:
    from mlptrain.base.cuda.timing import capture_graph

    k, rows = 4, 256
    loss = cp.asarray(np.array([0.5, 1.25, 2.0, 0.125], np.float32))
    correct = cp.asarray(np.array([100, 7, 0, 256], np.int64))
    member_loss, member_correct = cp.zeros(k, cp.float64), cp.zeros(k, cp.int64)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        tally_members(loss, correct, rows, cp.zeros(k, cp.float64), cp.zeros(k, cp.int64))  # the pool's blocks, once
        graph, means = capture_graph(lambda: tally_members(loss, correct, rows, member_loss, member_correct), stream)
        assert not member_loss.any()  # captured, not run
        for _ in range(3):
            graph.launch(stream)
        stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(member_loss), 3 * rows * np.array([0.5, 1.25, 2.0, 0.125]))
    np.testing.assert_array_equal(cp.asnumpy(member_correct), [300, 21, 0, 768])
    assert float(means[0]) == np.float32((0.5 + 1.25 + 2.0 + 0.125) / 4) and int(means[1]) == (363 + 2) // 4


@pytest.mark.parametrize("k", [1, 3, 32])
def test_the_members_loss_is_each_members_numpy_loss(k: int) -> None:
    """The row kernel over the K * B rows, then the members' means: member k's loss and count are its own."""
    from mlptrain.nn.cuda.losses import member_cross_entropy_gpu
    from mlptrain.nn.losses import softmax_cross_entropy

    rng = np.random.default_rng(k + 100)
    b, c = 37, 10
    logits = (3 * rng.standard_normal((k, b, c))).astype(np.float32)
    y = rng.integers(0, c, (k, b))
    loss, _, correct = member_cross_entropy_gpu(cp.asarray(logits), cp.asarray(y), cp.asarray(1.0))
    for m in range(k):
        want_loss, _, want_correct = softmax_cross_entropy(logits[m].astype(np.float64), y[m], 1.0)
        np.testing.assert_allclose(float(loss[m]), float(want_loss), rtol=1e-5, err_msg=f"member {m}")
        assert int(correct[m]) == int(want_correct), m


@pytest.mark.parametrize("c", [2, 10, 16, 17])
def test_a_members_rows_are_the_single_models_rows(c: int) -> None:
    """Up to 16 classes a thread takes a row (mlptrain_xent_thread_rows): each member's dlogits are the single
    model's one-block kernel's (mlptrain_xent_small) bit for bit, its loss that kernel's within the order of a float64
    sum; 17 classes take the warp kernel. Ties keep the first column, as numpy.argmax; a bad label gives NaN."""
    import ml_dtypes

    from mlptrain.nn.cuda.losses import member_cross_entropy_gpu, small_head, softmax_cross_entropy_gpu

    k, b = 5, 200
    rng = np.random.default_rng(c)
    logits = np.round(2 * rng.standard_normal((k, b, c))).astype(ml_dtypes.bfloat16)  # (rounded: many ties)
    y = rng.integers(0, c, (k, b))
    y[3, 7] = -1  # member 3's loss is NaN, the others are not
    scale = cp.asarray(128.0)
    loss, d, correct = member_cross_entropy_gpu(cp.asarray(logits), cp.asarray(y), scale)
    assert small_head(b, c)
    for m in range(k):
        one_loss, one_d, one_correct = softmax_cross_entropy_gpu(cp.asarray(logits[m]), cp.asarray(y[m]), scale, False)
        bits = cp.asnumpy(d[m]).view(np.uint16), cp.asnumpy(one_d).view(np.uint16)
        if c <= 16:
            np.testing.assert_array_equal(*bits, err_msg=f"member {m}")
        else:
            np.testing.assert_allclose(
                cp.asnumpy(d[m]).astype(np.float32), cp.asnumpy(one_d).astype(np.float32), rtol=1e-2, atol=1e-6
            )
        if m == 3:
            assert np.isnan(float(loss[m])) and np.isnan(float(one_loss))
        else:
            assert float(loss[m]) == pytest.approx(float(one_loss), rel=1e-6), m
        assert int(correct[m]) == int(one_correct) == int((logits[m].astype(np.float32).argmax(-1) == y[m]).sum()), m


def test_a_cold_ensemble_run_compiles_the_members_kernels_ahead(tmp_path: Any) -> None:
    """From an empty kernel cache, an ensemble's loss kernels, tally and head kernel (the default run's small head
    takes it) compile on the precompile threads, none at its first launch on the main thread (the single model's
    cold run: tests/gpu/test_precompile_gpu.py)."""
    import json
    import os
    import subprocess
    import sys

    from test_precompile_gpu import COLD_RUN, REPO

    script = COLD_RUN.replace("cfg.epochs = 2\n", "cfg.epochs = 2\ncfg.ensemble.size = 4\n")
    assert script != COLD_RUN
    env = {**os.environ, "CUPY_CACHE_DIR": str(tmp_path / "cupy"), "MLPTRAIN_DATA": str(tmp_path / "mlptrain")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = [sys.executable, "-c", script, "fp32", str(tmp_path / "run")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "NO-SPY" in proc.stdout:
        pytest.skip("this CuPy compiles through another function than _compile_using_nvrtc_no_warning")
    compiles = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("COMPILES "))[9:])
    where = {k: c["thread"] for c in compiles for k in c["kernels"]}
    members = ("mlptrain_xent_thread_rows", "mlptrain_member_means", "mlptrain_member_tally")
    members += ("mlptrain_member_head_dgrad",)  # (digits: 10 classes, a thread a row)
    assert all(where.get(k, "").startswith("mlptrain-precompile") for k in members), where


@pytest.mark.parametrize("graph", [False, True])
def test_the_members_sums_run_beside_the_backward_and_add_up_every_step(
    graph: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a training step the means and the tally run on their own stream (MemberSums), joined before the update:
    both launch there (a graph records them where they were launched), and the epoch's per-member sums are still
    every step's loss times its rows (rounded to float32, added in float64) and every step's count, from zero again
    after an epoch's end; the next step sees the last one's tally (a race would lose or repeat a step)."""
    from test_ensemble_gpu import K, ensemble_cfg

    import mlptrain.nn.cuda.members as members
    from mlptrain.run.ensemble import EnsembleTrainer

    launched: dict[str, set[tuple[int, int]]] = {"member_means": set(), "tally_members": set()}  # (thread, stream)

    def spy(name: str, fn: Any, *args: Any) -> Any:
        launched[name].add((threading.get_ident(), cp.cuda.get_current_stream().ptr))
        return fn(*args)

    for name in launched:
        monkeypatch.setattr(members, name, functools.partial(spy, name, getattr(members, name)))
    tr = EnsembleTrainer(ensemble_cfg("gpu", graph))
    with tr.stream:
        for steps in (12, 5):  # two "epochs": the sums start again from zero after epoch_extras
            losses, counts, rows = [], [], 0
            for step, (x, y) in enumerate(tr.train_batches(0)):
                loss, correct = tr.step(x, y)
                losses.append(cp.asnumpy(loss))
                counts.append(cp.asnumpy(correct))
                rows += tr.batch_rows(y)
                if step == steps - 1:
                    break
            extras = tr.epoch_extras()
            b = tr.batch_rows(y)
            want_loss = np.sum([(lo * np.float32(b)).astype(np.float64) for lo in losses], axis=0) / rows
            want_acc = np.sum(counts, axis=0) / rows
            for k in range(K):
                assert extras[f"member{k}/train/loss"] == pytest.approx(want_loss[k], rel=1e-12), (steps, k)
                assert extras[f"member{k}/train/acc"] == want_acc[k], (steps, k)
        sums = tr.head.sums
        assert sums is not None and not sums.active and sums.stream.ptr != tr.stream.ptr
    here = {name: {ptr for thread, ptr in calls if thread == threading.get_ident()} for name, calls in launched.items()}
    assert here == {"member_means": {sums.stream.ptr}, "tally_members": {sums.stream.ptr}}, launched  # (not the
    # compile-ahead jobs' calls, on their threads)
    assert len({round(float(v), 6) for v in want_loss}) == K  # (the members differ: a mixed-up member would show)
