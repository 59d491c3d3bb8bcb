"""Every numbered example in examples/ runs to its end on the CPU and prints its closing line.

The examples assert their own results (fused against float64 references, mlptrain's step against the
hand-written one, FusedMLP against nn.Sequential): a wrong engine makes them exit non-zero here.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NUMBERED = sorted(EXAMPLES.glob("[0-9][0-9]_*.py"))
# What each example needs beyond mlptrain's core dependencies, and whether it takes --device.
NEEDS = {"05_sklearn_estimator.py": "sklearn", "06_torch_fusedmlp.py": "torch"}
TAKES_DEVICE = {"01_one_fused_layer.py", "02_backward_drelu_bgrad.py", "03_two_layer_step_by_hand.py"}


def test_the_examples_are_numbered_from_01_without_gaps() -> None:
    assert [p.name[:2] for p in NUMBERED] == [f"{i:02d}" for i in range(1, len(NUMBERED) + 1)]
    assert len(NUMBERED) >= 5


@pytest.mark.parametrize("path", NUMBERED, ids=lambda p: p.stem)
def test_example_runs_on_the_cpu(path: Path, tmp_path: Path) -> None:
    need = NEEDS.get(path.name)
    if need and importlib.util.find_spec(need) is None:
        pytest.skip(f"{path.name} needs {need}")
    args = [sys.executable, str(path)]
    if path.name in TAKES_DEVICE or path.name == "04_train_from_python.py":
        args += ["--device", "cpu"]
    if path.name == "04_train_from_python.py":
        args += ["--out", str(tmp_path / "run")]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # 06 chooses the device from torch: keep it on the CPU
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(path.name[:2] + ": "), proc.stdout
    if path.name == "04_train_from_python.py":  # the run is where it was asked to be
        assert (tmp_path / "run" / "metrics.jsonl").is_file() and (
            tmp_path / "run" / "checkpoints" / "best.npz"
        ).is_file()
