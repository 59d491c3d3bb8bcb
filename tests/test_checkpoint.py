"""Checkpoints: the file format, atomic writes, every bad checkpoint, and exact resume.

A resumed run must match an uninterrupted one: the same per-step losses, epoch records and final
parameters and optimizer state, bit for bit on the CPU (within float tolerance on the GPU).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import FP16, emulate_fp16, make_cfg, records
from numpy.testing import assert_allclose, assert_array_equal

from mlptrain.base import fs as files
from mlptrain.base.errors import CheckpointError, ConfigError, OutputError, TrainingInterrupted
from mlptrain.config.schema import Device, TrainConfig
from mlptrain.run import checkpoint
from mlptrain.run.checkpoint import Best, Position
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train
from mlptrain.run.saving import Writer
from mlptrain.step.trainer import Trainer


def interrupt_at(monkeypatch: pytest.MonkeyPatch, step: int, times: int = 1) -> None:
    """Press Ctrl-C (a real SIGINT to this process) ``times`` times during optimizer step ``step``."""
    original = Trainer.step

    def step_then_sigint(self: Trainer, x: Any, y: Any) -> Any:
        out = original(self, x, y)
        if self.step_count == step + 1:
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(Trainer, "step", step_then_sigint)


def assert_same_state(a: Path, b: Path, *, exact: bool = True) -> None:
    ca, cb = checkpoint.load(a), checkpoint.load(b)
    assert sorted(ca.arrays) == sorted(cb.arrays)
    for key in ca.arrays:
        if exact:
            assert_array_equal(ca.arrays[key], cb.arrays[key], err_msg=key)
        else:
            assert_allclose(ca.arrays[key], cb.arrays[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert ca.meta["position"] == cb.meta["position"]
    assert ca.meta["scaler"] == cb.meta["scaler"]


# ----------------------------------------------------------------------------------- the file


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "param/layer0.weight": rng.standard_normal((4, 3)).astype(np.float32),
        "optim/layer0.weight/momentum": rng.standard_normal((4, 3)).astype(np.float32),
        "optim/t": np.array(7.0),
    }


def _meta(step: int = 7) -> dict[str, Any]:
    """A complete meta (every key of checkpoint.META_SCHEMA but those save() adds) at ``step``."""
    return {
        "position": Position(epoch=step // 10, batch=step % 10, step=step).__dict__,
        "steps_per_epoch": 10,
        "widths": [3, 4],
        "param_dtype": "float32",
        "compute_dtype": "float32",
        "precision": "fp32",
        "execution": "fused",
        "bgrad": [],
        "optimizer": "sgd",
        "scaler": None,
        "rng": {"seed": 0, "data_seed": 1},
        "metrics_records": step,
        "best": Best("val/acc").__dict__,
        "config": {},
        "data": None,
    }


def _write_raw(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """A checkpoint file written as is: no fields added, no SHA-256 computed."""
    with path.open("wb") as f:
        np.savez(f, **arrays, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))


def test_save_then_load_round_trips_without_pickle(tmp_path: Path) -> None:
    path = tmp_path / "last.npz"
    arrays = _arrays()
    checkpoint.save(path, arrays, _meta())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.npz"], "no temporary file may be left"
    ckpt = checkpoint.load(path)
    assert sorted(ckpt.arrays) == sorted(arrays)
    for k, a in arrays.items():
        assert_array_equal(ckpt.arrays[k], a)
        assert ckpt.arrays[k].dtype == a.dtype
    assert ckpt.meta["sha256"] == checkpoint.digest(arrays, ckpt.meta) and ckpt.position.step == 7
    assert ckpt.meta["format_version"] == checkpoint.FORMAT_VERSION == 2
    # A plain NumPy zip: loads without pickle, the meta is UTF-8 JSON.
    with np.load(path, allow_pickle=False) as npz:
        assert set(npz.files) == {*arrays, "meta"}
        assert json.loads(npz["meta"].tobytes())["format"] == "mlptrain-checkpoint"


@pytest.mark.parametrize("fail_in", ["savez", "fsync", "replace", "ctrl-c"])
def test_failed_save_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_in: str
) -> None:
    path = tmp_path / "last.npz"
    checkpoint.save(path, _arrays(), _meta(step=7))
    before = path.read_bytes()
    error: BaseException = KeyboardInterrupt() if fail_in == "ctrl-c" else OSError(28, "No space left on device")

    def fail(*args: Any, **kwargs: Any) -> None:
        if fail_in in ("savez", "ctrl-c"):
            args[0].write(b"PK\x03\x04 half a checkpoint")  # something reached the temporary file
        raise error

    target = {"savez": (np, "savez"), "ctrl-c": (np, "savez"), "fsync": (files.os, "fsync")}
    target["replace"] = (files.os, "replace")
    monkeypatch.setattr(*target[fail_in], fail)
    new = {k: v + 1 for k, v in _arrays().items()}
    with pytest.raises(KeyboardInterrupt if fail_in == "ctrl-c" else CheckpointError) as err:
        checkpoint.save(path, new, _meta(step=8))
    monkeypatch.undo()
    if fail_in != "ctrl-c":
        assert str(path) in str(err.value) and "No space left" in str(err.value)
        assert "previous checkpoint there, if any, is unchanged" in str(err.value)
    assert path.read_bytes() == before
    assert checkpoint.load(path).position.step == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.npz"], "the temporary file must be removed"


def test_the_writer_writes_in_order_what_was_submitted(tmp_path: Path) -> None:
    writer = Writer()
    path = tmp_path / "last.npz"
    for step in (7, 8, 9):
        meta = _meta(step=step)
        writer.submit(path, {k: v + step for k, v in _arrays().items()}, meta)
        meta["position"]["step"] = -1  # changed after submit: the checkpoint keeps the meta as submitted
    writer.close()
    ckpt = checkpoint.load(path)
    assert ckpt.position.step == 9
    assert_array_equal(ckpt.arrays["param/layer0.weight"], _arrays()["param/layer0.weight"] + 9)
    assert sorted(q.name for q in tmp_path.iterdir()) == ["last.npz"]


def test_a_failed_write_stops_the_writes_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "last.npz"
    real_replace = files.os.replace
    calls = {"n": 0}

    def replace(src: Any, dst: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)
    writer = Writer()
    for step in (7, 8):  # 8 fails on its thread
        writer.submit(path, _arrays(), _meta(step=step))
    with pytest.raises(CheckpointError, match="No space left on device"):
        writer.submit(path, _arrays(), _meta(step=9))  # waits for 8 first: 9 is never written over 7
    writer.wait()
    assert calls["n"] == 2 and checkpoint.load(path).position.step == 7
    writer.submit(path, _arrays(), _meta(step=10))  # the error was reported: writing goes on
    writer.close()
    assert checkpoint.load(path).position.step == 10


def _corrupt(kind: str, path: Path) -> str:
    """Damage the checkpoint at ``path`` in one way; return a phrase the error must contain."""
    blob = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(blob[: len(blob) // 2])
        return "truncated, corrupt or not a checkpoint"
    if kind == "empty":
        path.write_bytes(b"")
        return "truncated, corrupt or not a checkpoint"
    if kind == "flipped byte":
        with np.load(path) as npz:  # flip a byte inside the weights' data, not in a zip header
            raw = npz.zip.read("param/layer0.weight.npy")
        i = blob.index(raw) + len(raw) - 3
        path.write_bytes(blob[:i] + bytes([blob[i] ^ 0xFF]) + blob[i + 1 :])
        return "CRC"
    if kind == "not a zip":
        path.write_text("this is not a checkpoint\n")
        return "truncated, corrupt or not a checkpoint"
    if kind == "no meta":
        with path.open("wb") as f:
            np.savez(f, **_arrays())
        return "not an mlptrain checkpoint"
    if kind == "newer format":
        _write_raw(path, _arrays(), {**_meta(), "format": checkpoint.FORMAT, "format_version": 99, "mlptrain": "9.0"})
        return "format version 99 (written by mlptrain 9.0)"
    if kind == "tampered arrays":  # a valid zip whose arrays no longer match the meta's SHA-256
        with np.load(path) as npz:
            entries = {k: npz[k] for k in npz.files}
        entries["param/layer0.weight"] = entries["param/layer0.weight"] * 2
        with path.open("wb") as f:
            np.savez(f, **entries)
        return "SHA-256"
    if kind == "pickled object":
        with path.open("wb") as f:
            np.savez(f, meta=np.array([{"evil": 1}], dtype=object))
        return "allow_pickle=False"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    ["truncated", "empty", "flipped byte", "not a zip", "no meta", "newer format", "tampered arrays", "pickled object"],
)
def test_bad_checkpoint_file_is_refused_by_name(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "last.npz"
    checkpoint.save(path, _arrays(), _meta())
    phrase = _corrupt(kind, path)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path)
    assert str(path) in str(err.value)
    assert phrase in str(err.value)


def test_missing_checkpoint_names_the_path_and_how_to_resume(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        train(make_cfg(resume="last"), tmp_path / "run")
    msg = str(err.value)
    assert str(tmp_path / "run" / "checkpoints" / "last.npz") in msg and "hydra.run.dir=" in msg
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "a failed resume must not start a fresh run"
    with pytest.raises(CheckpointError, match="no checkpoint at .*nowhere.npz"):
        train(make_cfg(resume=str(tmp_path / "nowhere.npz")), tmp_path / "run")


# ----------------------------------------------------------------------------- exact resume


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


# ------------------------------------------------------------- checkpoints that do not fit


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run stopped by Ctrl-C at step 30, kept read-only: tests resume copies of it."""
    run = tmp_path_factory.mktemp("finished")
    mp = pytest.MonkeyPatch()
    interrupt_at(mp, 29)
    try:
        with pytest.raises(TrainingInterrupted):
            train(make_cfg(checkpoint_steps=10), run)
    finally:
        mp.undo()
    return run


