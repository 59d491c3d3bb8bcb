"""Checkpoints: the file format, atomic writes, bad checkpoints, and checkpoints that do not fit the run.

Damaged bytes of every kind: tests/test_checkpoint_damage.py; exact resume: tests/test_exact_resume.py (both use
this module's helpers).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg
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
