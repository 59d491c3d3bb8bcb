"""Round four of the fault cases (issue #47) on checkpoints, signals, the loop, precision and config bounds.

Each test fails on the code before its fix; docs/reliability.md lists them.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg
from test_checkpoint import _arrays, _meta
from test_follow import _shown
from test_reliability import REPO, start_cli, step_lines, wait_for

from mlptrain.base.errors import ConfigError, NonFiniteError
from mlptrain.config.schema import DatasetName, Logger, Task
from mlptrain.run import checkpoint, saving
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train
from mlptrain.run.saving import Writer
from mlptrain.step.trainer import Trainer

# ------------------------------------------------------------------ 1. at most one checkpoint write pending


def test_the_writer_holds_at_most_one_pending_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save waits for the one before: memory holds one checkpoint's copies, and the one before is on disk."""
    real_save = checkpoint.save
    release = threading.Event()
    started: list[int] = []

    def slow_save(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        started.append(meta["position"]["step"])
        release.wait(5)
        real_save(path, arrays, meta)

    monkeypatch.setattr(saving.checkpoint, "save", slow_save)
    writer = Writer()
    path = tmp_path / "last.npz"
    writer.submit(path, _arrays(), _meta(step=1))
    assert writer.pending == 1
    second = threading.Thread(target=writer.submit, args=(path, _arrays(), _meta(step=2)))
    second.start()
    time.sleep(0.3)
    assert second.is_alive() and started == [1], "the second save must wait while the first is being written"
    release.set()
    second.join(5)
    assert not second.is_alive() and writer.pending == 1
    assert checkpoint.load(path).position.step >= 1  # the first is on disk before the second is queued
    for step in range(3, 8):
        writer.submit(path, _arrays(), _meta(step=step))
        assert writer.pending == 1
    writer.close()
    assert checkpoint.load(path).position.step == 7 and started == list(range(1, 8))


def _steps_done(run: Path) -> int:
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "step"]
    return max(steps) + 1 if steps else 0


