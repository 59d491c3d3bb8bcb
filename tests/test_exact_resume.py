"""Exact resume: a run interrupted (or crashed) and resumed matches an uninterrupted one, the same per-step losses,
epoch records and final parameters and optimizer state, bit for bit on the CPU (within float tolerance on the GPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import FP16, emulate_fp16, make_cfg, records
from numpy.testing import assert_allclose
from test_checkpoint import assert_same_state, interrupt_at

from mlptrain.base.errors import TrainingInterrupted
from mlptrain.config.schema import Device
from mlptrain.run import checkpoint
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train
from mlptrain.step.trainer import Trainer


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted reference runs, by optimizer."""
    out = {}
    for name, overrides in REFERENCE.items():
        out[name] = tmp_path_factory.mktemp(f"straight-{name}")
        train(make_cfg(**overrides), out[name])
    return out


REFERENCE: dict[str, dict[str, Any]] = {
    "sgd": {"optimizer__nesterov": True},
    "adamw": {"optimizer__name": "adamw", "optimizer__lr": 0.01, "optimizer__warmup_steps": 5},
}


@pytest.mark.parametrize(("opt", "at"), [("sgd", 30), ("adamw", 30), ("adamw", 20), ("sgd", 0)])
def test_interrupted_then_resumed_equals_uninterrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, straight: dict[str, Path], opt: str, at: int
) -> None:
    # Step 30 is mid-epoch (21 steps per epoch), step 20 the last of epoch 0, step 0 the first.
    interrupt_at(monkeypatch, at)
    with pytest.raises(TrainingInterrupted) as err:
        train(make_cfg(**REFERENCE[opt]), tmp_path)
    monkeypatch.undo()
    assert err.value.step == at + 1 and err.value.checkpoint == tmp_path / "checkpoints" / "last.npz"
    assert "with cfg.resume='last'" in str(err.value)
    interrupted = read_metrics(tmp_path / "metrics.jsonl")
    assert interrupted[-1]["kind"] == "interrupted" and interrupted[-1]["step"] == at + 1
    assert [r["step"] for r in interrupted if r["kind"] == "step"] == list(range(at + 1))
    assert checkpoint.load(err.value.checkpoint).position.step == at + 1

    summary = train(make_cfg(resume="last", **REFERENCE[opt]), tmp_path)

    ref = straight[opt]
    assert records(tmp_path) == records(ref), "metrics.jsonl must equal the uninterrupted run's"
    assert summary["steps"] == 63 and summary["test/acc"] == read_metrics(ref / "metrics.jsonl")[-1]["test/acc"]
    assert_same_state(tmp_path / "checkpoints" / "last.npz", ref / "checkpoints" / "last.npz")
    assert_same_state(tmp_path / "checkpoints" / "best.npz", ref / "checkpoints" / "best.npz")
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["resumed_from"] == {"checkpoint": str(tmp_path / "checkpoints" / "last.npz"), "step": at + 1}


def test_crash_then_resume_from_step_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, straight: dict[str, Path]
) -> None:
    """A run that dies (an exception, no checkpoint of its own) resumes from its last step checkpoint."""
    original = Trainer.step

    def crash(self: Trainer, x: Any, y: Any) -> Any:
        if self.step_count == 33:
            raise RuntimeError("simulated crash")
        return original(self, x, y)

    monkeypatch.setattr(Trainer, "step", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(make_cfg(checkpoint_steps=8, **REFERENCE["sgd"]), tmp_path)
    monkeypatch.undo()
    pos = checkpoint.load(tmp_path / "checkpoints" / "last.npz").position
    assert (pos.epoch, pos.batch, pos.step) == (1, 11, 32), "the last step checkpoint before the crash"
    train(make_cfg(checkpoint_steps=8, resume="last", **REFERENCE["sgd"]), tmp_path)
    assert records(tmp_path) == records(straight["sgd"])
    assert_same_state(tmp_path / "checkpoints" / "last.npz", straight["sgd"] / "checkpoints" / "last.npz")


def test_resume_into_a_new_directory_copies_the_metrics_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, straight: dict[str, Path]
) -> None:
    interrupt_at(monkeypatch, 40)
    with pytest.raises(TrainingInterrupted):
        train(make_cfg(**REFERENCE["sgd"]), tmp_path / "a")
    monkeypatch.undo()
    source = tmp_path / "a" / "checkpoints" / "last.npz"
    before = (tmp_path / "a" / "metrics.jsonl").read_bytes()
    train(make_cfg(resume=str(source), **REFERENCE["sgd"]), tmp_path / "b")
    assert records(tmp_path / "b") == records(straight["sgd"])
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == before, "the source run must not change"
    assert checkpoint.load(source).position.step == 41


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_fp16_loss_scaler_state_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16's scale, growth tracker and skip count are in the checkpoint (fp16 emulated on the CPU)."""
    emulate_fp16(monkeypatch)
    overrides = {**FP16, "precision__init_scale": 2.0**30, "precision__growth_interval": 4, "epochs": 2}
    train(make_cfg(**overrides), tmp_path / "straight")
    ref = records(tmp_path / "straight")
    steps = [r for r in ref if r["kind"] == "step"]
    skipped = [r["skipped"] for r in steps]
    assert all(skipped[:5]) and not all(skipped), "the scale must back off from 2**30, then train"
    assert any(skipped[20:]), "after growing, the scale must overflow and back off again"

    def tracker(k: int) -> int:  # clean steps since the last change of scale, after step k
        n = 0
        for s in skipped[: k + 1]:
            n = 0 if s else (n + 1) % 4
        return n

    at = next(k for k in range(20, 40) if tracker(k) > 0)  # interrupt with a growth tracker to restore
    interrupt_at(monkeypatch, at)
    with pytest.raises(TrainingInterrupted):
        train(make_cfg(**overrides), tmp_path / "resumed")
    monkeypatch.undo()  # drop the interruption
    emulate_fp16(monkeypatch)
    meta = checkpoint.load(tmp_path / "resumed" / "checkpoints" / "last.npz").meta
    assert meta["scaler"]["growth_tracker"] == tracker(at) and meta["precision"] == "fp16"
    train(make_cfg(resume="last", **overrides), tmp_path / "resumed")
    assert records(tmp_path / "resumed") == ref
    assert_same_state(
        tmp_path / "resumed" / "checkpoints" / "last.npz", tmp_path / "straight" / "checkpoints" / "last.npz"
    )


@pytest.mark.gpu
def test_gpu_interrupted_then_resumed_matches_within_tolerance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = {"device": Device.gpu, "optimizer__name": "adamw", "optimizer__lr": 0.01}
    for precision in ("fp32", "fp16"):
        a, b = tmp_path / f"straight-{precision}", tmp_path / f"resumed-{precision}"
        cfg = {**overrides, "precision__name": precision}
        train(make_cfg(**cfg), a)
        interrupt_at(monkeypatch, 30)
        with pytest.raises(TrainingInterrupted):
            train(make_cfg(**cfg), b)
        monkeypatch.undo()
        train(make_cfg(resume="last", **cfg), b)
        ra, rb = records(a), records(b)
        assert [(r["kind"], r.get("step")) for r in ra] == [(r["kind"], r.get("step")) for r in rb]
        la = [r["train/loss"] for r in ra if r["kind"] == "step"]
        lb = [r["train/loss"] for r in rb if r["kind"] == "step"]
        assert_allclose(lb, la, rtol=1e-4)
        assert_same_state(a / "checkpoints" / "last.npz", b / "checkpoints" / "last.npz", exact=False)
