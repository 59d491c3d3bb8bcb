"""Sweeps (``python -m mlptrain -m``): job folders, the summary table, and a sweep stopped and continued."""

from __future__ import annotations

import shlex
import signal
import subprocess
from pathlib import Path

import pytest
from test_cli import QUICK, output, run_cli
from test_readme import python_on_path
from test_reliability import start_cli, step_lines, wait_for

from mlptrain.cli.sweep import continue_command, job_folder
from mlptrain.run.metrics import read_metrics


def _iris_csv(path: Path, rows: int = 60) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["a,b,label"] + [f"{i % 7},{(i * 3) % 5},{'xy'[i % 2]}" for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")


def test_values_with_a_slash_or_dots_name_one_folder_inside_the_sweep(tmp_path: Path) -> None:
    """#28.8: a ``/`` nested the job folders (a summary of "0 jobs"), ``..`` put a job outside the sweep."""
    work = tmp_path / "work"
    _iris_csv(work / "data" / "a.csv")
    _iris_csv(tmp_path / "b.csv")  # reached as ../b.csv from work/
    sweep = work / "sweep"
    proc = run_cli("-m", "data=file", "data.path=data/a.csv,../b.csv", *QUICK, f"hydra.sweep.dir={sweep}", cwd=work)
    assert proc.returncode == 0, output(proc)
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == sorted(
        job_folder(f"data.path={path},data=file,device=cpu,epochs=1,model.hidden=[4],progress=False")
        for path in ("data/a.csv", "../b.csv")
    )
    assert all((job / "metrics.jsonl").is_file() for job in jobs), "each job writes in its own folder"
    assert not (tmp_path / "b.csv,data=file").exists() and not list(tmp_path.glob("*=*"))
    md = (sweep / "summary.md").read_text()
    assert md.startswith("# Sweep sweep: 2 jobs") and "data.path=data/a.csv" in md and "data.path=../b.csv" in md


def test_job_folder_is_one_safe_path_component() -> None:
    names = {o: job_folder(o) for o in ("a=x/y", "a=x%2Fy", "a=..", "a=../../etc", "a='x y'", "", "k=" + "v" * 400)}
    for name in names.values():
        assert "/" not in name and name not in (".", "..", "") and len(name.encode()) <= 255
        assert " " not in name and "'" not in name
    assert len(set(names.values())) == len(names), "two jobs never share a folder"
    assert names["a=x/y"] == "a=x%2Fy" and names["a=.."] == "a=.." and names[""] == "no-overrides"


def test_continue_command_keeps_the_sweep_and_adds_its_folder_and_resume() -> None:
    argv = ["-m", "model.hidden=[8],[16]", "resume=best", "hydra.sweep.dir=old", "data.path=my data.csv"]
    cmd = continue_command(argv, Path("/runs/sweep,1"))
    assert shlex.split(cmd) == [
        "python",
        "-m",
        "mlptrain",
        "-m",
        "model.hidden=[8],[16]",
        "data.path=my data.csv",
        "hydra.sweep.dir='/runs/sweep,1'",
        "resume=last",
    ]


def _sweep_dir_jobs(sweep: Path) -> dict[str, Path]:
    return {p.name: p for p in sweep.iterdir() if p.is_dir()}


def test_a_stopped_sweep_gets_its_summary_and_continues_every_job_in_its_folder(tmp_path: Path) -> None:
    """#28.14: an interrupted sweep never got its summary.md; re-run with resume=last it made new
    ``...,resume=last,...`` folders and every job failed; the printed command is pasted into a shell here."""
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "max_steps=20,3000",
        "seed=0,1",
        "model.hidden=[8]",
        "epochs=1000",
        "optimizer.schedule=constant",
        "device=cpu",
        "progress=false",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = start_cli(*args, cwd=tmp_path)
    long_job = sweep / job_folder(
        "device=cpu,epochs=1000,max_steps=3000,model.hidden=[8],optimizer.schedule=constant,progress=False,seed=0"
    )
    wait_for(proc, lambda: step_lines(long_job) >= 30)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    md = (sweep / "summary.md").read_text()
    assert f"Not finished: {long_job.name} (interrupted)" in md, md
    assert md.startswith("# Sweep sweep: 3 jobs")
    (line,) = [x for x in err.splitlines() if "continue every job with: " in x]
    again = line.split("continue every job with: ", 1)[1]
    assert f"`{again}`" in md
    env = python_on_path(tmp_path / "bin")  # the printed command is pasted into bash as it is
    before = _sweep_dir_jobs(sweep)
    finished = {n: (p / "metrics.jsonl").read_bytes() for n, p in before.items() if n != long_job.name}
    resumed = subprocess.run(["bash", "-c", again], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    jobs = _sweep_dir_jobs(sweep)
    assert len(jobs) == 4 and set(before) <= set(jobs), sorted(jobs)  # the fourth job had not started
    for name, text in finished.items():
        assert (sweep / name / "metrics.jsonl").read_bytes() == text, f"{name} finished already: kept as it was"
    for job in jobs.values():
        records = read_metrics(job / "metrics.jsonl")
        assert records[-1]["kind"] == "summary"
        assert records[-1]["steps"] == (3000 if "max_steps=3000" in job.name else 20)
    resumed_records = read_metrics(long_job / "metrics.jsonl")
    assert [r["kind"] for r in resumed_records].count("interrupted") == 0, "the resumed run continued its file"
    md = (sweep / "summary.md").read_text()
    assert md.startswith("# Sweep sweep: 4 jobs") and "The sweep was stopped" not in md
    assert md.count("| finished |") == 4, md


@pytest.mark.parametrize("state", ["finished", "new"])
def test_a_resumed_sweep_keeps_finished_jobs_and_starts_new_ones(tmp_path: Path, state: str) -> None:
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "seed=0,1",
        "model.hidden=[4]",
        "epochs=1",
        "device=cpu",
        "progress=false",
        f"hydra.sweep.dir={sweep}",
    ]
    if state == "finished":
        assert run_cli(*args, cwd=tmp_path).returncode == 0
    proc = run_cli(*args, "resume=last", cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    jobs = _sweep_dir_jobs(sweep)
    assert sorted(jobs) == [
        "device=cpu,epochs=1,model.hidden=[4],progress=False,seed=0",
        "device=cpu,epochs=1,model.hidden=[4],progress=False,seed=1",
    ]
    phrase = "finished already: kept as it is" if state == "finished" else "the job starts from the beginning"
    assert proc.stderr.count(phrase) == 2, proc.stderr
    assert (sweep / "summary.md").read_text().count("| finished |") == 2
