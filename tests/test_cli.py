"""``python -m mlptrain`` end to end in subprocesses (the wheel that carries conf/: tests/test_packaging.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, cwd: Path, pythonpath: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``python -m mlptrain *args`` in ``cwd`` with ``pythonpath`` first on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "HYDRA_MAIN_MODULE")}
    env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "mlptrain", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# A run of a second or less on the CPU.
QUICK = ("epochs=1", "model.hidden=[4]", "device=cpu", "progress=false")


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("foo=1", "foo is not a setting; python -m mlptrain --help lists the settings"),
        ("optimizer.lr=abc", "could not be converted to Float"),
        ("model.activation=tanh", "model.activation='tanh' is unknown; expected one of relu, gelu, none"),
        ("execution=bogus", "Could not find 'execution/bogus'"),
    ],
)
def test_bad_override_fails_without_traceback(tmp_path: Path, override: str, message: str) -> None:
    proc = run_cli(override, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 2, output(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in output(proc) and "HYDRA_FULL_ERROR" not in output(proc)
    assert not (tmp_path / "run").exists(), "a composition error must not create a run directory"


def test_unknown_dataset_lists_the_options(tmp_path: Path) -> None:
    proc = run_cli("data=bogus", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 2
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "Could not find 'data/bogus'" in line and "Available options in 'data'" in line
    for name in ("digits", "mnist1d", "mnist", "fashion_mnist", "synthetic"):
        assert name in line.split("Available options in 'data'")[1]
    assert "Traceback" not in output(proc)


def test_invalid_value_exits_2_with_one_error_line(tmp_path: Path) -> None:
    proc = run_cli("optimizer.lr=-1", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 2, output(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    assert "optimizer.lr=-1.0 must be positive" in errors[0]
    assert "Traceback" not in output(proc)
    # A refused run leaves nothing behind: the run directory it would have created does not exist.
    assert not (tmp_path / "run").exists()


def test_multirun_reports_every_failed_job_and_exits_2(tmp_path: Path) -> None:
    proc = run_cli("-m", "execution=fused,naive", "optimizer.lr=-1", f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path)
    assert proc.returncode == 2, output(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert any("execution=fused" in e and "optimizer.lr" in e for e in errors), proc.stderr
    assert any("execution=naive" in e and "optimizer.lr" in e for e in errors), proc.stderr
    assert "Traceback" not in output(proc)
    # One job directory per override set (hydra.sweep.subdir is the override dirname).
    assert (tmp_path / "sweep" / "execution=naive,optimizer.lr=-1").is_dir()


def test_cfg_job_prints_the_composed_config(tmp_path: Path) -> None:
    proc = run_cli("--cfg", "job", "model=deep", "execution=naive", cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    assert "mode: naive" in proc.stdout
    assert "- 256" in proc.stdout


def test_one_epoch_writes_metrics(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli("data=digits", "epochs=1", "progress=false", "device=cpu", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    assert "Traceback" not in output(proc)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert lines, "metrics.jsonl is empty"
    records = [json.loads(line) for line in lines]
    assert all(isinstance(r, dict) for r in records)
    assert not list(tmp_path.glob("outputs")), "the run must go to hydra.run.dir, not ./outputs"


def test_error_during_training_exits_2_without_traceback(tmp_path: Path) -> None:
    # digits has 64 features; a first layer of 3 inputs must be refused with a MlptrainError.
    proc = run_cli(
        "model.in_features=3", "epochs=1", "progress=false", "device=cpu", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path
    )
    assert proc.returncode == 2, output(proc)
    assert "error: " in proc.stderr
    assert "in_features" in proc.stderr
    assert "Traceback" not in output(proc)


def test_gpu_request_without_gpu_exits_2(tmp_path: Path) -> None:
    from mlptrain.base.backend import probe_gpu

    if probe_gpu()[0]:
        pytest.skip("this machine has a usable GPU")
    proc = run_cli("device=gpu", "epochs=1", "progress=false", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 2, output(proc)
    assert "device=cpu" in proc.stderr
    assert "Traceback" not in output(proc)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+optimizer.lrr=0.1", "optimizer.lrr is not a setting; did you mean optimizer.lr=0.1?"),
        ("optimizer.lrr=0.1", "error: optimizer.lrr is not a setting; did you mean optimizer.lr=0.1?"),
        ("optimizer.learning_rate=0.1", "error: optimizer.learning_rate is not a setting; use optimizer.lr=0.1"),
        ("model.hidden_layers=[512, 512]", "error: model.hidden_layers is not a setting; use 'model.hidden=[512,512]'"),
        ("n_epochs=3", "error: n_epochs is not a setting; use epochs=3"),
        (
            "data.features=1024",
            "data.features=1024 is not used with data=digits: it applies to data=synthetic (a count) and data=file "
            "(a list of columns)",
        ),
    ],
)
def test_an_ignored_or_unknown_setting_is_one_line_and_exit_2(tmp_path: Path, override: str, message: str) -> None:
    proc = run_cli(override, "device=cpu", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 2, output(proc)
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    assert line.startswith("error: ") and message in line
    assert "+" not in line.split(" is not a setting")[0] + line.split("; ")[-1], "no advice to add the key with +"
    assert not (tmp_path / "run").exists()


def test_a_suggested_override_runs_when_pasted_into_a_shell(tmp_path: Path) -> None:
    """#27.6: a suggestion printed ``model.hidden=[512, 512]``, which Hydra's parser cannot read."""
    proc = run_cli("model.hidden_layers=[16, 8]", "epochs=1", "device=cpu", cwd=tmp_path)
    fix = proc.stderr.split("; use ", 1)[1].strip()
    assert fix == "'model.hidden=[16,8]'"
    import shlex

    pasted = run_cli(
        *shlex.split(fix), "epochs=1", "device=cpu", "progress=false", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path
    )
    assert pasted.returncode == 0, output(pasted)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["config"]["model"]["hidden"] == [16, 8]


