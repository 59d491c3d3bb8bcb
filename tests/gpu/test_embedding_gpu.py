"""Learned embeddings on the GPU (#49): the nvmath engine's forward and gradients against the NumPy engine's in
float64, fused and naive, and a table trained on the GPU against the same run on the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gpu_helpers import close, cp, gpu_trainer
from helpers import make_cfg, records
from test_embedding import BIG, table_x, write_table

from mlptrain.config.schema import DatasetName, Device
from mlptrain.nn.embedding import ColumnEmbedding
from mlptrain.nn.execution import FusedExecution, NumpyGemm
from mlptrain.nn.network import MLP
from mlptrain.run import checkpoint
from mlptrain.run.run import train

pytestmark = pytest.mark.gpu


def net_on(xp, execution, dtype):  # type: ignore[no-untyped-def]
    kw = {"rng": np.random.default_rng(7), "xp": xp, "param_dtype": dtype, "compute_dtype": dtype}
    emb = ColumnEmbedding(BIG, 12, 3, **kw)
    return MLP([12, 40, 24, 5], execution=execution, embedding=emb, **kw)


@pytest.mark.parametrize("mode", ["fused", "naive"])
def test_forward_and_gradients_match_the_numpy_engine(mode: str) -> None:
    rng = np.random.default_rng(0)
    x, _ = table_x(rng, 67)
    r = rng.standard_normal((67, 5))
    tr = gpu_trainer(**{"execution.mode": mode})
    gpu = net_on(cp, tr.execution, cp.float32)
    ref = net_on(np, FusedExecution(NumpyGemm()), np.float64)
    close(gpu.forward(cp.asarray(x, cp.float32)), ref.forward(x), "float32", "logits")
    gpu.backward(cp.asarray(r, cp.float32))
    ref.backward(r)
    for pg, pr in zip(gpu.params, ref.params, strict=True):
        close(pg.grad, pr.grad, "float32", pr.name)
    assert gpu.params[-1].name == "embed0.weight"


def test_a_table_trains_on_the_gpu_as_on_the_cpu(tmp_path: Path) -> None:
    write_table(tmp_path / "t.csv")
    over = {"data__name": DatasetName.file, "data__path": str(tmp_path / "t.csv"), "data__cache": False}
    over |= {"data__features": None, "data__batch_size": 32, "model__embedding_dim": 4}
    over |= {"model__embedding_min_levels": 10}
    train(make_cfg(**over), tmp_path / "cpu")
    train(make_cfg(**over, device=Device.gpu), tmp_path / "gpu")
    a, b = records(tmp_path / "cpu"), records(tmp_path / "gpu")
    steps = [(ra["train/loss"], rb["train/loss"]) for ra, rb in zip(a, b, strict=True) if "train/loss" in ra]
    assert steps and all(abs(u - v) < 1e-3 * max(1.0, abs(u)) for u, v in steps), steps
    ca = checkpoint.load(tmp_path / "cpu" / "checkpoints" / "last.npz").arrays
    cb = checkpoint.load(tmp_path / "gpu" / "checkpoints" / "last.npz").arrays
    e_gpu, e_cpu = cb["param/embed0.weight"], ca["param/embed0.weight"]  # 21 steps apart only by rounding
    assert np.abs(e_gpu - e_cpu).max() < 1e-4 * np.abs(e_cpu).max()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_trains_the_embeddings(tmp_path: Path, precision: str) -> None:
    """A 0/1 block in the compute dtype (exact in fp16 and bf16) and E's fp32 master with its half copy."""
    write_table(tmp_path / "t.csv")
    over = {"data__name": DatasetName.file, "data__path": str(tmp_path / "t.csv"), "data__cache": False}
    over |= {"data__features": None, "data__batch_size": 32, "model__embedding_dim": 8, "epochs": 6}
    over |= {"model__embedding_min_levels": 10, "precision__name": precision, "device": Device.gpu}
    train(make_cfg(**over), tmp_path / "r")
    losses = [r["train/loss"] for r in records(tmp_path / "r") if r["kind"] == "epoch"]
    assert all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses
    e = checkpoint.load(tmp_path / "r" / "checkpoints" / "last.npz").arrays["param/embed0.weight"]
    assert e.dtype == np.float32 and np.isfinite(e).all()
