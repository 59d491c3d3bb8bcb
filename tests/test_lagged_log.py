"""The GPU's log interval on the CPU: each interval's records written while the next interval runs.

On a GPU the loop closes a log interval (its metrics, inf/NaN checks and time mark queued behind its
steps) and writes it at the next interval's end, so the device never waits for the host's records
(:class:`mlptrain.run.loop.Interval`). Here the same path runs on the CPU, turned on by hand: the records
must be those of the loop that writes each interval at once, and a fault must still stop the run,
naming the step that made it, with every record up to the interval it fell in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import FP16, emulate_fp16, make_cfg, records

from mlptrain.base.errors import NonFiniteError
from mlptrain.nn.network import MLP
from mlptrain.run import checkpoint
from mlptrain.run.loop import Loop
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train


@pytest.fixture
def lagged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loops that check once per interval and write each interval one interval late, as on a GPU."""
    original = Loop.__init__

    def init(self: Loop, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.each_step, self.lagged = False, True

    monkeypatch.setattr(Loop, "__init__", init)


def inject_inf_grad(monkeypatch: pytest.MonkeyPatch, step: int | None, layer: int = 1) -> None:
    """An inf in ``layer``'s weight gradient at the backward of ``step`` (None: of every step)."""
    original = MLP.backward
    count = {"n": 0}

    def backward(self: MLP, dlogits: Any, head: Any = None) -> None:
        original(self, dlogits, head)
        if step is None or count["n"] == step:
            self.layers[layer].weight.grad[0] = np.inf
        count["n"] += 1

    monkeypatch.setattr(MLP, "backward", backward)


def test_lagged_records_are_the_records_written_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = dict(epochs=3, log_every=4, checkpoint_steps=10)  # 21 steps an epoch: a short interval at each end
    train(make_cfg(**cfg), tmp_path / "at-once")
    with monkeypatch.context() as m:
        original = Loop.__init__
        seen: list[bool] = []

        def init(self: Loop, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            self.each_step, self.lagged = False, True
            seen.append(True)

        m.setattr(Loop, "__init__", init)
        train(make_cfg(**cfg), tmp_path / "lagged")
    assert seen == [True]
    expected, got = records(tmp_path / "at-once"), records(tmp_path / "lagged")
    assert [r["step"] for r in got if r["kind"] == "step"] == list(range(63))
    assert got == expected
    timed = {
        n: [r for r in read_metrics(tmp_path / n / "metrics.jsonl") if "step_time_ms" in r]
        for n in ("at-once", "lagged")
    }
    assert [r["step"] for r in timed["lagged"]] == [r["step"] for r in timed["at-once"]]  # the same intervals, timed
    assert all(r["step_time_ms"] > 0 and r["samples_per_s"] > 0 for r in timed["lagged"])
    a = checkpoint.load(tmp_path / "at-once" / "checkpoints" / "last.npz").arrays
    b = checkpoint.load(tmp_path / "lagged" / "checkpoints" / "last.npz").arrays
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_fault_is_named_one_interval_later(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lagged: None) -> None:
    # Epoch 1 is steps 21-41; its intervals of 10: 21-30, 31-40, 41. The gradient of step 25 is inf, so
    # step 25's update makes layer1.weight inf and the loss of step 26 NaN; interval 21-30 is written and
    # checked when 31-40 closes, so the run stops there, naming step 26 and the tensors as step 30 left them.
    inject_inf_grad(monkeypatch, 25)
    with pytest.raises(NonFiniteError) as err:
        train(make_cfg(log_every=10), tmp_path)
    msg = str(err.value)
    assert msg.startswith(
        "non-finite values at step 26 (epoch 2, fp32): the training loss is nan; inf/NaN after step 30 in"
    )
    assert "layer1.weight" in msg and "lower optimizer.lr" in msg
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "step"]
    assert steps == list(range(31)), "every interval up to the bad one is written, the one after it is not"


def test_a_checkpoint_waits_for_the_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lagged: None) -> None:
    # checkpoint_steps=30: the checkpoint after step 29 writes and checks every interval first, so the fault of
    # step 25 stops the run there and last.npz keeps the state of the epoch before (step 21), not a NaN one.
    inject_inf_grad(monkeypatch, 25)
    with pytest.raises(NonFiniteError, match=r"^non-finite values at step 26 \(epoch 2, fp32\)"):
        train(make_cfg(log_every=10, checkpoint_steps=30), tmp_path)
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "step"]
    assert steps == list(range(30))
    last = checkpoint.load(tmp_path / "checkpoints" / "last.npz")
    assert last.position.step == 21 and all(np.isfinite(v).all() for v in last.arrays.values())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_fp16_persistent_overflow_counts_as_the_interval_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lagged: None
) -> None:
    emulate_fp16(monkeypatch)
    inject_inf_grad(monkeypatch, None, layer=0)
    with pytest.raises(NonFiniteError) as err:
        train(make_cfg(**FP16, precision__max_consecutive_skips=7, log_every=1), tmp_path)
    # the count read as step 6 ended (7 skipped in a row), though the loop had run step 7 when it read it
    assert "fp16 gradients overflowed on 7 consecutive steps up to step 6 (loss scale now" in str(err.value)
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "step"]
    assert steps == list(range(7))
