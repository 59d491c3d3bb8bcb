"""Kernels compiled ahead on threads (mlptrain.step.cuda.precompile), on the GPU.

A run from an empty kernel cache compiles every kernel on the precompile threads and none at its
first launch on the main thread; the threads are joined before the first CUDA graph is captured;
compiling ahead changes no number, and a job that fails leaves its kernel to its first launch.
"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gpu_helpers import gpu_trainer, graph_run

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]

# A whole run in a fresh process (CuPy reads CUPY_CACHE_DIR when it is imported), with every NVRTC
# compile recorded: the thread it ran on and the kernels of its source.
COLD_RUN = r"""
import json, re, sys, threading
from pathlib import Path

import cupy.cuda.compiler as compiler

if not hasattr(compiler, "_compile_using_nvrtc_no_warning"):
    print("NO-SPY")
    sys.exit(0)
compiles = []
nvrtc = compiler._compile_using_nvrtc_no_warning


def spy(source, *args, **kwargs):
    kernels = re.findall(r"__global__\s+void\s+(\w+)", source)
    kernels += re.findall(r"^MLPTRAIN_\w+\((\w+),", source, re.M)  # a module's kernels made by a macro
    compiles.append({"thread": threading.current_thread().name, "kernels": kernels})
    return nvrtc(source, *args, **kwargs)


compiler._compile_using_nvrtc_no_warning = spy
from mlptrain.config.schema import TrainConfig
from mlptrain.run.run import train

