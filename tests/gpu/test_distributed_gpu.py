"""Data parallel on two GPUs through NCCL (``distributed.gpus=2``): the same steps as one GPU with the
global batch, identical parameters on both ranks after every step, resume on another number of GPUs.

Needs two GPUs (skipped otherwise). On hosts with NVLink multicast, keep NCCL_NVLS_ENABLE=0 set.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from gpu_helpers import HAS_GPU

from mlptrain.config.schema import TrainConfig
from mlptrain.run.metrics import read_metrics

pytestmark = pytest.mark.gpu

if HAS_GPU:
    from mlptrain.distributed.cuda.nccl import device_count

    TWO = device_count() >= 2
else:
    TWO = False
two_gpus = pytest.mark.skipif(not TWO, reason="needs two GPUs")


def _cfg(precision: str, **kw) -> TrainConfig:
    cfg = TrainConfig()
    cfg.device = type(cfg.device)("gpu")
    cfg.progress = False
    cfg.precision.name = type(cfg.precision.name)(precision)
    cfg.data.batch_size = 64  # global: 32 + 32 rows; digits' short last batch of each epoch too
    cfg.execution.bgrad = type(cfg.execution.bgrad)("bgradb")  # measured choices could differ between runs
    cfg.optimizer.name = type(cfg.optimizer.name)("adam")
    cfg.optimizer.lr = 1e-3
    cfg.optimizer.schedule = type(cfg.optimizer.schedule)("constant")  # the same rates when max_steps changes
    cfg.epochs = 6
    cfg.max_steps = 100
    cfg.log_every = 1
    return dataclasses.replace(cfg, **kw)  # top-level keys: max_steps, resume


def _steps(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "step"]


def _two(cfg: TrainConfig, out: Path) -> dict:
    from mlptrain.cli.launcher import launch

    cfg = copy.deepcopy(cfg)
    cfg.distributed.gpus = 2
    cfg.distributed.verify = True  # every log interval (every step here): the same bytes on both ranks
    return launch(cfg, out)


@two_gpus
def test_two_gpus_take_the_steps_of_one_gpu_with_the_global_batch_in_fp32(tmp_path):
    """100 steps across epoch boundaries (short last batches: unequal shards): per-step losses within
    1e-5 relative of one GPU's, and the parameters on both ranks bit-identical after every step."""
    from mlptrain.run.run import train

    one = train(_cfg("fp32"), tmp_path / "one")
    two = _two(_cfg("fp32"), tmp_path / "two")
    a, b = _steps(tmp_path / "one"), _steps(tmp_path / "two")
    assert len(a) == len(b) == 100
    la, lb = np.array([r["train/loss"] for r in a]), np.array([r["train/loss"] for r in b])
    assert np.abs(lb - la).max() / np.abs(la).max() < 1e-5
    assert [r["train/acc"] for r in a] == pytest.approx([r["train/acc"] for r in b], abs=1.5 / 64)
    assert abs(two["test/acc"] - one["test/acc"]) < 0.01
    assert not any(Path("/tmp").glob("mlptrain-rank1-*"))  # rank 1 wrote into nothing that stays


@two_gpus
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_on_two_gpus_skips_the_same_steps_and_learns_as_one(tmp_path, precision):
    from mlptrain.run.run import train

    one = train(_cfg(precision), tmp_path / "one")
    two = _two(_cfg(precision), tmp_path / "two")
    a, b = _steps(tmp_path / "one"), _steps(tmp_path / "two")
    if precision == "fp16":  # the loss scale's overflow steps at the start
        assert [r["step"] for r in a if r["skipped"]] == [r["step"] for r in b if r["skipped"]]
        assert [r["loss_scale"] for r in a] == [r["loss_scale"] for r in b]
    assert abs(two["test/acc"] - one["test/acc"]) < 0.03
    assert two["test/acc"] > 0.8


@two_gpus
def test_a_two_gpu_run_resumes_on_one_gpu_and_a_one_gpu_run_on_two(tmp_path):
    """The checkpoint does not depend on the number of GPUs: stop at step 50 (max_steps), continue
    with the other count, and end where an uninterrupted one-GPU run ends (fp32, to 1e-5)."""
    from mlptrain.run.run import train

    full = train(_cfg("fp32"), tmp_path / "full")
    _two(_cfg("fp32", max_steps=50), tmp_path / "a")
    a = train(_cfg("fp32", resume=str(tmp_path / "a" / "checkpoints" / "last.npz")), tmp_path / "a2")
    train(_cfg("fp32", max_steps=50), tmp_path / "b")
    b = _two(_cfg("fp32", resume=str(tmp_path / "b" / "checkpoints" / "last.npz")), tmp_path / "b2")
    for got in (a, b):
        np.testing.assert_allclose(got["test/loss"], full["test/loss"], rtol=1e-5)