def _copy_run(src: Path, dst: Path) -> dict[str, bytes]:
    import shutil

    shutil.copytree(src, dst)
    return snapshot_of(dst)


def _unchanged(run: Path, before: dict[str, bytes]) -> None:
    assert snapshot_of(run) == before, "a refused resume must not change any file of the run"


@pytest.mark.parametrize(
    ("overrides", "phrases"),
    [
        ({"model__hidden": [16]}, ["holds a run with model.hidden=[32], but this resume sets model.hidden=[16]"]),
        ({"precision__name": "fp64"}, ["precision.name=fp32, but this resume sets precision.name=fp64"]),
        ({"optimizer__name": "adam"}, ["optimizer.name=sgd, but this resume sets optimizer.name=adam"]),
        ({"optimizer__momentum": 0.0}, ["with optimizer.momentum=0.9, but this resume sets optimizer.momentum=0.0"]),
        ({"data__batch_size": 32}, ["with data.batch_size=64, but this resume sets data.batch_size=32"]),
        ({"epochs": 1}, ["is at step 30, at or past the end of this run (21 steps", "raise epochs or max_steps"]),
    ],
    ids=["architecture", "dtype", "optimizer", "optimizer-state", "batch-size", "nothing-left"],
)
def test_mismatched_checkpoint_is_refused_and_nothing_is_overwritten(
    tmp_path: Path, finished: Path, overrides: dict[str, Any], phrases: list[str]
) -> None:
    run = tmp_path / "run"
    before = _copy_run(finished, run)
    with pytest.raises((CheckpointError, ConfigError)) as err:
        train(make_cfg(resume="last", checkpoint_steps=10, **overrides), run)
    msg = str(err.value)
    assert str(run / "checkpoints" / "last.npz") in msg
    for phrase in phrases:
        assert phrase in msg, msg
    _unchanged(run, before)


