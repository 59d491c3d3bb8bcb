"""The device runtime apart from the step (mlptrain.step.runtime), and components that own their kernels.

The CPU runtime does nothing but run the step; the GPU's has the same interface. Precompilation
only schedules: each component declares its jobs beside its CUDA source, the trainer collects the
step's, and the scheduler runs each exactly once, writing nothing of anyone. The GPU half (streams,
graphs, pools, compiles): tests/gpu/test_precompile_gpu.py, test_graph.py, test_memory.py.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import inspect
from pathlib import Path

import numpy as np
import pytest
from helpers import make_cfg

from mlptrain.base.backend import Backend
from mlptrain.base.cuda_source import Job
from mlptrain.step import runtime as rt
from mlptrain.step.cuda import precompile as pc
from mlptrain.step.precision import LossScaler
from mlptrain.step.trainer import Trainer

PKG = Path(__file__).resolve().parent.parent / "mlptrain"


# --- the runtime's interface ---------------------------------------------------------------------


def test_the_cpu_runtime_does_nothing_but_run_the_step():
    r = rt.device_runtime(Backend("cpu", np), None, precompile=object(), resume=False, graph=True, autotune=False)
    assert type(r) is rt.Runtime  # a precompiler handed to a CPU run is not used
    assert r.graphed is None and r.memory_peak is None and r.precompile is None
    assert isinstance(r.stream, contextlib.nullcontext)
    with r.stream:  # a context that does nothing
        pass
    assert r.input_buffers((4, 3), np.float32, (4,), np.int64) is None  # fresh arrays: no graph to feed
    with pytest.raises(RuntimeError, match="before Runtime.prepare"):
        r.step(1, 2)
    calls: list = []
    r.prepare(
        lambda x, y: calls.append(("step", x, y)) or "out",
        keep=list,
        restore=print,
        release=lambda: calls.append("release"),
    )
    assert r.step(1, 2) == "out" and r.step(3, 4, tag="gather") == "out"
    assert calls == ["release", ("step", 1, 2), "release", ("step", 3, 4)]  # the last step's arrays go first
    model = object()
    r.wgrad_stream(model, True)  # one stream on the CPU
    r.free_setup_blocks()
    r.submit_precompile(lambda: pytest.fail("no precompiler: the jobs are not even planned"))
    r.wait("loss")
    r.finish_precompile()


def test_the_gpu_runtime_has_the_cpu_runtimes_interface():
    public = {n for n, _ in inspect.getmembers(rt.Runtime, inspect.isfunction) if not n.startswith("_")}
    assert public == {
        "prepare",
        "step",
        "input_buffers",
        "wgrad_stream",
        "free_setup_blocks",
        "submit_precompile",
        "wait",
        "finish_precompile",
    }
    assert issubclass(rt.GpuRuntime, rt.Runtime)
    for name in public:  # what the GPU overrides, it overrides with the same signature
        cpu, gpu = getattr(rt.Runtime, name), getattr(rt.GpuRuntime, name)
        assert inspect.signature(cpu) == inspect.signature(gpu), name


def test_the_runtimes_precompile_lifecycle_waits_then_joins_once():
    events: list = []

    class Pre:
        def submit(self, jobs, *, last=False):
            events.append(("submit", [j.name for j in jobs], last))

        def wait(self, stage=None):
            events.append(("wait", stage))

        def close(self):
            events.append("close")

    r = rt.Runtime(Pre(), autotune=True)
    r.prepare(lambda x, y: events.append("step"), keep=list, restore=print, release=lambda: None)
    r.submit_precompile(lambda: [Job("a", "loss", lambda: None)])
    r.wait("loss")
    r.step(0, 0)  # autotune: joined before the first step, then nothing more to join
    r.step(0, 0)
    assert events == [("submit", ["a"], True), ("wait", "loss"), "close", "step", "step"]
    assert r.precompile is None


def test_a_trainer_step_through_the_cpu_runtime_is_the_launch_itself():
    cfg = make_cfg(data__batch_size=64, optimizer__lr=0.1)
    a, b = Trainer(cfg), Trainer(cfg)
    assert type(a.runtime) is rt.Runtime and a.stream is a.runtime.stream and a.graphed is None
    got, want = [], []
    for (x, y), (x2, y2) in zip(list(a.train_loader.epoch(0))[:12], list(b.train_loader.epoch(0))[:12], strict=True):
        got.append(float(a.step(x, y)[0]))
        b.release_step()  # what the runtime does around the step, by hand
        want.append(float(b._launch(x2, y2)[0]))
        b.clock.tick()
    assert got == want and a.step_count == b.step_count == 12
    for name, value in a.model.state_dict().items():
        np.testing.assert_array_equal(value, b.model.state_dict()[name], err_msg=name)


# --- the step's batches (StepBatches): the graph's buffers, gathering in the step, capturing ahead --


class Graphs:
    """A stand-in for :class:`GraphedStep` on the CPU: input buffers per shape and tag, the first shape taken as
    captured from the start (as after its warm-up steps), any other once :meth:`precapture` ran its warm-up."""

    def __init__(self, first: int) -> None:
        self.first, self.bufs, self.done, self.warmed = first, {}, set(), []

    def input_buffers(self, x_shape, x_dtype, y_shape, y_dtype, tag=None):
        key = (x_shape[0], tag)
        if key not in self.bufs:
            self.bufs[key] = (np.empty(x_shape, x_dtype), np.empty(y_shape, y_dtype))
        return self.bufs[key]

    def captured(self, x, y, tag=None) -> bool:
        return len(x) == self.first or (len(x), tag) in self.done

    def precapture(self, x, y, warm, tag=None) -> None:
        loss, _ = warm()
        self.warmed.append((len(x), tag, float(loss)))
        self.done.add((len(x), tag))


def graphed(tr: Trainer) -> Graphs:
    """``tr`` fed as where its step is a replayed graph of one process (its step still launched op by op)."""
    tr.runtime.graphed = Graphs(tr.train_loader.batch_size)
    tr.batches = rt.StepBatches(tr.runtime, tr.train_loader, tr.clock, data_parallel=False)
    return tr.runtime.graphed


def test_without_a_graph_the_batches_are_the_loaders_and_nothing_is_captured_ahead():
    tr = Trainer(make_cfg(data__batch_size=100))
    assert not tr.batches.gathers_in_step and tr.batch_buffers(100) is None
    got, want = list(tr.train_batches(0, 3)), list(tr.train_loader.epoch(0, 3))
    assert len(got) == len(want) == tr.steps_per_epoch - 3
    for (x, y), (x2, y2) in zip(got, want, strict=True):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
        assert not tr.batches.gathers(x) and not tr.batches.ahead_due(x, y, None)
    xb, yb = tr.train_loader.empty_batch(57)
    assert (xb.shape, xb.dtype, yb.shape, yb.dtype) == tr.train_loader.batch_spec(57)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"precision__name": "fp8", "model__hidden": [64, 64]}, {"data__residency": "host"}],
    ids=["gathered-in-step", "gathered-in-step-fp8", "host-resident"],
)
def test_the_short_batch_captured_ahead_changes_no_step(overrides):
    """What the GPU's replayed step does around its batches, run on the CPU with a stand-in graph: the step
    gathers its own batch (a host-resident split: the loader fills the graph's buffers), the short last batch is
    captured after the first step, ahead of its first batch, by a forward and backward alone; the losses and
    parameters are those of the loader gathering each batch first. (fp8: on the CPU that forward leaves the amax
    histories as they were; their restore on the GPU is tests/gpu/test_graph.py's.)"""
    cfg = make_cfg(data__batch_size=96, epochs=2, optimizer__lr=0.1, **overrides)  # a short last batch of 46
    plain, tr = Trainer(cfg), Trainer(cfg)
    graphs = graphed(tr)
    host = "data__residency" in overrides
    assert tr.batches.gathers_in_step is not host
    full, short = tr.train_loader.row_counts()
    assert full == 96 > short
    want = [float(plain.step(x, y)[0]) for epoch in range(2) for x, y in plain.train_batches(epoch)]
    got = []
    for epoch in range(2):
        for x, y in tr.train_batches(epoch):
            assert tr.batches.gathers(x) is not host
            got.append(float(tr.step(x, y)[0]))
            if len(got) == 1:  # the first shape's graph exists: the short one is captured ahead
                assert [(r, tag) for r, tag, _ in graphs.warmed] == [(short, None if host else "gather")]
    assert len(got) == 2 * tr.steps_per_epoch and got == want and len(graphs.warmed) == 1
    tags = {tag for _, tag in graphs.bufs}
    assert tags == ({None} if host else {"gather"})
    for name, value in plain.model.state_dict().items():
        np.testing.assert_array_equal(tr.model.state_dict()[name], value, err_msg=name)


# --- components own their kernels; precompile only schedules -----------------------------------


class Component:
    """A fake component that writes CUDA source: it declares two jobs and counts how often each runs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ran: dict[str, int] = {}
        self.declared = 0

    def precompile_jobs(self, *args, **kwargs) -> list[Job]:
        self.declared += 1
        return [
            Job(f"{self.name} {i}", stage, lambda i=i: self._compile(i)) for i, stage in enumerate(["loss", "update"])
        ]

    def _compile(self, i: int) -> None:
        key = f"{self.name} {i}"
        self.ran[key] = self.ran.get(key, 0) + 1


def test_precompile_runs_every_declared_job_of_the_step_exactly_once(monkeypatch):
    tr = Trainer(make_cfg())
    fakes = {"head": Component("head"), "optimizer": Component("optimizer"), "scaler": Component("scaler")}
    for attr, fake in fakes.items():
        monkeypatch.setattr(getattr(tr, attr), "precompile_jobs", fake.precompile_jobs)
    pre = pc.Precompiler(workers=3, context=contextlib.nullcontext)
    tr.runtime.precompile = pre
    tr.runtime.submit_precompile(tr.precompile_jobs)  # as the trainer does once it is built
    tr.step(*next(iter(tr.train_loader)))  # the first step joins the threads
    assert pre.closed and tr.runtime.precompile is None and pre.failed == [] and pre.left == []
    for fake in fakes.values():
        assert fake.declared == 1 and fake.ran == {f"{fake.name} 0": 1, f"{fake.name} 1": 1}
    scores = "evaluation's scores of float32 logits (10 outputs)"  # the trainer's own (nn.scores.sums_job)
    assert sorted(pre.done) == sorted([scores, *(f"{n} {i}" for n in fakes for i in (0, 1))])


def test_the_step_collects_each_components_jobs():
    tr = Trainer(make_cfg())  # digits, fp32 SGD: the loss, and the update with the step log's tail
    assert [(j.stage, j.name, j.scratch > 0) for j in tr.precompile_jobs()] == [
        ("loss", "cross_entropy of float32 logits, 10 outputs, batches of 359, 144, 64, 14 rows", True),
        ("update", "mlptrain_sgd_step (and the step log's tail)", True),
        ("later", "evaluation's scores of float32 logits (10 outputs)", True),
    ]


def test_a_components_job_writes_only_to_its_own_copies():
    """The head's losses, the optimizer's update and the scaler's check are plain calls that the CPU can run:
    run here, on NumPy, they leave the trainer exactly as it was (the jobs hold zeros and copies)."""
    tr = Trainer(make_cfg(optimizer__momentum=0.9))
    tr.step(*next(iter(tr.train_loader)))
    before = copy.deepcopy((tr.model.state_dict(), tr.optimizer.state_dict(), tr.scaler.state_dict()))
    cdt, train = tr.precision.compute_dtype, tr.train_loader
    batches = [(r, train.y, True) for r in train.row_counts()]
    jobs = tr.head.precompile_jobs(tr.model, cdt, batches, tr.scaler.scale)
    jobs += tr.optimizer.precompile_jobs(cdt, (tr.schedule.lr, tr.scaler.inv_scale, tr.scaler.found_inf))
    scaler = LossScaler(np, enabled=True)
    jobs += scaler.precompile_jobs(cdt, [p.value.shape for p in tr.model.params])
    assert [j.name for j in jobs] == [
        "cross_entropy of float32 logits, 10 outputs, batches of 64, 14 rows",
        "mlptrain_sgd_step",
        "mlptrain_check_nonfinite (float32 gradients)",
    ]
    for job in jobs:
        job.run()
    after = (tr.model.state_dict(), tr.optimizer.state_dict(), tr.scaler.state_dict())
    for was, now in zip(before[:2], after[:2], strict=True):
        for k in was:
            np.testing.assert_array_equal(was[k], now[k], err_msg=k)
    assert before[2] == after[2] and int(scaler.found_inf) == 0
    tail = tr.log.scratch_tail(np.float32, 64)  # the step log's tail on zeros: none of the log's arrays
    ring = [tr.log.loss, tr.log.correct, tr.log.skip, tr.log.scale, tr.log.epoch_loss, tr.log.epoch_correct]
    assert not any(a is b for a in tail.args for b in ring) and all(not np.any(a) for a in tail.args)


# --- architecture: the trainer is the step; nobody touches another module's privates ------------


def test_the_trainer_has_no_device_branch():
    src = (PKG / "step" / "trainer.py").read_text()
    assert "is_gpu" not in src and "cupy" not in src and "precompile import" not in src


def test_precompile_assigns_no_attribute_of_another_object():
    tree = ast.parse((PKG / "step" / "cuda" / "precompile.py").read_text())
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            for leaf in ast.walk(t) if t is not None else ():
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.ctx, ast.Store):
                    assert isinstance(leaf.value, ast.Name) and leaf.value.id == "self", ast.unparse(leaf)


def test_no_module_touches_a_private_attribute_of_another_modules_class():
    """``x._y`` only where ``_y`` belongs to a class of the same module (``self._y = ...`` there), or on
    ``self``, ``cls`` or ``super()``; ``os._exit`` is the standard library's."""
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text())
        own = {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
        }
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
                continue
            v = n.value
            if (isinstance(v, ast.Name) and v.id in ("self", "cls", "os")) or n.attr in own:
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            offenders.append(f"{path.relative_to(PKG.parent)}:{n.lineno} {ast.unparse(n)}")
    assert offenders == []