def test_a_sweeper_that_is_not_installed_names_the_extra(tmp_path: Path) -> None:
    """#27.6: ``hydra/sweeper=optuna`` without the extra said Hydra's "Could not find" alone. The plugin is
    taken out of Hydra's config store here, as on a machine without ``mlptrain[optuna]``."""
    code = (
        "import sys; from hydra.core.plugins import Plugins; from hydra.core.config_store import ConfigStore; "
        "Plugins.instance(); ConfigStore.instance().repo['hydra']['sweeper'].pop('optuna.yaml', None); "
        "sys.argv = ['mlptrain', '-m', 'hydra/sweeper=optuna', 'epochs=1']; from mlptrain.cli.main import main; main()"
    )
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 2, output(proc)
    (line,) = proc.stderr.splitlines()
    assert "Could not find 'hydra/sweeper/optuna'" in line and line.endswith("pip install -e '.[optuna]'")


def test_an_optuna_sweep_prints_no_alembic_plugin_lines(tmp_path: Path) -> None:
    """#27.6: a sweep printed seven ``[HYDRA] setup plugin alembic...`` lines; Hydra's own lines stay."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    proc = run_cli(
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=1",
        *QUICK,
        f"hydra.sweep.dir={tmp_path}/sweep",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, output(proc)
    assert "alembic" not in output(proc)
    assert "[HYDRA] Launching 1 jobs locally" in proc.stdout and "[HYDRA] Best value" in proc.stdout


def test_version_is_mlptrains_own(tmp_path: Path) -> None:
    proc = run_cli("--version", cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    assert proc.stdout.startswith("mlptrain 0.1.0 (Python ") and "NumPy" in proc.stdout and "Hydra" in proc.stdout


FULL_DISK = """
import errno, pathlib, sys
import mlptrain.cli.main as cli
real_write, real_mkdir, calls = cli.atomic_write, pathlib.Path.mkdir, []
def write(path, text):  # the disk fills up under the second of Hydra's files
    calls.append(path)
    if len(calls) == 2:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    real_write(path, text)
