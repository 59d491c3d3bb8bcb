"""The run directory: one writer at a time, refused runs change nothing, stray temp files, resumes that
bring their run along. The subprocess tests run ``python -m mlptrain`` as a user would."""

from __future__ import annotations

import logging
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg, records
from test_reliability import ENDLESS, start_cli, step_lines, wait_for

from mlptrain.base.errors import OutputError, TrainingInterrupted
from mlptrain.run import checkpoint
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train
from mlptrain.run.rundir import RunDirectory
from mlptrain.step.trainer import Trainer


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def interrupt_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    original = Trainer.step

    def step_then_sigint(self: Trainer, x: Any, y: Any) -> Any:
        out = original(self, x, y)
        if self.step_count == step:
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(Trainer, "step", step_then_sigint)


# ----------------------------------------------------------------------------- one writer


def test_a_second_writer_is_refused_at_once_naming_the_holder(tmp_path: Path) -> None:
    run = RunDirectory(tmp_path / "run")
    run.create()
    with run.lock():  # another "process": flock locks belong to an open file, so this one conflicts too
        with pytest.raises(OutputError) as err:
            train(make_cfg(), run.path)
    msg = str(err.value)
    assert f"output directory {run.path} is in use by another mlptrain process" in msg
    assert "(pid " in msg and "nothing was changed" in msg
    assert list(run.path.iterdir()) == [], "the refused run wrote nothing"
    train(make_cfg(epochs=1), run.path)  # released: the directory is usable at once