def test_sigkill_with_checkpoint_steps_1_loses_at_most_two_steps(tmp_path: Path) -> None:
    """Writes slower than steps (a 1024-1024 Adam model, one step of 8 rows): a queue of them lost 10 to 43 steps."""
    rng = random.Random(0)
    args = ["model.hidden=[1024,1024]", "optimizer=adam", "data.batch_size=8", "checkpoint_steps=1", "log_every=1"]
    for attempt in range(3):
        run = tmp_path / f"run{attempt}"
        proc = start_cli("epochs=100000", "progress=false", "device=cpu", *args, f"hydra.run.dir={run}", cwd=tmp_path)
        last = run / "checkpoints" / "last.npz"
        wait_for(proc, lambda r=run, f=last: f.is_file() and step_lines(r) >= 5, timeout=120)
        time.sleep(rng.uniform(0.0, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        done, saved = _steps_done(run), checkpoint.load(last).position.step
        assert 0 <= done - saved <= 2, f"kill {attempt}: {done} steps done, last.npz at step {saved}"


# ------------------------------------------------------------------ 7, 8. bounds of seeds and sizes


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"seed": 2**64}, "seed=18446744073709551616 must be an integer in [0, 2**32)"),
        ({"data__split_seed": 2**32}, "data.split_seed=4294967296 must be an integer in [0, 2**32)"),
        ({"precision__name": "fp8", "precision__margin": 100}, "precision.margin=100 must be in [0, 8]"),
        (
            {"precision__name": "fp8", "precision__amax_history": 10**9},
            "precision.amax_history=1000000000 must be in [1, 1024] steps",
        ),
        ({"log_every": 10**9}, "log_every=1000000000 must be in [1, 1000000]"),
    ],
)
def test_seeds_and_sizes_out_of_bounds_are_refused_in_one_line(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    """seed=2**64 was a TypeError traceback on resume; margin=100 trained to 19 %; amax_history=1e9 took 23 GB."""
    with pytest.raises(ConfigError) as err:
        train(make_cfg(**overrides), tmp_path / "run")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists(), "a refused run writes nothing"


def test_the_cli_refuses_seed_2_64_in_one_line(tmp_path: Path) -> None:
    proc = start_cli(
        "seed=18446744073709551616", "progress=false", "device=cpu", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        "error: invalid configuration: seed=18446744073709551616 must be an integer in [0, 2**32)"
    ]


# ------------------------------------------------------------------ 2. a stop swallowed by a log call

# The CLI, with a log handler on mlptrain's logger that sends this process SIGINT in its first record while the run
# is set up (the stop request installed, not yet deferred) and swallows what is raised in its emit, as tqdm's
# logging redirect does when the Interrupted lands inside its lock's creation and its finally raises AttributeError.
SWALLOWING_RUN = """
import logging, os, signal, sys
from mlptrain.cli.main import main
from mlptrain.base.stopping import StopRequest

class Swallowing(logging.Handler):
    fired = False
    def emit(self, record):
        stop = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
        if Swallowing.fired or not isinstance(stop, StopRequest) or stop.deferred:
            return
        Swallowing.fired = True
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs here, between two bytecodes
                pass
        except BaseException:
            sys.stderr.write("swallowed\\n")

logging.getLogger("mlptrain").addHandler(Swallowing())
sys.argv = ["mlptrain", *sys.argv[1:]]
main()
"""


def test_a_stop_swallowed_inside_a_log_call_still_stops_the_run(tmp_path: Path) -> None:
    """It printed "--- Logging error --- ... stopped by SIGINT before training started", trained on and exited 0."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "HYDRA_MAIN_MODULE")}
    env["PYTHONPATH"] = str(REPO)
    args = ["model.hidden=[8]", "epochs=2", "progress=false", "device=cpu", f"hydra.run.dir={run}"]
    proc = subprocess.run(
        [sys.executable, "-c", SWALLOWING_RUN, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[")]
    assert lines == ["swallowed", "mlptrain: stopped by SIGINT before training started; nothing was written"], (
        proc.stderr
    )
    assert proc.returncode == 130 and "mlptrain:" not in proc.stdout
    assert not run.exists() or not any(run.iterdir()), "nothing was written"


# ------------------------------------------------------------------ 3. skipped steps at a checkpoint


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fp8_with_a_diverging_lr_stops_and_saves_no_checkpoint(tmp_path: Path) -> None:
    """precision=fp8 optimizer.lr=1e10 skipped 38 of 42 steps, exited 0 with "loss nan" and saved checkpoints."""
    run = tmp_path / "run"
    with pytest.raises(NonFiniteError) as err:
        train(make_cfg(precision__name="fp8", optimizer__lr=1e10, epochs=2, log_every=1), run)
    msg = str(err.value)
    assert msg.startswith("non-finite values at step 20 (epoch 1, fp8): the training loss is nan and the last "), msg
    assert "steps were skipped (inf/NaN gradients), so no checkpoint is written; lower optimizer.lr" in msg
    assert not (run / "checkpoints" / "last.npz").exists() and not (run / "checkpoints" / "best.npz").exists()
    assert not any(r["kind"] == "summary" for r in read_metrics(run / "metrics.jsonl"))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fp8_diverging_after_a_checkpoint_keeps_that_checkpoint(tmp_path: Path) -> None:
    """The state saved before the divergence stays the last checkpoint, and the message names it."""
    run = tmp_path / "run"
    original = Trainer.step

    def step(self: Trainer, x: Any, y: Any) -> Any:
        if self.step_count == 25:  # blown up in epoch 2: its forward overflows from here on
            self.model.params[0].value *= np.float32(1e30)
        return original(self, x, y)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "step", step)
        with pytest.raises(NonFiniteError) as err:
            train(make_cfg(precision__name="fp8", epochs=3, log_every=1), run)
    pattern = r"^non-finite values at step 41 \(epoch 2, fp8\): the training loss is nan and the last \d+ steps were"
    assert re.match(pattern, str(err.value)), err.value
    last = run / "checkpoints" / "last.npz"
    assert f"the last checkpoint, {last} (step 21), is intact" in str(err.value)
    ckpt = checkpoint.load(last)
    assert ckpt.position.step == 21 and all(np.isfinite(a).all() for a in ckpt.arrays.values())


# ------------------------------------------------------------------ 9. epochs counted alike, from 1


def test_the_interrupt_and_the_resume_name_the_same_epoch(tmp_path: Path) -> None:
    """The interrupt said epoch 16 and the resume "epoch 15, batch 6"."""
    from mlptrain.run.checkpoint import Position

    assert Position(15, 6, 321).describe() == "epoch 16, after its batch 6"
    assert Position(16, 0, 336).describe() == "after epoch 16"
    assert Position().describe() == "at the start"
    run = tmp_path / "run"
    cpu = ["model.hidden=[32]", "progress=false", "device=cpu", f"hydra.run.dir={run}"]
    proc = start_cli(*cpu, "epochs=100000", cwd=tmp_path)
    wait_for(proc, lambda: step_lines(run) >= 30)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    stop = read_metrics(run / "metrics.jsonl")[-1]
    where = checkpoint.load(run / "checkpoints" / "last.npz").position.describe()
    assert f"interrupted at step {stop['step']} ({where}, SIGINT)" in err, err
    proc = start_cli(*cpu, f"max_steps={stop['step'] + 1}", "resume=last", cwd=tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"at step {stop['step']} ({where})" in err, err


# ------------------------------------------------------------------ 10. a loss beyond float32 names the targets


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the loss weight scale * scale itself
def test_targets_whose_squares_overflow_float32_are_named(tmp_path: Path) -> None:
    """Regression targets near 1e25 said "lower optimizer.lr" where the loss overflows float32 whatever the rate."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 3))
    y = 1e25 * (1 + x[:, 0])
    path = tmp_path / "big.csv"
    path.write_text("a,b,c,y\n" + "".join(f"{r[0]},{r[1]},{r[2]},{t}\n" for r, t in zip(x, y, strict=True)))
    cfg = make_cfg(data__name=DatasetName.file, data__path=str(path), data__target="y", data__task=Task.regression)
    cfg.model.loss = "mse"
    with pytest.raises(NonFiniteError) as err:
        train(cfg, tmp_path / "run")
    msg = str(err.value)
    assert msg.startswith("non-finite values at step 0 (epoch 1, fp32): the training loss is inf; it overflowed "), msg
    assert re.search(r"because of the targets' scale: they reach \|y\| = [1-4]\.\d+e\+25, whose square", msg), msg
    assert "normalise the targets" in msg and "optimizer.lr" not in msg


# ------------------------------------------------------------------ 4. TensorBoard: one file, no step twice


def test_tensorboard_writes_one_event_file_for_a_run(tmp_path: Path) -> None:
    """It wrote one event file per checkpoint (31 for 30 epochs): the writer was reopened to flush."""
    pytest.importorskip("tensorboardX")
    run = tmp_path / "run"
    train(make_cfg(epochs=5, log_every=7, checkpoint_steps=10, logger=Logger.tensorboard), run)
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "step"]
    assert _shown(run / "tensorboard")["train/loss"] == steps, "every step on disk, once"