def mkdir(self, *args, **kwargs):  # a folder that root may write too would not stop this test's root
    if self.name == ".hydra":
        raise PermissionError(errno.EACCES, "Permission denied", str(self))
    real_mkdir(self, *args, **kwargs)
if sys.argv[1] == "full":
    cli.atomic_write = write
else:
    pathlib.Path.mkdir = mkdir
sys.argv = ["mlptrain", *sys.argv[2:]]
cli.main()
"""


@pytest.mark.parametrize("problem", ["full", "read-only"])
def test_a_full_or_read_only_run_folder_after_acceptance_is_one_line(tmp_path: Path, problem: str) -> None:
    """#28.11: an OSError traceback in cli._accepted, and an empty .hydra/ left on a full disk."""
    run = tmp_path / "run"
    if problem == "read-only":
        run.mkdir()  # the user's folder: it stays, as it was
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK, problem, *QUICK, f"hydra.run.dir={run}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, output(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    reason = "No space left on device" if problem == "full" else "Permission denied"
    assert len(errors) == 1 and f"cannot write the run's files in {run}" in errors[0] and reason in errors[0]
    assert "Traceback" not in output(proc)
    assert (run.is_dir() and not any(run.iterdir())) if problem == "read-only" else not run.exists()


def _on_a_terminal(*args: str, cwd: Path) -> str:
    """What a terminal shows of ``python -m mlptrain *args``: stdout and stderr on one pseudo-terminal."""
    import pty

    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = str(REPO)
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlptrain", *args],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
    )
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert proc.wait(timeout=300) == 0, shown.decode()
    return shown.decode()


def test_the_summary_line_shows_once_on_a_terminal(tmp_path: Path) -> None:
    """#27.7: the log handler and the print both showed it."""
    shown = _on_a_terminal(*QUICK, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert shown.count("mlptrain: digits 64-4-10") == 1, shown
    assert "mlptrain: digits 64-4-10" in (tmp_path / "run" / "mlptrain.log").read_text(), "the log file keeps it"
    piped = run_cli(*QUICK, f"hydra.run.dir={tmp_path}/run2", cwd=tmp_path)  # off a terminal: both streams hold it
    assert piped.stdout.count("mlptrain: digits") == 1 and piped.stderr.count("mlptrain: digits") == 1


def test_run_json_holds_the_class_names(tmp_path: Path) -> None:
    """#27.7: docs/data.md says that run.json carries the class names; it did not."""
    rows = ["x1,x2,species"] + [f"{i % 5},{i % 3},{['dog', 'bird', 'cat'][i % 3]}" for i in range(60)]
    (tmp_path / "pets.csv").write_text("\n".join(rows) + "\n")
    proc = run_cli("data=file", "data.path=pets.csv", "data.target=species", *QUICK, "hydra.run.dir=run", cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    dataset = json.loads((tmp_path / "run" / "run.json").read_text())["dataset"]
    assert dataset["class_names"] == ["bird", "cat", "dog"] and dataset["feature_names"] == ["x1", "x2"]
    assert dataset["task"] == "classification"
    # .hydra/config.yaml holds the run's values: data=file's model.loss and early_stopping.metric resolved
    saved = (tmp_path / "run" / ".hydra" / "config.yaml").read_text()
    assert "${" not in saved and "  loss: cross_entropy\n" in saved and "  metric: val/loss\n" in saved


def test_a_python_without_hydra_gets_one_line_with_the_fix(tmp_path: Path) -> None:
    """#27.7: the README's bare ``python -m mlptrain`` outside the .venv gave a traceback about hydra. ``-S``
    leaves out site-packages: a Python with mlptrain on its path and none of its dependencies."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "mlptrain", "epochs=1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, output(proc)
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: mlptrain needs hydra-core, which ") and "source .venv/bin/activate" in line
    assert "Traceback" not in output(proc)
