"""Kernels compiled ahead on threads (mlptrain.step.cuda.precompile), the parts that need no GPU.

Which kernels are planned for which precision and which trainer; that jobs run at once on several
threads, that one that fails only warns, that waiting for a stage waits for that stage alone; and
that the trainer waits for each stage before its first launch and joins the threads after its
first step, before any CUDA graph could be captured. The compiles themselves:
tests/gpu/test_precompile_gpu.py.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import ml_dtypes
import numpy as np
import pytest
from helpers import FP16, emulate_fp16, make_cfg

from mlptrain.base.errors import ConfigError
from mlptrain.cli.main import compose_config
from mlptrain.config.schema import Device
from mlptrain.data.loader import DataLoader
from mlptrain.nn import scores
from mlptrain.nn.head import OutputHead
from mlptrain.step.cuda import precompile as pc
from mlptrain.step.precision import Precision
from mlptrain.step.runtime import GpuRuntime
from mlptrain.step.trainer import Trainer

FP32 = Precision("fp32", np.float32, np.float32)
BF16 = Precision("bf16", np.float32, np.dtype(ml_dtypes.bfloat16))
HALF = Precision("fp16", np.float32, np.float16, loss_scaling=True)


def names(jobs: list[pc.Job], stage: str | None = None) -> list[str]:
    return [j.name for j in jobs if stage is None or j.stage == stage]


# --- the plan ----------------------------------------------------------------------------------


def test_the_dtype_jobs_follow_the_precision():
    # the step's bookkeeping (step count, rate, loss scale) is copied from the host: no kernel to compile
    plain = "mlptrain's header-free kernels: the batch gather, the inf/NaN flags (one module)"
    assert names(pc.dtype_jobs(FP32), "batch") == names(pc.dtype_jobs(BF16), "batch") == [plain]
    assert names(pc.dtype_jobs(FP32), "setup") == []  # no cast either: the GEMMs read the master weights
    assert names(pc.dtype_jobs(FP32), "later") == []
    assert names(pc.dtype_jobs(BF16), "setup") == ["cupy_copy float32 -> bfloat16 (Param: the compute copy)"]
    assert names(pc.dtype_jobs(HALF), "setup") == ["cupy_copy float32 -> float16 (Param: the compute copy)"]
    resumed = names(pc.dtype_jobs(HALF, resume=True), "setup")  # a checkpoint's counters, its loss scale
    assert resumed[-2:] == [
        "cupy_fill int64 (StepClock.set)",
        "cupy_fill int32, divide float64 (LossScaler.load_state_dict)",
    ]
    assert "cupy_fill int64 (StepClock.set)" in names(pc.dtype_jobs(FP32, resume=True))
    assert not any("LossScaler" in n for n in names(pc.dtype_jobs(FP32, resume=True)))


@pytest.mark.parametrize(
    ("n", "b", "drop_last", "rows"),
    [(1294, 64, False, [64, 14]), (1294, 64, True, [64]), (1280, 64, False, [64]), (10, 64, False, [10])],
)
def test_row_counts_are_the_batch_size_and_a_short_last_batch(n, b, drop_last, rows):
    x, y = np.zeros((n, 2), np.float32), np.zeros(n, np.int64)
    ld = DataLoader(x, y, b, xp=np, dtype=np.float32, shuffle=False, drop_last=drop_last, seed=0)
    assert ld.row_counts() == rows


def test_the_step_jobs_of_a_digits_run():
    tr = Trainer(make_cfg())  # digits: 1294 train rows in batches of 64, val 144 and test 359 rows
    assert [(j.stage, j.name) for j in tr.precompile_jobs()] == [
        ("loss", "cross_entropy of float32 logits, 10 outputs, batches of 359, 144, 64, 14 rows"),
        ("update", "mlptrain_sgd_step (and the step log's tail)"),
        ("later", "evaluation's scores of float32 logits (10 outputs)"),
    ]


def test_the_scores_job_makes_the_calls_evaluation_makes(monkeypatch):
    """The job adds two zero batches of each evaluation shape to a SplitSums and reads it back: the very calls
    (hence the kernels) of :class:`mlptrain.step.trainer.SplitScores`."""
    seen = []
    real_add = scores.SplitSums.add
    monkeypatch.setattr(scores.SplitSums, "add", lambda self, z, y: seen.append((z.shape, z.dtype, y.shape, y.dtype)))
    job = next(j for j in Trainer(make_cfg()).precompile_jobs() if j.stage == "later")
    job.run()
    f32, i64 = np.dtype(np.float32), np.dtype(np.int64)
    assert seen == [((r, 10), f32, (r,), i64) for r in (144, 144, 359, 359)]  # validation, test: twice each
    monkeypatch.setattr(scores.SplitSums, "add", real_add)
    job.run()  # the real calls on zeros: a confusion matrix of class 0, read back on the host


def test_the_head_kernel_and_the_fp16_check_are_planned_where_the_run_has_them(monkeypatch):
    emulate_fp16(monkeypatch)
    tr = Trainer(make_cfg(**FP16, optimizer__name="adam"))
    tr.head = OutputHead("cross_entropy", "kernel")  # what OutputHead.choose takes on the GPU
    jobs = tr.precompile_jobs()
    assert names(jobs, "loss") == [
        "cross_entropy of float16 logits, 10 outputs, batches of 359, 144, 64, 14 rows",
        "mlptrain_head_dgrad (10 classes, float16)",
    ]
    assert names(jobs, "update") == [
        "mlptrain_adam_step (and the step log's tail)",
        "mlptrain_check_nonfinite (float16 gradients)",
    ]


def test_calls_too_large_to_mirror_are_left_to_their_first_use(monkeypatch):
    monkeypatch.setattr(pc, "SCRATCH_LIMIT", 4096)  # below the optimizer's scratch and the loss's logits
    jobs = Trainer(make_cfg()).precompile_jobs()  # the same run plans three jobs at the usual limit (above)
    pre = pool()
    pre.submit(jobs)
    pre.close()
    assert pre.done == pre.failed == [] and pre.left == names(jobs) and len(jobs) == 3


# --- the pool of threads -----------------------------------------------------------------------


def pool(workers: int = 4, context=contextlib.nullcontext) -> pc.Precompiler:
    return pc.Precompiler(workers=workers, context=context)


def test_jobs_run_on_several_threads_at_once():
    meet = threading.Barrier(3, timeout=10)  # passes only if three jobs wait at it together
    pre = pool(workers=3)
    pre.submit([pc.Job(f"job {i}", "loss", meet.wait) for i in range(3)])
    pre.close()
    assert sorted(pre.done) == ["job 0", "job 1", "job 2"] and pre.failed == []


def test_a_failing_job_only_warns(caplog):
    def broken() -> None:
        raise RuntimeError("no NVRTC here")

    pre = pool()
    with caplog.at_level(logging.WARNING, logger="mlptrain.step.cuda.precompile"):
        pre.submit([pc.Job("bad", "loss", broken), pc.Job("good", "loss", lambda: None)])
        pre.close()  # raises nothing
    assert pre.failed == ["bad"] and pre.done == ["good"]
    assert "compiling bad ahead failed (RuntimeError: no NVRTC here); it compiles at its first use" in caplog.text


def test_a_job_whose_device_cannot_be_set_up_only_warns(caplog):
    @contextlib.contextmanager
    def no_device():
        raise ImportError("no CuPy")
        yield

    pre = pool(context=no_device)
    pre.submit([pc.Job("xent", "loss", lambda: None)])
    pre.close()
    assert pre.failed == ["xent"] and pre.done == []


def test_waiting_for_a_stage_waits_for_it_alone_and_close_joins_every_thread():
    gate, ran = threading.Event(), []
    pre = pool(workers=2)
    slow = pc.Job("slow", "later", lambda: (gate.wait(10), ran.append("slow")))
    pre.submit([slow, pc.Job("fast", "setup", lambda: ran.append("fast"))])
    pre.wait("setup")
    assert ran == ["fast"]  # the later job is still held at its gate
    gate.set()
    pre.close()
    assert ran == ["fast", "slow"] and pre.closed
    assert not any(t.is_alive() for t in pre._pool._threads)
    pre.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        pre.submit([pc.Job("late", "later", lambda: None)])


def test_after_the_last_jobs_the_threads_end_without_a_close():
    pre = pool(workers=2)
    pre.submit([pc.Job("a", "setup", lambda: None)])
    pre.submit([pc.Job("b", "loss", lambda: None), pc.Job("c", "update", lambda: None)], last=True)
    pre.wait()
    for t in pre._pool._threads:  # a trainer that is never stepped leaves no idle thread behind
        t.join(timeout=10)
        assert not t.is_alive()
    assert sorted(pre.done) == ["a", "b", "c"] and not pre.closed


def test_earlier_stages_start_first_and_unknown_stages_are_refused():
    ran: list[str] = []
    pre = pool(workers=1)
    stages = ["later", "update", "setup", "loss", "batch"]
    pre.submit([pc.Job(s, s, lambda s=s: ran.append(s)) for s in stages])
    pre.close()
    assert ran == list(pc.STAGES)
    with pytest.raises(ValueError, match="stage 'soon'"):
        pool().submit([pc.Job("x", "soon", lambda: None)])


def test_it_can_be_turned_off():
    """``execution.precompile=false``: nothing starts before the backend, and the GPU runtime starts nothing."""
    cfg = make_cfg(device=Device.auto)
    cfg.execution.precompile = False
    assert pc.early(cfg) is None
    off = GpuRuntime(np, FP32, precompile=None, ahead=False, resume=False, graph=False, autotune=False)
    assert off.precompile is None
    with pytest.raises(ConfigError, match=r"execution\.precompile=false is not used with device=cpu: it applies to"):
        compose_config(["device=cpu", "execution.precompile=false"])  # a CPU run compiles nothing ahead


def test_nothing_is_started_for_a_cpu_run(monkeypatch):
    assert pc.early(make_cfg()) is None  # device=cpu
    monkeypatch.setattr(pc.importlib.util, "find_spec", lambda name: None)  # no nvmath: no GPU run
    assert pc.early(make_cfg(device=Device.auto)) is None
    assert Trainer(make_cfg()).runtime.precompile is None


# --- the trainer's waits -----------------------------------------------------------------------


class FakePrecompiler:
    """Records the trainer's waits and its close among the events of the step."""

    def __init__(self, events: list) -> None:
        self.events = events
        self.closed = False

    def wait(self, stage: str | None = None) -> None:
        self.events.append(("wait", stage))

    def close(self) -> None:
        self.closed = True
        self.events.append("close")