cfg = TrainConfig()
cfg.device = type(cfg.device)("gpu")
cfg.progress = False
cfg.epochs = 2
cfg.precision.name = type(cfg.precision.name)(sys.argv[1])
train(cfg, Path(sys.argv[2]))
print("COMPILES " + json.dumps(compiles))
"""


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_cold_run_compiles_every_kernel_ahead_and_none_at_first_use(tmp_path, precision):
    env = {**os.environ, "CUPY_CACHE_DIR": str(tmp_path / "cupy"), "MLPTRAIN_DATA": str(tmp_path / "mlptrain")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = [sys.executable, "-c", COLD_RUN, precision, str(tmp_path / "run")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "NO-SPY" in proc.stdout:
        pytest.skip("this CuPy compiles through another function than _compile_using_nvrtc_no_warning")
    compiles = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("COMPILES "))[9:])
    assert compiles, "a run from an empty CUPY_CACHE_DIR compiled nothing: the spy sees no compile"
    late = [c for c in compiles if not c["thread"].startswith("mlptrain-precompile")]
    assert not late, f"compiled at their first launch, on the main thread: {late}"
    assert "ahead failed" not in proc.stderr, proc.stderr[-3000:]
    kernels = {k for c in compiles for k in c["kernels"]}
    want = {"mlptrain_xent_small", "mlptrain_head_dgrad", "mlptrain_sgd_step"}
    want |= {"mlptrain_check_nonfinite"} if precision == "fp16" else set()
    assert want <= kernels, f"not compiled: {sorted(want - kernels)} (compiled: {sorted(kernels)})"
    # the batch gather: one header-free module for every dtype (mlptrain.data.cuda.gather), not cupy.take's kernels
    assert "mlptrain_gather_4" in kernels and not any(k.startswith("cupy_take") for k in kernels), sorted(kernels)
    plain = [c for c in compiles if "mlptrain_nonfinite_float32" in c["kernels"]]  # one NVRTC call for the set
    assert len(plain) == 1 and "mlptrain_gather_16" in plain[0]["kernels"], compiles
    # the step count, rate and loss scale are copied from the host (mlptrain.base.backend.scalar): no fill
    assert not any(k.startswith("cupy_fill") for k in kernels), sorted(kernels)
    # the parameters' cast to the compute dtype (evaluation's casts of its sums to float64 compile in every precision)
    casts = [k for k in kernels if k.startswith("cupy_copy__float32_") and not k.endswith("_float64")]
    assert bool(casts) == (precision != "fp32"), sorted(kernels)


def test_the_bgrad_probe_starts_only_once_every_job_is_done(monkeypatch):
    """The probe captures CUDA graphs, so the trainer waits for every job first; a run without the
    probe does not wait (its step's jobs are queued at once). A job that sleeps stands in for a slow
    compile: had the trainer not waited, it would still be running when the probe starts."""
    import time

    from mlptrain.step import bgrad as bgrad_module
    from mlptrain.step.cuda import bgrad as probe
    from mlptrain.step.cuda import precompile

    made = []
    init = precompile.Precompiler.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(precompile.Precompiler, "__init__", record)
    dtype_jobs = precompile.dtype_jobs
    slow = precompile.Job("a slow compile", "later", lambda: time.sleep(1.0))
    monkeypatch.setattr(precompile, "dtype_jobs", lambda *a, **k: [*dtype_jobs(*a, **k), slow])
    seen = []
    real = probe.choose_bgrad

    def spy(*args, **kwargs):
        seen.append([(job.name, future.done()) for pre in made for job, future in pre._jobs])
        return real(*args, **kwargs)

    monkeypatch.setattr(probe, "choose_bgrad", spy)
    monkeypatch.setattr(bgrad_module, "PROBE_MIN_FLOPS", 1.0)  # probe this small model
    gpu_trainer(**{"execution.bgrad": "auto", "execution.plan_cache": False})
    assert len(seen) == 1 and ("a slow compile", True) in seen[0] and all(done for _, done in seen[0]), seen
    # the step's own jobs were queued before the probe too (it would compile the loss on this thread otherwise)
    assert any(" logits, " in name for name, _ in seen[0]), seen


def test_every_thread_is_joined_before_the_first_capture(monkeypatch):
    import mlptrain.step.cuda.graph as graph

    alive = []

    def capture(fn, stream):
        pre = trainer.runtime.precompile
        alive.append(pre is not None or any(t.is_alive() for t in threads))
        return original(fn, stream)

    original = graph.capture_graph
    monkeypatch.setattr(graph, "capture_graph", capture)

    trainer = gpu_trainer(**{"execution.bgrad": "bgradb"})
    pre = trainer.runtime.precompile
    assert pre is not None, "a GPU trainer compiles its kernels ahead"
    threads = list(pre._pool._threads)
    with trainer.stream:
        for x, y in trainer.train_loader.epoch(0, out=trainer.batch_buffers):
            trainer.step(x, y)
        trainer.stream.synchronize()
    assert alive and not any(alive), "a graph was captured while precompile threads were alive"
    assert pre.closed and pre.failed == [] and len(pre.done) == len(pre._jobs) >= 3, (pre.done, pre.failed)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_compiling_ahead_changes_no_number(precision):
    tr, ahead = graph_run(True, 40, **{"precision.name": precision})
    lazy_tr, lazy = graph_run(True, 40, **{"precision.name": precision, "execution.precompile": False})
    assert lazy_tr.runtime.precompile is None
    np.testing.assert_array_equal(ahead, lazy)
    for name, value in tr.model.state_dict().items():
        np.testing.assert_array_equal(value, lazy_tr.model.state_dict()[name], err_msg=name)
    assert float(tr.scaler.scale) == float(lazy_tr.scaler.scale) and tr.step_count == lazy_tr.step_count


def test_a_failing_job_leaves_its_kernel_to_its_first_launch(monkeypatch, caplog):
    from mlptrain.base.cuda_source import Job
    from mlptrain.step.optim import Optimizer

    def broken() -> None:
        raise RuntimeError("broken on purpose")

    # the optimizer's kernel, declared by the optimizer: its job fails, so it compiles at the first update
    monkeypatch.setattr(Optimizer, "precompile_jobs", lambda self, *a, **k: [Job("the update", "update", broken)])
    with caplog.at_level(logging.WARNING, logger="mlptrain.step.cuda.precompile"):
        tr, losses = graph_run(True, 30)
    assert "ahead failed (RuntimeError: broken on purpose)" in caplog.text
    np.testing.assert_array_equal(losses, graph_run(True, 30, **{"execution.precompile": False})[1])


def test_train_hands_the_trainer_what_it_started_before_the_backend(monkeypatch, tmp_path):
    from mlptrain.config.schema import TrainConfig
    from mlptrain.run.run import train
    from mlptrain.step.cuda import precompile as pc

    started = []
    early = pc.early
    monkeypatch.setattr(pc, "early", lambda cfg: started.append(early(cfg)) or started[-1])
    cfg = TrainConfig()
    cfg.device, cfg.progress, cfg.epochs = type(cfg.device)("gpu"), False, 1
    train(cfg, tmp_path / "run")
    assert len(started) == 1 and started[0] is not None
    pre = started[0]
    assert pre.closed and pre.failed == [], pre.failed
    assert any(name.startswith("mlptrain_sgd_step") for name in pre.done), pre.done  # the trainer added its jobs