def test_two_runs_started_together_one_trains_one_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["model.hidden=[32]", "epochs=30", "progress=false", "device=cpu", f"hydra.run.dir={run}"]
    procs = [start_cli(*args, cwd=tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outs
    loser = outs[[p.returncode for p in procs].index(2)][1]
    (line,) = [x for x in loser.splitlines() if x.startswith("error: ")]
    assert "is in use by another mlptrain process" in line or "already holds a run" in line, loser
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in recs if r["kind"] == "step"] == list(range(30 * 21)), "one run's records, whole"
    assert recs[-1]["kind"] == "summary"
    assert checkpoint.load(run / "checkpoints" / "last.npz").position.step == 30 * 21
    assert not list(run.rglob("*.tmp"))


def test_a_resume_while_the_run_is_going_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start_cli(*ENDLESS, "checkpoint_steps=20", f"hydra.run.dir={run}", cwd=tmp_path)
    try:
        wait_for(proc, lambda: (run / "checkpoints" / "last.npz").is_file() and step_lines(run) >= 60)
        second = start_cli(*ENDLESS, "resume=last", f"hydra.run.dir={run}", cwd=tmp_path)
        out, err = second.communicate(timeout=120)
        assert second.returncode == 2, out + err
        (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
        assert f"output directory {run} is in use by another mlptrain process (pid {proc.pid})" in line
        assert proc.poll() is None, "the first run goes on"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 130
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "step"]
    assert steps == list(range(len(steps))), "no records from a second writer"


# --------------------------------------------------------------- refused runs change nothing


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished CLI run: .hydra/, mlptrain.log, run.json, metrics.jsonl, checkpoints."""
    root = tmp_path_factory.mktemp("cli-run")
    proc = start_cli(
        "model.hidden=[32]", "epochs=2", "progress=false", "device=cpu", f"hydra.run.dir={root / 'run'}", cwd=root
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    return root / "run"


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        ([], "already holds a run"),  # a fresh run into a finished run's directory
        (["resume=last"], "at or past the end of this run"),
        (["resume=last", "model.hidden=[16]", "epochs=5"], "model.hidden=[32], but this resume sets model.hidden=[16]"),
        (["resume=last", "epochs=5", "optimizer.lr=-1"], "optimizer.lr=-1.0 must be positive"),
        (["resume=last", "epochs=5", "optimizer=adam"], "optimizer.name=sgd, but this resume sets optimizer.name=adam"),
    ],
    ids=["fresh", "finished", "architecture", "bad-value", "optimizer"],
)
def test_a_refused_cli_run_leaves_the_directory_byte_for_byte(
    tmp_path: Path, cli_run: Path, args: list[str], phrase: str
) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(cli_run, run)
    before = snapshot(run)
    assert ".hydra/config.yaml" in before and "mlptrain.log" in before
    proc = start_cli(
        "model.hidden=[32]", "epochs=2", "progress=false", "device=cpu", *args, f"hydra.run.dir={run}", cwd=tmp_path
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert phrase in line, err
    assert "Traceback" not in out + err
    assert snapshot(run) == before, "Hydra's files, the log and the run's files are as they were"


def test_a_run_directory_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("a file\n")
    for key in ("hydra.run.dir", "hydra.sweep.dir"):
        proc = start_cli(
            *(["-m"] if "sweep" in key else []), "device=cpu", f"{key}={tmp_path / 'afile' / 'run'}", cwd=tmp_path
        )
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, out + err
        assert err.strip().splitlines()[-1].startswith(f"error: cannot create the output directory {tmp_path}/afile")
        assert "Traceback" not in out + err


# ------------------------------------------------------------------- stray files and resumes


def test_a_stray_temp_file_is_removed_and_reported_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    interrupt_at(monkeypatch, 30)
    with pytest.raises(TrainingInterrupted):
        train(make_cfg(), tmp_path)
    monkeypatch.undo()
    stray = tmp_path / "checkpoints" / "last.npz.4242.0badcafe.tmp"  # a writer killed mid-write left this
    stray.write_bytes(b"PK\x03\x04 half a checkpoint")
    with caplog.at_level(logging.WARNING):
        train(make_cfg(resume="last"), tmp_path)
    assert not stray.exists()
    assert any(str(stray) in r.getMessage() and "interrupted" in r.getMessage() for r in caplog.records)


def test_a_run_killed_before_its_first_checkpoint_resumes_from_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight = tmp_path / "straight"
    train(make_cfg(checkpoint_every=0), straight)
    original = Trainer.step

    def die(self: Trainer, x: Any, y: Any) -> Any:
        if self.step_count == 15:
            raise SystemExit("killed")  # in the first epoch: no checkpoint yet
        return original(self, x, y)

    monkeypatch.setattr(Trainer, "step", die)
    with pytest.raises(SystemExit):
        train(make_cfg(checkpoint_every=0), tmp_path / "run")
    monkeypatch.undo()
    assert not list((tmp_path / "run" / "checkpoints").glob("*.npz")) and step_lines(tmp_path / "run") == 10
    with pytest.raises(OutputError, match=r"continue it with: train\(cfg, out_dir=.*\) with cfg.resume='last'"):
        train(make_cfg(checkpoint_every=0), tmp_path / "run")
    train(make_cfg(checkpoint_every=0, resume="last"), tmp_path / "run")
    assert records(tmp_path / "run") == records(straight)


def test_resume_into_a_new_directory_brings_best_along(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    interrupt_at(monkeypatch, 50)
    with pytest.raises(TrainingInterrupted):
        train(make_cfg(), tmp_path / "a")
    src_best = checkpoint.load(tmp_path / "a" / "checkpoints" / "best.npz")
    interrupt_at(monkeypatch, 51)  # stop the resumed run at once: no epoch of its own ends
    with pytest.raises(TrainingInterrupted):
        train(make_cfg(resume=str(tmp_path / "a" / "checkpoints" / "last.npz")), tmp_path / "b")
    best = checkpoint.load(tmp_path / "b" / "checkpoints" / "best.npz")
    assert best.position == src_best.position and best.meta["sha256"] == src_best.meta["sha256"]
    assert checkpoint.load(tmp_path / "b" / "checkpoints" / "last.npz").best == src_best.best


def _kill_during_best_write(
    run: Path, nth: int, *, renamed: bool = False, cfg: str = "epochs=8, optimizer__lr=0.01"
) -> subprocess.CompletedProcess[str]:
    """Train (``make_cfg(cfg)``) in a subprocess that dies (os._exit, as SIGKILL) the moment the ``nth`` write of
    best.npz has its temp file complete, before the rename (``renamed``: just after it, before last.npz)."""
    import os
    import sys

    code = f"""
import os, sys
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from helpers import make_cfg
from mlptrain.base import fs as files
from mlptrain.run.run import train
real = files.atomic_write
seen = {{"best": 0}}
def atomic_write(path, content):
    if Path(path).name == "best.npz":
        seen["best"] += 1
        if seen["best"] == {nth} and {renamed}:
            real(path, content)
            os._exit(9)
        if seen["best"] == {nth}:
            tmp = files.temp_name(Path(path))
            with open(tmp, "wb") as f:
                content(f)  # the whole temp file is there, not yet renamed
            os._exit(9)
    real(path, content)
files.atomic_write = atomic_write
import mlptrain.run.checkpoint
mlptrain.run.checkpoint.atomic_write = atomic_write
train(make_cfg({cfg}), Path({str(run)!r}))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent)])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_killed_while_writing_best_then_resumed_keeps_the_best_model(tmp_path: Path) -> None:
    """best.npz is written before last.npz, whose meta refers to it: a kill between the two (here in the
    middle of best's write) never leaves a best older than last says; the resume writes it again."""
    straight = tmp_path / "straight"
    train(make_cfg(epochs=8, optimizer__lr=0.01), straight)
    accs = [r["val/acc"] for r in read_metrics(straight / "metrics.jsonl") if r["kind"] == "epoch"]
    improved = [i for i, a in enumerate(accs) if a > max(accs[:i], default=-1)]
    assert len(improved) >= 4, accs  # best.npz is written at least 4 times: the 3rd write is not the last
    run = tmp_path / "run"
    proc = _kill_during_best_write(run, nth=3)
    assert proc.returncode == 9, proc.stdout + proc.stderr
    assert list((run / "checkpoints").glob("best.npz.*.tmp")), "killed with best's temp file in place"
    last = checkpoint.load(run / "checkpoints" / "last.npz")
    on_disk = checkpoint.load(run / "checkpoints" / "best.npz")
    assert last.best.step == on_disk.position.step, "last.npz refers to the best.npz that is on disk"
    train(make_cfg(epochs=8, optimizer__lr=0.01, resume="last"), run)
    assert records(run) == records(straight)
    for name in ("best", "last"):
        a, b = (checkpoint.load(d / "checkpoints" / f"{name}.npz") for d in (run, straight))
        assert a.position == b.position and a.best == b.best, name
        for key in b.arrays:
            np.testing.assert_array_equal(a.arrays[key], b.arrays[key], err_msg=f"{name}: {key}")
    assert not list((run / "checkpoints").glob("*.tmp")), "the stray temp file was removed"