def traced(monkeypatch, **cfg: object) -> tuple[Trainer, list, FakePrecompiler]:
    """A CPU trainer with a fake precompiler; the loss and the update add themselves to the events."""
    tr, events = Trainer(make_cfg(**cfg)), []
    backward, update = tr.head.backward, tr.optimizer.step
    monkeypatch.setattr(tr.head, "backward", lambda *a: (events.append("loss"), backward(*a))[1])
    monkeypatch.setattr(tr.optimizer, "step", lambda *a, **k: (events.append("update"), update(*a, **k))[1])
    tr.runtime.precompile = fake = FakePrecompiler(events)
    return tr, events, fake


def test_the_first_step_waits_for_each_stage_before_it_then_joins_the_threads(monkeypatch):
    tr, events, fake = traced(monkeypatch)
    batches = tr.train_loader.epoch(0, out=tr.batch_buffers)
    x, y = next(batches)
    tr.step(x, y)
    assert events == [("wait", "batch"), ("wait", "loss"), "loss", ("wait", "update"), "update", "close"]
    assert fake.closed and tr.runtime.precompile is None  # a graph is captured after a warm-up step: joined by then
    events.clear()
    tr.step(*next(batches))
    assert events == ["loss", "update"]  # nothing to wait for any more


def test_autotune_joins_the_threads_before_the_first_step(monkeypatch):
    tr, events, _ = traced(monkeypatch)
    tr.runtime.autotune = True  # execution.autotune=true: it captures GEMMs in CUDA graphs while it plans them
    tr.step(*next(iter(tr.train_loader)))
    assert events[0] == "close" and events[1:] == ["loss", "update"]


def test_evaluation_joins_the_threads_first(monkeypatch):
    tr, events, fake = traced(monkeypatch)
    tr.evaluate("test")
    assert events == ["close"] and tr.runtime.precompile is None


def test_a_cpu_trainer_uses_no_precompiler_it_is_given():
    assert Trainer(make_cfg(), precompile=FakePrecompiler([])).runtime.precompile is None
