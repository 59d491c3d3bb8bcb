"""A multirun on Hydra's joblib launcher (``hydra/launcher=joblib``): jobs in parallel worker processes.

Each job must train exactly as it would alone (its own folder, config and seed), the sweep's summary must
name every job however they ended, a failed job must fail the sweep without costing the others, and a
stop request must reach the workers' runs through the sweep's process (docs/sweeps.md).
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import REPO, output, run_cli
from test_readme import python_on_path
from test_reliability import step_lines, wait_for

from mlptrain.cli.sweep import job_folder
from mlptrain.run.metrics import read_metrics

pytest.importorskip("hydra_plugins.hydra_joblib_launcher")

JOBLIB = ("hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
# Three jobs of different shapes on digits, a few steps each; [0] is refused (no layer of width 0).
SWEEP_H = ("[0]", "[16]", "[8,8]")
SWEEP = (f"model.hidden={','.join(SWEEP_H)}", "max_steps=30", "log_every=5", "device=cpu", "progress=false")


def _losses(job: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in read_metrics(job / "metrics.jsonl") if r["kind"] == "step"]


def test_parallel_jobs_train_as_they_do_one_after_the_other(tmp_path: Path) -> None:
    parallel, sequential = tmp_path / "parallel", tmp_path / "sequential"
    proc = run_cli("-m", *JOBLIB, *SWEEP, f"hydra.sweep.dir={parallel}", cwd=tmp_path)
    alone = run_cli("-m", *SWEEP, f"hydra.sweep.dir={sequential}", cwd=tmp_path)  # Hydra's basic launcher
    # The refused job fails the sweep (exit 2) under either launcher, and says why.
    for p in (proc, alone):
        assert p.returncode == 2, output(p)
        assert "model.hidden[0]=0 must be a positive layer width" in p.stderr and "Traceback" not in output(p)
    assert "Joblib.Parallel(n_jobs=2" in proc.stdout
    names = {h: job_folder(f"device=cpu,log_every=5,max_steps=30,model.hidden={h},progress=False") for h in SWEEP_H}
    for hidden in ("[16]", "[8,8]"):
        losses = _losses(parallel / names[hidden])
        assert [step for step, _ in losses] == list(range(30)), losses  # every step's loss
        # Bit for bit the job run in this process, one after the other: a job that got another's config, seed
        # or folder would differ.
        assert losses == _losses(sequential / names[hidden]), hidden
    assert _losses(parallel / names["[16]"]) != _losses(parallel / names["[8,8]"])
    for sweep in (parallel, sequential):
        with open(sweep / "summary.csv", newline="") as f:
            rows = {r["job"]: r for r in csv.DictReader(f)}
        assert set(rows) == set(names.values()), rows
        assert rows[names["[0]"]]["status"] == "failed" and rows[names["[16]"]]["status"] == "finished"
        assert rows[names["[8,8]"]]["status"] == "finished"
        md = (sweep / "summary.md").read_text()
        assert md.startswith(f"# Sweep {sweep.name}: 3 jobs") and "**1 failed:**" in md
        assert f"- {names['[0]']}: invalid configuration: model.hidden[0]=0 must be a positive layer width" in md


def _start_in_own_group(*args: str, cwd: Path) -> subprocess.Popen[str]:
    """``python -m mlptrain *args`` as a terminal's foreground job: the leader of a process group of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "HYDRA_MAIN_MODULE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "mlptrain", *args]
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


@pytest.mark.parametrize("how", ["kill", "ctrl-c"])
def test_a_stopped_parallel_sweep_saves_its_running_jobs_and_continues(tmp_path: Path, how: str) -> None:
    """``kill``: SIGTERM to the sweep's process alone, which passes it on to its workers. ``ctrl-c``: SIGINT to the
    whole process group, as a terminal sends it (the workers left the group, and get the signal the sweep's process
    passes on). Either way each running job saves ``last``, the job not started is left out, and (``kill``) the
    printed command continues every job in its folder."""
    sweep = tmp_path / "sweep"
    args = ["-m", *JOBLIB, "seed=0,1,2", "model.hidden=[8]", "max_steps=2000", "epochs=1000", "device=cpu"]
    proc = _start_in_own_group(*args, "progress=false", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    name = "device=cpu,epochs=1000,max_steps=2000,model.hidden=[8],progress=False,seed={}"
    jobs = [sweep / job_folder(name.format(s)) for s in range(3)]
    wait_for(proc, lambda: all(step_lines(job) >= 20 for job in jobs[:2]))
    if how == "kill":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == (143 if how == "kill" else 130), out + err
    assert "Traceback" not in out + err
    for job in jobs[:2]:  # each running job saved its last checkpoint and recorded the stop
        assert read_metrics(job / "metrics.jsonl")[-1]["kind"] == "interrupted"
        assert (job / "checkpoints" / "last.npz").is_file()
    assert not jobs[2].exists(), "the job not started has no folder"
    md = (sweep / "summary.md").read_text()
    assert "**The sweep was stopped.**" in md and md.count("(interrupted)") == 2, md
    (line,) = [x for x in err.splitlines() if "continue every job with: " in x]
    again = line.split("continue every job with: ", 1)[1]
    assert "hydra/launcher=joblib" in again and again.endswith("resume=last")
    if how == "ctrl-c":
        return
    env = python_on_path(tmp_path / "bin")
    resumed = subprocess.run(["bash", "-c", again], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    for job in jobs:
        records = read_metrics(job / "metrics.jsonl")
        assert records[-1]["kind"] == "summary" and records[-1]["steps"] == 2000
    assert (sweep / "summary.md").read_text().count("| finished |") == 3


def test_a_dead_worker_ends_the_sweep_with_one_error_and_other_errors_pass() -> None:
    """A worker killed by the kernel (out of memory) breaks joblib's pool: one error naming how it died, which the CLI
    turns into the stopped sweep's summary and continue command (exit 2); a bug's exception is not renamed."""
    from joblib.externals.loky.process_executor import TerminatedWorkerError

    from mlptrain.base.errors import MlptrainError
    from mlptrain.cli import parallel

    parallel.reset()
    with pytest.raises(MlptrainError, match=r"a worker process of the sweep died .*SIGKILL\(-9\)") as info:
        with parallel.sweep_ends_when_stopped():
            raise TerminatedWorkerError("A worker process was unexpectedly terminated.\nexit codes {SIGKILL(-9)}")
    assert "\n" not in str(info.value)
    with pytest.raises(ZeroDivisionError), parallel.sweep_ends_when_stopped():
        raise ZeroDivisionError