def test_killed_between_best_and_the_epochs_last_then_resumed_keeps_the_best_record(tmp_path: Path) -> None:
    """checkpoint_steps=1: the epoch's last step wrote last.npz (inside the epoch), the epoch's end wrote best.npz,
    and the kill came before the epoch's own last.npz. best.npz then holds last.npz's step but not its record of
    the best; the resume evaluates that epoch again and writes best again. (It called the best lost and chose it
    again, counting patience from there: the fault campaign's stream trial 46, 2026-12-05.)"""
    cfg = {"epochs": 8, "optimizer__lr": 0.01, "checkpoint_steps": 1}
    straight = tmp_path / "straight"
    train(make_cfg(**cfg), straight)
    run = tmp_path / "run"
    # val/acc ties at epochs 6, 7 and 8: the 7th write of best.npz moves it to a later epoch of the same score,
    # and the record keeps the epoch that improved (promise 25); a best called lost would count epoch 7 instead
    proc = _kill_during_best_write(run, nth=7, renamed=True, cfg="epochs=8, optimizer__lr=0.01, checkpoint_steps=1")
    assert proc.returncode == 9, proc.stdout + proc.stderr
    last = checkpoint.load(run / "checkpoints" / "last.npz")
    on_disk = checkpoint.load(run / "checkpoints" / "best.npz")
    assert on_disk.position.step == last.position.step != last.best.step
    train(make_cfg(resume="last", **cfg), run)
    assert records(run) == records(straight)
    for name in ("best", "last"):
        a, b = (checkpoint.load(d / "checkpoints" / f"{name}.npz") for d in (run, straight))
        assert a.position == b.position and a.best == b.best, name