def test_tensorboard_after_a_kill_during_the_first_checkpoint_shows_each_step_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed while writing its first checkpoint starts again from step 0 on resume=last: its first steps
    were shown twice (no purge_step, since it resumed from no checkpoint)."""
    pytest.importorskip("tensorboardX")
    run = tmp_path / "run"
    real_save = checkpoint.save

    def killed(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        raise RuntimeError("killed while writing the first checkpoint")

    monkeypatch.setattr(saving.checkpoint, "save", killed)
    with pytest.raises(RuntimeError, match="killed"):
        train(make_cfg(epochs=2, log_every=1, checkpoint_steps=5, logger=Logger.tensorboard), run)
    killed_steps = _shown(run / "tensorboard")["train/loss"]
    assert not (run / "checkpoints" / "last.npz").exists() and killed_steps[:6] == [0, 1, 2, 3, 4, 5]
    monkeypatch.setattr(saving.checkpoint, "save", real_save)
    train(make_cfg(epochs=2, log_every=1, checkpoint_steps=5, logger=Logger.tensorboard, resume="last"), run)
    shown = _shown(run / "tensorboard")
    assert shown["train/loss"] == list(range(42)), "each step once"
    assert shown["epoch/val/acc"] == [21, 42]


# ------------------------------------------------------------------ 5. a stop inside a console log line

# The CLI where signals land inside tqdm's console handler (logging_redirect_tqdm), in its lock, as a Ctrl-C
# pressed while a line is written does: `when` is the start of the line, `first_at` the step of a first SIGINT
# sent from the step (-1: none), `signals` how many are sent inside the line.
IN_THE_LINE_RUN = """
import os, signal, sys
import tqdm.std
from mlptrain.cli.main import main
from mlptrain.step.trainer import Trainer

