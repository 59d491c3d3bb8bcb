"""Faults while training: Ctrl-C, SIGKILL, unwritable outputs, bad data files (inf/NaN and out of memory:
tests/test_reliability_step.py).

Each test checks the message a user gets and that nothing written earlier was lost. The signal
tests run ``python -m mlptrain`` in a subprocess, as a user would; docs/reliability.md lists them.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg, records

from mlptrain.base import fs as files
from mlptrain.base.errors import CheckpointError, DatasetError, Interrupted, OutputError
from mlptrain.config.schema import Schedule
from mlptrain.data import sources
from mlptrain.run import checkpoint
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train
from mlptrain.step.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ signals (subprocesses)

# Long enough never to finish on its own, with a constant learning rate so that a resume with a
# smaller max_steps follows the same schedule.
ENDLESS = ["model.hidden=[32]", "epochs=100000", "optimizer.schedule=constant", "progress=false", "device=cpu"]


def start_cli(*args: str, cwd: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "HYDRA_MAIN_MODULE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.Popen(
        [sys.executable, "-m", "mlptrain", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(proc: subprocess.Popen[str], ready: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended early ({proc.returncode}):\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the run did not get going in time")
        time.sleep(0.02)


def step_lines(run: Path) -> int:
    path = run / "metrics.jsonl"
    return path.read_text().count('"kind": "step"') if path.is_file() else 0


def interrupt_cli(run: Path, sig: int) -> str:
    """Start an endless CLI run into ``run``, send ``sig`` after 50 steps; check the exit; return stderr."""
    proc = start_cli(*ENDLESS, f"hydra.run.dir={run}", cwd=run.parent)
    wait_for(proc, lambda: step_lines(run) >= 50)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, out + err  # 130 for SIGINT, 143 for SIGTERM
    assert "Traceback" not in out + err
    return err


def test_ctrl_c_saves_last_and_exits_130_then_resume_continues(tmp_path: Path) -> None:
    run = tmp_path / "run"
    err = interrupt_cli(run, signal.SIGINT)
    lines = [line for line in err.splitlines() if line.strip()]
    last = run / "checkpoints" / "last.npz"
    assert lines[-1].startswith("mlptrain: interrupted at step ") and str(last) in lines[-1], err
    assert f"hydra.run.dir={run} resume=last" in lines[-1]
    interrupted = read_metrics(run / "metrics.jsonl")
    step = interrupted[-1]["step"]
    assert interrupted[-1]["kind"] == "interrupted" and interrupted[-1]["checkpoint"] == str(last)
    assert checkpoint.load(last).position.step == step, "the checkpoint is the state at the interrupt"
    assert [r["step"] for r in interrupted if r["kind"] == "step"] == list(range(step))

    proc = start_cli(*ENDLESS, f"hydra.run.dir={run}", "resume=last", f"max_steps={step + 30}", cwd=tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    resumed = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in resumed if r["kind"] == "step"] == list(range(step + 30)), "no gap, no repeat"
    assert not any(r["kind"] == "interrupted" for r in resumed) and resumed[-1]["kind"] == "summary"
    assert resumed[: len(interrupted) - 1] == interrupted[:-1], "the records before the interrupt are kept as they were"


def test_sigterm_saves_last_and_exits_143(tmp_path: Path) -> None:
    """What a job scheduler or ``docker stop`` sends before it kills: treated as Ctrl-C, exit 128 + 15."""
    run = tmp_path / "run"
    err = interrupt_cli(run, signal.SIGTERM)
    last = run / "checkpoints" / "last.npz"
    line = [x for x in err.splitlines() if x.strip()][-1]
    assert line.startswith("mlptrain: interrupted at step ") and "SIGTERM" in line and str(last) in line, err
    rec = read_metrics(run / "metrics.jsonl")[-1]
    assert rec["kind"] == "interrupted" and rec["signal"] == "SIGTERM"
    assert checkpoint.load(last).position.step == rec["step"]


def test_sigkill_leaves_a_loadable_last_and_resume_matches_uninterrupted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    every = ["checkpoint_steps=25", "log_every=5"]
    proc = start_cli(*ENDLESS, *every, f"hydra.run.dir={run}", cwd=tmp_path)
    last = run / "checkpoints" / "last.npz"
    wait_for(proc, lambda: last.is_file() and step_lines(run) >= 150)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed = records(run)
    ckpt = checkpoint.load(last)  # loads, whatever moment the kill hit
    step = ckpt.position.step
    assert step > 0 and step % 25 == 0 or ckpt.position.batch == 0, ckpt.position
    assert max(r["step"] for r in killed if r["kind"] == "step") >= step - 1

    end = step + 40
    proc = start_cli(*ENDLESS, *every, f"hydra.run.dir={run}", "resume=last", f"max_steps={end}", cwd=tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err

    # The same run straight through, in this process: the resumed metrics must match it exactly.
    straight = tmp_path / "straight"
    cfg = make_cfg(
        epochs=100000, checkpoint_steps=25, log_every=5, max_steps=end, optimizer__schedule=Schedule.constant
    )
    train(cfg, straight)
    assert records(run) == records(straight)
    overlap = [r for r in killed if r["kind"] == "step" and r["step"] >= step]  # logged after the checkpoint
    if overlap:
        assert overlap == [r for r in records(run) if r["kind"] == "step" and step <= r["step"] <= overlap[-1]["step"]]
    for key, a in checkpoint.load(straight / "checkpoints" / "last.npz").arrays.items():
        np.testing.assert_array_equal(checkpoint.load(last).arrays[key], a, err_msg=key)


def test_second_ctrl_c_stops_at_once_and_restores_the_handler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = Trainer.step
    saved: list[tuple[str, int]] = []

    def step(self: Trainer, x: Any, y: Any) -> Any:
        out = original(self, x, y)
        if self.step_count == 25:
            signal.raise_signal(signal.SIGINT)  # the first asks to stop after this step ...
            signal.raise_signal(signal.SIGINT)  # ... the second does not wait
        return out

    real_save = checkpoint.save

    def save(path: Path, arrays: Any, meta: dict[str, Any]) -> None:
        saved.append((Path(path).stem, meta["position"]["step"]))
        real_save(path, arrays, meta)

    monkeypatch.setattr(Trainer, "step", step)
    monkeypatch.setattr(checkpoint, "save", save)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as err:
        train(make_cfg(checkpoint_steps=10), tmp_path)
    assert type(err.value) is Interrupted and err.value.signum == signal.SIGINT, "no checkpoint for a second Ctrl-C"
    assert signal.getsignal(signal.SIGINT) is before
    # best is written before last, whose meta refers to it; none after the second Ctrl-C
    assert saved == [("last", 10), ("last", 20), ("best", 21), ("last", 21)]
    assert checkpoint.load(tmp_path / "checkpoints" / "last.npz").position.step == 21


def test_ctrl_c_handler_is_restored_after_a_normal_run(tmp_path: Path) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    train(make_cfg(epochs=1), tmp_path)
    assert {s: signal.getsignal(s) for s in before} == before


# ---------------------------------------------------------------- outputs and input files


def test_output_directory_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("a file, not a folder\n")
    out = blocker / "run"  # NotADirectoryError, also for root (chmod would not stop root)
    with pytest.raises(OutputError) as err:
        train(make_cfg(), out)
    msg = str(err.value)
    assert f"cannot create the output directory {out}" in msg and "NotADirectoryError" in msg
    assert "choose a writable out_dir" in msg, "from Python the message names train()'s argument"
    assert blocker.read_text() == "a file, not a folder\n"


def test_failed_checkpoint_write_stops_and_keeps_the_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_replace = os.replace
    calls = {"n": 0}

    def replace(src: Any, dst: Any) -> None:
        if str(dst).endswith("last.npz"):
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)
    with pytest.raises(CheckpointError) as err:
        train(make_cfg(checkpoint_steps=8, checkpoint_every=0), tmp_path)
    last = tmp_path / "checkpoints" / "last.npz"
    assert f"cannot write checkpoint {last} (OSError: [Errno 28] No space left on device)" in str(err.value)
    assert checkpoint.load(last).position.step == 16
    assert sorted(p.name for p in last.parent.iterdir()) == ["best.npz", "last.npz"], "no temporary file is left"


def test_corrupt_dataset_fails_resume_and_keeps_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    train(make_cfg(epochs=1, max_steps=10), run)
    before = snapshot(run)
    blob = bytearray(sources.DIGITS_PATH.read_bytes())
    blob[len(blob) // 3] ^= 0x01
    bad = tmp_path / "digits.csv.gz"
    bad.write_bytes(bytes(blob))
    monkeypatch.setattr(sources, "DIGITS_PATH", bad)
    with pytest.raises(DatasetError) as err:
        train(make_cfg(epochs=1, resume="last"), run)
    msg = str(err.value)
    assert f"bundled digits file {bad} fails its checksum: SHA-256 {hashlib.sha256(bytes(blob)).hexdigest()}" in msg
    assert snapshot(run) == before


def test_cli_reports_a_bad_resume_in_one_line(tmp_path: Path) -> None:
    proc = start_cli(
        "model.hidden=[32]", "device=cpu", "resume=last", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "resume='last': no checkpoint at " in errors[0] and "hydra.run.dir=" in errors[0]
    assert "Traceback" not in out + err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ------------------------------------------------------------- more stops, more bad inputs


def test_a_second_sigterm_stops_at_once_with_143(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start_cli(*ENDLESS, "checkpoint_steps=10", f"hydra.run.dir={run}", cwd=tmp_path)
    wait_for(proc, lambda: step_lines(run) >= 50)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, out + err  # not 130: the signal that stopped the run is SIGTERM
    assert "Traceback" not in out + err
    checkpoint.load(run / "checkpoints" / "last.npz")  # whichever signal won the race, last.npz loads


def test_divergence_is_one_error_line_without_numpy_warnings(tmp_path: Path) -> None:
    proc = start_cli(
        *ENDLESS[:-1],
        "optimizer.lr=1e6",
        "optimizer.momentum=0",
        "device=cpu",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err
    assert "RuntimeWarning" not in out + err and "Traceback" not in out + err
    (line,) = [x for x in err.splitlines() if x.strip() and not x.startswith("[")]  # the log's lines aside
    assert line.startswith("error: non-finite values at step ") and "lower optimizer.lr" in line


@pytest.mark.parametrize(
    ("override", "phrase"),
    [
        ("seed=-1", "seed=-1 must be an integer in [0, 2**32)"),
        ("optimizer.eps=inf", "optimizer.eps=inf must be a finite number"),
        ("optimizer.lr=nan", "optimizer.lr=nan must be a finite number"),
        ("precision.init_scale=inf", "precision.init_scale=inf must be a finite number"),
        ("data=synthetic data.samples=2", "has 2 samples for training, too few"),
    ],
)
def test_values_that_cannot_train_are_refused_in_one_line(tmp_path: Path, override: str, phrase: str) -> None:
    proc = start_cli("device=cpu", "epochs=1", *override.split(), f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err
    (line,) = [x for x in err.splitlines() if x.strip()]
    assert line.startswith("error: ") and phrase in line, err
    if "samples" in override:
        assert "raise data.samples" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["directory", "link to /dev/zero"])
def test_an_mnist_cache_entry_that_is_not_a_file_is_refused(tmp_path: Path, kind: str) -> None:
    from mlptrain.config.schema import DataConfig, DatasetName
    from mlptrain.data import IDX_FILES, load_dataset

    folder = tmp_path / "mnist"
    folder.mkdir()
    target = folder / IDX_FILES[0]
    if kind == "directory":
        target.mkdir()
    else:
        target.symlink_to("/dev/zero")  # reading it never ends: it must not be read
    with pytest.raises(DatasetError, match=rf"cached file {target} is corrupt, truncated or not a file \(not a regul"):
        load_dataset(DataConfig(name=DatasetName.mnist, root=str(tmp_path), download=False), seed=0)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_input_data_is_named_by_split_row_and_column(tmp_path: Path, value: float) -> None:
    from mlptrain.data import Dataset

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((60, 4)).astype(np.float32), np.arange(60) % 3
    x_val = x[:10].copy()
    x_val[7, 2] = value
    with pytest.raises(DatasetError, match=rf"split val: row 7, column 2 holds {value}; features must be finite"):
        Dataset("mine", x[10:], y[10:], x_val, y[:10], x[:10], y[:10], num_classes=3)


def test_a_read_only_checkpoint_folder_is_one_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The temp file cannot be created and its clean-up fails too: the first error is the one reported."""
    real_open = open

    def read_only(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if str(file).endswith(".tmp") and "checkpoints" in str(file):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, mode, *args, **kwargs)

    def unlink(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(files, "open", read_only, raising=False)
    monkeypatch.setattr(files.Path, "unlink", unlink)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*best.npz \(PermissionError: \[Errno 13\]"):
        train(make_cfg(), tmp_path)
