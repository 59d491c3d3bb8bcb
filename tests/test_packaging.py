"""The wheel that carries conf/ and the data, an installed wheel that finds its configs, and ``make run``'s choice
of the CUDA extra."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_cli import REPO, output, run_cli

# --- conf/ travels in the wheel as mlptrain/conf ---------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("hatchling", reason="building the wheel without network needs hatchling (dev extra)")
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("mlptrain-0.1.0-*.whl")
    return path


def test_wheel_contains_configs_and_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "mlptrain/conf/config.yaml" in names
    group_files = sorted((REPO / "conf").glob("*/*.yaml"))
    assert group_files
    for path in group_files:
        assert f"mlptrain/conf/{path.relative_to(REPO / 'conf').as_posix()}" in names
    assert "mlptrain/cli/main.py" in names and "mlptrain/__main__.py" in names
    assert not any(n.startswith("conf/") for n in names), "conf/ must not be a top-level package"
    assert "mlptrain/data/digits.csv.gz" in names  # the bundled default dataset
    assert "mlptrain/conf/hydra/job_logging/mlptrain.yaml" in names
    # a wheel user draws a sweep and runs the benchmark with python -m; scripts/ stays in the repository
    for module in (
        "tools/compare/__main__.py",
        "tools/compare/report.py",
        "cli/plot.py",
        "tools/bench/__main__.py",
        "tools/bench/medians.py",
    ):
        assert f"mlptrain/{module}" in names
    assert not any(n.startswith("mlptrain/scripts/") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "mlptrain = mlptrain.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_wheel_finds_its_configs(wheel: Path, tmp_path: Path) -> None:
    # Install without dependencies (they come from this environment) into a folder of its own,
    # and run from an unrelated directory with only that folder on the path: no source checkout.
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    proc = run_cli("--info", "searchpath", cwd=cwd, pythonpath=site)
    assert proc.returncode == 0, output(proc)
    assert f"file://{site / 'mlptrain' / 'conf'}" in proc.stdout
    proc = run_cli("--cfg", "job", "data=mnist1d", "optimizer=adamw", cwd=cwd, pythonpath=site)
    assert proc.returncode == 0, output(proc)
    assert "name: mnist1d" in proc.stdout and "name: adamw" in proc.stdout
    proc = run_cli("optimizer.lr=0", f"hydra.run.dir={tmp_path}/run", cwd=cwd, pythonpath=site)
    assert proc.returncode == 2 and "optimizer.lr" in proc.stderr, output(proc)
    if importlib.util.find_spec("matplotlib") is not None:  # the shipped scripts draw a run from the wheel
        proc = run_cli(
            "epochs=2", "device=cpu", "model.hidden=[8]", f"hydra.run.dir={tmp_path}/run2", cwd=cwd, pythonpath=site
        )
        assert proc.returncode == 0, output(proc)
        env = {**os.environ, "PYTHONPATH": str(site)}
        for module in ("mlptrain.plot",):
            drawn = subprocess.run(
                [sys.executable, "-m", module, str(tmp_path / "run2"), "--out", str(tmp_path / f"{module}.png")],
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert drawn.returncode == 0, drawn.stderr
            assert (tmp_path / f"{module}.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("driver", "extra"), [("580.159.04", "[cu13]"), ("535.104.05", "[cu12]"), (None, "")])
def test_make_run_installs_the_cuda_extra_that_the_driver_supports(
    tmp_path: Path, driver: str | None, extra: str
) -> None:
    """``make run`` asks nvidia-smi for the driver version (a stand-in here) and installs cu13, cu12 or neither."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if driver is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\necho {driver}\n")
        fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"}
    venv = tmp_path / "venv"  # a venv that does not exist: make -n only prints what it would do
    proc = subprocess.run(
        ["make", "-n", "-C", str(REPO), "run", f"VENV={venv}"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert f"pip install -e '.{extra}'" in proc.stdout, proc.stdout
    assert "pip install -e '.[dev]'" not in proc.stdout, "running needs no developer tools"