when, first_at, signals = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fired = []
get_lock = tqdm.std.tqdm.get_lock.__func__

def in_the_lock(cls):
    if fired == ["line"]:
        fired.append("sent")
        for _ in range(signals):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs here, between two bytecodes
                pass
    return get_lock(cls)

tqdm.std.tqdm.get_lock = classmethod(in_the_lock)
emit = tqdm.std.tqdm.write.__func__

def write(cls, s, *args, **kwargs):
    if not fired and when in s:
        fired.append("line")
    return emit(cls, s, *args, **kwargs)

tqdm.std.tqdm.write = classmethod(write)
step = Trainer.step

def stepped(self, x, y):
    if self.step_count == first_at:
        os.kill(os.getpid(), signal.SIGINT)
    return step(self, x, y)

Trainer.step = stepped
sys.argv = ["mlptrain", *sys.argv[4:]]
main()
"""


@pytest.mark.parametrize(
    ("when", "first_at", "signals", "args", "stop"),
    [  # a double Ctrl-C with checkpoint_steps=1; two at an fp8 run's end (its result line, the run complete)
        (
            "interrupted at step",
            30,
            1,
            ["checkpoint_steps=1", "epochs=100000"],
            "mlptrain: stopped at once by a second SIGINT",
        ),
        (
            "mlptrain: digits",
            -1,
            2,
            ["precision=fp8", "epochs=2"],
            "error: stopped by SIGINT after training; the run in {run} is complete as written",
        ),
    ],
    ids=["double-ctrl-c", "fp8-end"],
)
def test_a_stop_inside_a_log_line_stops_with_one_line(
    tmp_path: Path, when: str, first_at: int, signals: int, args: list[str], stop: str
) -> None:
    """The double Ctrl-C printed "--- Logging error ---" with a traceback; at the fp8 run's end, "before training;
    nothing was written" (the run was complete)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "HYDRA_MAIN_MODULE")}
    env["PYTHONPATH"] = str(REPO)
    cli = ["model.hidden=[32]", "progress=false", "device=cpu", f"hydra.run.dir={tmp_path / 'run'}", *args]
    proc = subprocess.run(
        [sys.executable, "-c", IN_THE_LINE_RUN, when, str(first_at), str(signals), *cli],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[")]
    assert lines == [stop.format(run=tmp_path / "run")], proc.stderr
    assert proc.returncode == 130


def test_a_stop_after_a_run_does_not_say_nothing_was_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C between a finished run and the process's end said "before training; nothing was written"."""
    from mlptrain.cli import main as cli

    written: list[bytes] = []
    monkeypatch.setattr(cli.os, "write", lambda fd, data: written.append(data))
    monkeypatch.setattr(cli.os, "_exit", lambda status: (_ for _ in ()).throw(SystemExit(status)))
    monkeypatch.setattr(cli, "_accepted_runs", [Path("run")])
    with pytest.raises(SystemExit) as exit_:
        cli._exit_now(signal.SIGINT, None)
    assert exit_.value.code == 130
    assert written == [b"error: stopped by SIGINT after training; the run in run is complete as written\n"]