def test_corrupt_last_checkpoint_fails_resume_and_changes_nothing(tmp_path: Path, finished: Path) -> None:
    run = tmp_path / "run"
    _copy_run(finished, run)
    last = run / "checkpoints" / "last.npz"
    last.write_bytes(last.read_bytes()[:-100])
    before = snapshot_of(run)
    with pytest.raises(CheckpointError, match="truncated, corrupt or not a checkpoint"):
        train(make_cfg(resume="last", checkpoint_steps=10), run)
    _unchanged(run, before)


def test_resuming_an_older_checkpoint_in_place_is_refused(tmp_path: Path, finished: Path) -> None:
    run = tmp_path / "run"
    before = _copy_run(finished, run)
    best = run / "checkpoints" / "best.npz"  # written at the end of epoch 0, step 21; last is at step 30
    assert checkpoint.load(best).position.step == 21
    with pytest.raises(CheckpointError, match="would overwrite .*last.npz \\(step 30\\)"):
        train(make_cfg(resume=str(best), checkpoint_steps=10), run)
    _unchanged(run, before)


def test_fresh_run_refuses_a_directory_holding_a_run(tmp_path: Path, finished: Path) -> None:
    run = tmp_path / "run"
    before = _copy_run(finished, run)
    with pytest.raises(OutputError) as err:
        train(make_cfg(), run)
    msg = str(err.value)
    assert "already holds a run (metrics.jsonl, checkpoints/best.npz, checkpoints/last.npz)" in msg
    assert "with cfg.resume='last'" in msg and "choose a new out_dir" in msg
    _unchanged(run, before)


