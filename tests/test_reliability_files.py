"""Issue #47: nothing is written outside the run folder or over an input, and the data cache keeps its word.

A link planted in a run folder, a run folder that is a data folder or lies in the cache, a cache
entry left half-written or with swapped metadata, a FIFO or a device given as data: each is refused
with one line before anything is written, or found and rebuilt, never trained on or written through.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlptrain.data import cache
from tests.test_reliability import REPO

DATA_ROWS = 60


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_csv(path: Path, n: int = DATA_ROWS, features: int = 3, seed: int = 0) -> Path:
    x = np.random.default_rng(seed).standard_normal((n, features))
    lines = [",".join([*(f"f{j}" for j in range(features)), "label"])]
    lines += [",".join([*(repr(v) for v in row), "cat" if i % 3 else "dog"]) for i, row in enumerate(x.tolist())]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_cli(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "HYDRA_MAIN_MODULE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "mlptrain", "device=cpu", "progress=false", "model.hidden=[8]", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# --- 6. a FIFO or a device as data ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_fifo_or_a_device_as_data_is_one_line_and_the_process_exits(tmp_path: Path, kind: str) -> None:
    if kind == "fifo":
        path, what = tmp_path / "d.csv", "a FIFO"
        os.mkfifo(path)
    else:
        path, what = Path("/dev/zero"), "a character device"
    proc = run_cli("data=file", f"data.path={path}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = f"error: data.path={path} is {what}, not a regular file; set data.path to a data file"
    assert proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_cache_never_hashes_a_fifo_or_a_device(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "d.csv")
    # a reader thread on these would read forever: the hash refuses them before a byte is read
    assert cache.source_of(tmp_path / "d.csv") is None
    assert cache.source_of("/dev/zero") is None
    with pytest.raises(OSError, match="a character device, not a regular file"):
        cache.sha256_file(Path("/dev/zero"))