@pytest.mark.parametrize("max_steps", [None, 30], ids=["end-of-epoch", "inside-an-epoch"])
def test_a_run_killed_after_its_last_checkpoint_is_finished_by_a_resume(tmp_path: Path, max_steps: Any) -> None:
    """Killed after saving its final last.npz, before its summary (and, inside an epoch, before that epoch's
    record): resume=last writes what is missing instead of saying there is nothing left to do."""
    cfg = {"epochs": 2, "max_steps": max_steps}
    train(make_cfg(**cfg), tmp_path / "straight")
    run = tmp_path / "run"
    train(make_cfg(**cfg), run)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    cut = 1 if max_steps is None else 2  # the summary; inside an epoch also its epoch record, written after last
    (run / "metrics.jsonl").write_text("".join(lines[:-cut]))
    summary = train(make_cfg(resume="last", **cfg), run)
    assert records(run) == records(tmp_path / "straight")
    assert summary["steps"] == (42 if max_steps is None else 30)
    with pytest.raises(Exception, match="at or past the end of this run"):  # finished now: nothing left to do
        train(make_cfg(resume="last", **cfg), run)


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_follower_dirs_of_killed_ranks_are_removed_and_live_ones_kept(tmp_path):
    import os

    from mlptrain.run.rundir import RunDirectory, _host, follower_dir

    dead, me, host = _dead_pid(), os.getpid(), _host()
    stale = tmp_path / f"mlptrain-rank1-{host}-pid{dead}-abc123"
    (stale / "run" / "checkpoints").mkdir(parents=True)
    (stale / "run" / "checkpoints" / "last.npz").write_bytes(b"x" * 1000)
    live = tmp_path / f"mlptrain-rank2-{host}-pid{me}-def456"  # a rank still running (this process)
    live.mkdir()
    elsewhere = tmp_path / f"mlptrain-rank1-otherhost-pid{dead}-ghi789"  # a shared temp dir: another host's
    elsewhere.mkdir()
    locked = tmp_path / f"mlptrain-rank4-{host}-pid{dead}-jkl012"  # its pid reads as gone, but its run is locked
    (locked / "run").mkdir(parents=True)
    target = tmp_path / "not-a-follower"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    link = tmp_path / f"mlptrain-rank5-{host}-pid{dead}-mno345"  # a link named like a follower folder
    link.symlink_to(target, target_is_directory=True)
    other = tmp_path / f"mlptrain-rank1-{host}-pid{dead}.txt"  # a file of a similar name
    other.write_text("keep")

    with RunDirectory(locked / "run").lock():
        new = follower_dir(3, tmp_path)

    assert not stale.exists()  # the killed rank's checkpoints are gone
    assert live.is_dir() and elsewhere.is_dir() and (locked / "run").is_dir()
    assert link.is_symlink() and (target / "keep.txt").read_text() == "keep" and other.read_text() == "keep"
    assert new.is_dir() and new.parent == tmp_path and new.name.startswith(f"mlptrain-rank3-{host}-pid{me}-")
    assert follower_dir(3, tmp_path) != new  # each call a folder of its own; the live one stays
    assert new.is_dir()
    assert not locked.exists()  # once its lock is gone, the next start removes it