def test_best_follows_validation_accuracy(finished: Path) -> None:
    meta = checkpoint.load(finished / "checkpoints" / "last.npz").meta
    epoch0 = next(r for r in read_metrics(finished / "metrics.jsonl") if r["kind"] == "epoch")
    assert Best(**meta["best"]) == Best("val/acc", epoch0["val/acc"], 0, 21, improved=0)
    assert meta["metrics_records"] == 31, "21 steps, 1 epoch record, 9 steps"
    assert meta["position"]["epoch"] == 1 and meta["position"]["batch"] == 9


def test_checkpoint_with_incomplete_meta_is_refused(tmp_path: Path, finished: Path) -> None:
    run = tmp_path / "run"
    _copy_run(finished, run)
    last = run / "checkpoints" / "last.npz"
    ckpt = checkpoint.load(last)
    checkpoint.save(last, ckpt.arrays, {k: v for k, v in ckpt.meta.items() if k not in ("widths", "sha256")})
    before = snapshot_of(run)
    with pytest.raises(CheckpointError, match=f"checkpoint {last} has a damaged meta: meta has missing keys widths"):
        train(make_cfg(resume="last", checkpoint_steps=10), run)
    _unchanged(run, before)


def snapshot_of(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_resume_keeps_the_bgrad_strategy_the_run_was_trained_with(tmp_path: Path) -> None:
    """The two bias-gradient strategies round differently: a resumed run must not switch."""
    cfg = TrainConfig()
    cfg.device, cfg.progress, cfg.model.hidden = Device.cpu, False, [16, 8]
    cfg.execution.bgrad = type(cfg.execution.bgrad)("drelu_bgrad")
    arrays, meta = Trainer(cfg).state_dict()
    cfg.execution.bgrad = type(cfg.execution.bgrad)("bgradb")
    resumed = Trainer(cfg)
    assert resumed.model.bgrad == ["bgradb", "bgradb"]
    resumed.load_state_dict(arrays, meta, step=0, where="the checkpoint")
    assert resumed.model.bgrad == ["drelu_bgrad", "drelu_bgrad"]


# ------------------------------------------------------------- whatever the bytes: one error


def test_random_damage_to_a_checkpoint_is_always_a_checkpoint_error(tmp_path: Path) -> None:
    """600 mutations of a real checkpoint (flipped, overwritten, inserted, cut bytes): every load either
    returns the intact checkpoint or raises CheckpointError naming the file; never another exception."""
    good = tmp_path / "good.npz"
    arrays = _arrays()
    checkpoint.save(good, arrays, _meta())
    blob = good.read_bytes()
    rng = np.random.default_rng(0)
    path = tmp_path / "bad.npz"
    outcomes = {"refused": 0, "intact": 0}
    for _ in range(600):
        b = bytearray(blob)
        kind = rng.integers(4)
        i = int(rng.integers(len(b)))
        if kind == 0:
            b[i] ^= 1 << int(rng.integers(8))
        elif kind == 1:
            b[i : i + 8] = rng.bytes(8)
        elif kind == 2:
            b[i:i] = rng.bytes(int(rng.integers(1, 5)))
        else:
            del b[i:]
        path.write_bytes(bytes(b))
        try:
            ckpt = checkpoint.load(path)
        except CheckpointError as exc:
            assert str(path) in str(exc)
            outcomes["refused"] += 1
            continue
        assert all(np.array_equal(ckpt.arrays[k], v) for k, v in arrays.items())  # damage where it does not matter
        outcomes["intact"] += 1
    assert outcomes["refused"] > 500, outcomes


@pytest.mark.parametrize(
    ("edit", "phrase"),
    [
        (lambda m: m.update(extra=1), "unknown keys extra"),
        (lambda m: m.pop("rng"), "missing keys rng"),
        (lambda m: m.update(widths=["64", 10]), "meta.widths[0] is '64', expected a non-negative integer"),
        (lambda m: m["position"].update(step=-3), "meta.position.step is -3, expected a non-negative integer"),
        (lambda m: m["position"].update(step=8), "does not fit 10 batches per epoch"),
        (lambda m: m.update(scaler={"scale": "big"}), "meta.scaler has missing keys"),
        (lambda m: m.update(metrics_records=1.5), "meta.metrics_records is 1.5"),
    ],
    ids=["extra-key", "missing-key", "wrong-type", "negative-position", "inconsistent-position", "scaler", "float"],
)
def test_a_hand_edited_meta_is_refused(tmp_path: Path, edit: Any, phrase: str) -> None:
    path = tmp_path / "last.npz"
    checkpoint.save(path, _arrays(), _meta())
    ckpt = checkpoint.load(path)
    meta = json.loads(json.dumps(ckpt.meta))
    edit(meta)
    _write_raw(path, ckpt.arrays, meta)  # edited by hand: the SHA-256 no longer matches
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is corrupt: its arrays and meta have SHA-256"):
        checkpoint.load(path)
    meta["sha256"] = checkpoint.digest(ckpt.arrays, meta)  # edited with care: the schema still says no
    _write_raw(path, ckpt.arrays, meta)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path)
    assert f"checkpoint {path} has a damaged meta: " in str(err.value) and phrase in str(err.value)


