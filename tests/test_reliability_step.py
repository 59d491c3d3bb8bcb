"""Faults inside the training step: non-finite values (an inf gradient or parameter, a diverging learning rate, fp16
overflow) and out of memory. Each test checks the message a user gets and that nothing written earlier was lost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import FP16, emulate_fp16, make_cfg

from mlptrain.base.errors import NonFiniteError, ResourceError
from mlptrain.config.schema import Bgrad, Device, Schedule
from mlptrain.nn.network import MLP
from mlptrain.run import checkpoint
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train
from mlptrain.step.optim import Optimizer
from mlptrain.step.trainer import Trainer

# ------------------------------------------------------------------------ non-finite values


def _inject(monkeypatch: pytest.MonkeyPatch, where: str, step: int, what: str) -> None:
    """Put inf into ``what`` (``layer<i>.<weight|bias>``) at optimizer step ``step``.

    ``where="grad"``: into the gradient after the backward; ``"param"``: into the value after the update.
    """
    layer, kind = what.split(".")
    count = {"n": 0}
    if where == "grad":
        original = MLP.backward

        def backward(self: MLP, dlogits: Any, head: Any = None) -> None:
            original(self, dlogits, head)
            if count["n"] == step:
                getattr(self.layers[int(layer[5:])], kind).grad[0] = np.inf
            count["n"] += 1

        monkeypatch.setattr(MLP, "backward", backward)
    else:
        original_step = Optimizer.step

        def opt_step(self: Optimizer, *args: Any, **kwargs: Any) -> None:
            original_step(self, *args, **kwargs)
            if count["n"] == step:
                next(p for p in self.params if p.name == what).value[0] = np.inf
            count["n"] += 1

        monkeypatch.setattr(Optimizer, "step", opt_step)


def test_inf_gradient_stops_naming_step_and_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _inject(monkeypatch, "grad", 25, "layer1.weight")
    with pytest.raises(NonFiniteError) as err:
        train(make_cfg(checkpoint_steps=10), tmp_path)
    msg = str(err.value)
    assert msg.startswith(
        "non-finite values at step 25 (epoch 2, fp32): inf/NaN in layer1.weight gradient, layer1.weight;"
    )
    assert "the training loss" not in msg, "the loss of step 25 was still finite"
    assert "lower optimizer.lr (now 0.0" in msg
    assert f"the last checkpoint, {tmp_path / 'checkpoints' / 'last.npz'} (step 21), is intact" in msg
    assert checkpoint.load(tmp_path / "checkpoints" / "last.npz").position.step == 21
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "step"]
    assert steps == list(range(26)), "the records up to the bad step are written"


def test_inf_parameter_stops_naming_the_parameter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _inject(monkeypatch, "param", 3, "layer0.bias")
    with pytest.raises(NonFiniteError, match=r"at step 3 \(epoch 1, fp32\): inf/NaN in layer0.bias; lower"):
        train(make_cfg(), tmp_path)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_diverging_learning_rate_stops_with_the_loss_and_step(tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError) as err:
        train(make_cfg(optimizer__lr=1e6, optimizer__momentum=0.0, optimizer__schedule=Schedule.constant), tmp_path)
    msg = str(err.value)
    assert "non-finite values at step " in msg and "(epoch 1, fp32)" in msg
    assert "lower optimizer.lr (now 1e+06) or use warm-up (optimizer.warmup_steps)" in msg
    bad = int(msg.split("at step ")[1].split(" ")[0])
    losses = [r["train/loss"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "step"]
    assert len(losses) == bad + 1 and all(v is not None for v in losses[:bad])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_fp16_overflow_skips_then_a_persistent_one_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    emulate_fp16(monkeypatch)
    # An overflowing step is skipped (parameters unchanged) and the scale backs off ...
    train(make_cfg(**FP16, epochs=1, precision__init_scale=2.0**30, log_every=1), tmp_path / "transient")
    steps = [r for r in read_metrics(tmp_path / "transient" / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["loss_scale"] for r in steps[:4]] == [2.0**29, 2.0**28, 2.0**27, 2.0**26]
    assert steps[0]["skipped"] and not steps[-1]["skipped"]
    # ... but overflow on every step stops the run after max_consecutive_skips.
    original = MLP.backward

    def always_inf(self: MLP, dlogits: Any, head: Any = None) -> None:
        original(self, dlogits, head)
        self.layers[0].weight.grad[0] = np.inf

    monkeypatch.setattr(MLP, "backward", always_inf)
    with pytest.raises(NonFiniteError) as err:
        train(make_cfg(**FP16, precision__max_consecutive_skips=7, log_every=1), tmp_path / "persistent")
    msg = str(err.value)
    assert "fp16 gradients overflowed on 7 consecutive steps up to step 6 (loss scale now 512;" in msg
    assert "last step's inf/NaN: layer0.weight gradient" in msg and "lower optimizer.lr or use precision=bf16" in msg


@pytest.mark.gpu
def test_gpu_inf_gradient_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _inject(monkeypatch, "grad", 12, "layer1.weight")
    with pytest.raises(NonFiniteError) as err:
        # graph=False: the injection patches Python code, which a replayed CUDA graph never calls;
        # a fixed bgrad: "auto" may time the step at start-up, calling backward before step 0
        train(make_cfg(device=Device.gpu, graph=False, execution__bgrad=Bgrad.drelu_bgrad), tmp_path)
    msg = str(err.value)
    # On the GPU the check runs at the log interval's sync: the loss of step 13 is the first non-finite one.
    assert "at step 13 (epoch 1, fp32): the training loss is " in msg, msg
    assert "layer1.weight" in msg


# ---------------------------------------------------------------------------- out of memory


def test_out_of_memory_while_training_names_the_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = Trainer.step

    def step(self: Trainer, x: Any, y: Any) -> Any:
        if self.step_count == 12:
            raise MemoryError("Out of memory allocating 1,048,576 bytes (allocated so far: 2,097,152 bytes)")
        return original(self, x, y)

    monkeypatch.setattr(Trainer, "step", step)
    with pytest.raises(ResourceError) as err:
        train(make_cfg(checkpoint_steps=5), tmp_path)
    msg = str(err.value)
    assert msg.startswith("out of memory on the cpu at step 12 (MemoryError: Out of memory allocating 1,048,576 bytes")
    for part in ("data.batch_size=64", "data.eval_batch_size=1024", "model 64-32-10 (2,410 parameters)"):
        assert part in msg
    assert "precision=fp32, execution=fused; lower data.batch_size or model.hidden" in msg
    assert "the last checkpoint" in msg and checkpoint.load(tmp_path / "checkpoints" / "last.npz").position.step == 10


def test_out_of_memory_while_building_names_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(*args: Any, **kwargs: Any) -> None:
        raise MemoryError()

    monkeypatch.setattr(MLP, "__init__", no_memory)
    with pytest.raises(ResourceError) as err:
        train(make_cfg(model__hidden=[4096, 4096], data__batch_size=512), tmp_path)
    msg = str(err.value)
    assert "while loading the dataset, building the model and copying the data (MemoryError: no details)" in msg
    assert "data.batch_size=512" in msg and "model.hidden=[4096, 4096]" in msg and "lower data.batch_size" in msg
    assert "use a smaller dataset" in msg


@pytest.mark.gpu
def test_gpu_out_of_memory_is_a_resource_error(tmp_path: Path) -> None:
    import cupy

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    pool.set_limit(size=pool.used_bytes() + 256 * 1024)  # the data fits, a wide model does not
    try:
        with pytest.raises(ResourceError) as err:
            train(make_cfg(device=Device.gpu, model__hidden=[4096, 4096]), tmp_path)
    finally:
        pool.set_limit(size=0)
    msg = str(err.value)
    assert "out of memory on the gpu" in msg and "OutOfMemoryError" in msg and "data.batch_size=64" in msg