@pytest.mark.parametrize("kind", ["npy", "bytes meta", "2-d meta", "directory", "device"])
def test_files_that_are_not_checkpoints_are_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "x.npz"
    if kind == "npy":
        with path.open("wb") as f:
            np.save(f, np.zeros(3))
    elif kind == "bytes meta":
        with path.open("wb") as f:
            np.savez(f, **_arrays(), meta=np.array(b'{"format": "mlptrain-checkpoint"}'))
    elif kind == "2-d meta":
        with path.open("wb") as f:
            np.savez(f, **_arrays(), meta=np.zeros((2, 2), np.uint8))
    elif kind == "directory":
        path.mkdir()
    else:
        path = Path("/dev/zero")
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path)
    assert str(path) in str(err.value)


def test_version_1_checkpoints_are_still_read(tmp_path: Path) -> None:
    """Format 1: the SHA-256 covered the arrays alone."""
    path = tmp_path / "v1.npz"
    arrays = _arrays()
    meta = {**_meta(), "format": checkpoint.FORMAT, "format_version": 1, "mlptrain": "0.1.0"}
    del meta["data"], meta["best"]["mode"]  # what version 1 did not record
    meta["sha256"] = checkpoint.digest(arrays)
    _write_raw(path, arrays, meta)
    assert checkpoint.load(path).position.step == 7
