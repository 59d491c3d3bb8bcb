"""The README's commands, run as written, top to bottom, in a shell (issue #27, "What it must show").

Every ``python -m mlptrain...`` line of the README's fenced ``sh`` blocks runs in ``bash`` in one
folder, in the README's order, with the small files the "Train on your own data" commands name
(``train.csv`` with a ``label`` column and a ``species`` one, ``test.csv``, ``customers.csv`` with text
columns, empty cells and an id, ``houses.csv`` with
targets in the hundreds, and ``new.csv`` for ``predict``). ``python`` is this interpreter. Two
changes, both the README's own: ``<run dir>`` is the folder of the run that the first "own data"
command made, and a training command gets ``epochs=1`` at its end (the README's "Configuration":
a key given twice takes its last value), which keeps the CPU suite short; the regression example
runs its own epochs and must beat predicting the train split's mean on its test split. ``make`` lines
are not run here (tests/test_packaging.py checks ``make run``); the GPU and ``torchrun`` commands run in
:func:`test_the_readmes_gpu_commands_run`, in the GPU suite only.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
PLACEHOLDER = "<run dir>"
# The README's commands that need GPUs (by what they ask for), and the regression example (#27.2).
GPU_WORDS = ("device=gpu", "distributed.gpus=", "torchrun ")
REGRESSION = "data.path=houses.csv"
QUICK = "epochs=1"  # appended to the training commands (see above)


def readme_commands(text: str) -> list[str]:
    """The ``python -m mlptrain...`` and ``torchrun`` commands of the fenced ``sh`` blocks, in order, each
    joined across its ``\\`` line continuations, comments left in (bash drops them)."""
    commands = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M):
        for command in block.replace("\\\n", " ").splitlines():
            if command.startswith(("python -m mlptrain", "torchrun ")):
                commands.append(command)
    return commands


COMMANDS = readme_commands((REPO / "README.md").read_text(encoding="utf-8"))
CPU_COMMANDS = [c for c in COMMANDS if not any(w in c for w in GPU_WORDS) and REGRESSION not in c]


def python_on_path(folder: Path) -> dict[str, str]:
    """An environment whose ``python`` is this interpreter (a venv's, with its packages) and whose
    ``import mlptrain`` is this checkout, as an activated ``.venv`` of a clone would be."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (folder / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "HYDRA_MAIN_MODULE")}
    # this checkout first; what PYTHONPATH already holds (a GPU machine's wheels) after it
    path = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(PATH=f"{folder}{os.pathsep}{env['PATH']}", PYTHONPATH=path)
    return env


def write_own_data(folder: Path, rows: int = 150) -> None:
    """The files the README's "own data" commands read: three classes of four features (``label`` and
    ``species`` both name them, by number), and houses whose price and rent run in the hundreds."""
    rng = np.random.default_rng(0)
    label = np.arange(rows) % 3
    x = rng.normal(size=(rows, 4)) + label[:, None] * 1.5
    features = [",".join(f"{v:.4f}" for v in r) for r in x]
    table = ["f0,f1,f2,f3,label,species"] + [f"{f},{c},{c}" for f, c in zip(features, label, strict=True)]
    cut = rows * 4 // 5 + 1
    (folder / "train.csv").write_text("\n".join(table[:cut]) + "\n")
    (folder / "test.csv").write_text("\n".join([table[0], *table[cut:]]) + "\n")
    # new rows for the first command's model: its features are every column but "label"
    new = ["f0,f1,f2,f3,species"] + [f"{f},{c}" for f, c in zip(features[:20], label[:20], strict=True)]
    (folder / "new.csv").write_text("\n".join(new) + "\n")
    area, rooms, age = rng.uniform(40, 200, rows), rng.integers(1, 7, rows), rng.uniform(0, 80, rows)
    price = 1.5 * area + 12 * rooms - 0.6 * age + rng.normal(0, 8, rows)  # about 25 to 350
    rent = 0.8 * area + 20 * rooms + rng.normal(0, 5, rows)
    rows_ = zip(area, rooms, age, price, rent, strict=True)
    houses = ["area,rooms,age,price,rent"] + [f"{a:.1f},{r},{g:.1f},{p:.1f},{t:.1f}" for a, r, g, p, t in rows_]
    (folder / "houses.csv").write_text("\n".join(houses) + "\n")
    # a table as people bring one: an id, text categories, empty cells, text labels
    plan, region = rng.choice(["basic", "plus", "pro"], rows), rng.choice(["north", "south", ""], rows)
    age = [f"{a:.0f}" if a > 25 else "" for a in rng.uniform(18, 80, rows)]
    churned = np.where((plan == "basic") ^ (rng.random(rows) < 0.2), "yes", "no")
    table_rows = zip(range(1000, 1000 + rows), age, plan, region, churned, strict=True)
    customers = ["id,age,plan,region,churned"] + [",".join(map(str, r)) for r in table_rows]
    (folder / "customers.csv").write_text("\n".join(customers) + "\n")


class Workspace:
    """The folder the README's commands run in, one after another, and the runs they made."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.env = python_on_path(folder / ".bin")
        self.env["MLPTRAIN_DATA"] = str(folder / ".data")  # the downloads' cache: none here
        self.runs: dict[str, Path] = {}  # command -> the run folder it made
        self._last_start = 0.0
        write_own_data(folder)

    def run(self, command: str, quick: bool = True) -> subprocess.CompletedProcess[str]:
        key = command
        if quick and command.startswith(
            "python -m mlptrain "
        ):  # training (or --cfg): the quick form, before the comment
            command = re.sub(r"\s+#\s.*$", "", command) + " " + QUICK
        if PLACEHOLDER in command:
            own = next(c for c in COMMANDS if "data=file" in c)
            if own not in self.runs:  # this test alone (-k): the run it names first
                self.run(own)
            command = command.replace(PLACEHOLDER, shlex.quote(str(self.runs[own])))
        # outputs/<date>/<time>/ is named to the second: a run starts in a second of its own
        time.sleep(max(0.0, self._last_start + 1.05 - time.time()))
        self._last_start = time.time()
        before = set(self.folder.glob("outputs/*/*"))
        proc = subprocess.run(
            ["bash", "-c", command], cwd=self.folder, env=self.env, capture_output=True, text=True, timeout=600
        )
        made = sorted(set(self.folder.glob("outputs/*/*")) - before)
        if made:
            self.runs[key] = made[-1]
        return proc


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("readme"))


def test_the_readme_has_the_commands_it_is_tested_by() -> None:
    assert len(COMMANDS) >= 15 and sum(REGRESSION in c for c in COMMANDS) == 1
    assert COMMANDS.index(next(c for c in COMMANDS if "data=file" in c)) < COMMANDS.index(
        next(c for c in COMMANDS if PLACEHOLDER in c)
    ), "the run that <run dir> names comes first"


@pytest.mark.parametrize("command", CPU_COMMANDS)
def test_the_readmes_command_runs_as_written(workspace: Workspace, command: str) -> None:
    proc = workspace.run(command)
    assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr


def test_the_readmes_regression_example_beats_predicting_the_mean(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omegaconf import OmegaConf

    from mlptrain.config.schema import DataConfig
    from mlptrain.data import load_dataset
    from mlptrain.run import checkpoint
    from mlptrain.run.metrics import read_metrics

    command = next(c for c in COMMANDS if REGRESSION in c)
    proc = workspace.run(command, quick=False)  # its own epochs, as written
    assert proc.returncode == 0, f"{command}\n{proc.stderr}"
    run = workspace.runs[command]
    summary = read_metrics(run / "metrics.jsonl")[-1]
    # the run's own split of houses.csv (its saved data config: the same split_seed), targets in their units
    saved = checkpoint.load(run / "checkpoints" / "best.npz").meta["config"]["data"]
    monkeypatch.chdir(workspace.folder)  # data.path=houses.csv, as the command gave it
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), {**saved, "cache": False}))
    ds = load_dataset(cfg)  # type: ignore[arg-type]
    assert ds.target_scaling is not None
    y_train, y_test = (ds.target_scaling.undo(y).astype(np.float64) for y in (ds.y_train, ds.y_test))
    baseline = float(((y_test - y_train.mean(axis=0)) ** 2).mean())  # the test MSE of the train split's mean
    assert summary["test/loss"] < baseline, f"test MSE {summary['test/loss']} >= {baseline}, predicting the mean"


@pytest.mark.gpu
@pytest.mark.parametrize("command", [c for c in COMMANDS if any(w in c for w in GPU_WORDS)])
def test_the_readmes_gpu_commands_run(workspace: Workspace, command: str) -> None:
    import cupy

    gpus = cupy.cuda.runtime.getDeviceCount()
    asked = re.search(r"(?:distributed\.gpus=|--nproc_per_node=)(\d+)", command)
    wanted = int(asked.group(1)) if asked else 1
    if wanted > gpus:
        pytest.skip(f"needs {wanted} GPUs, this machine has {gpus}")
    if command.startswith("torchrun ") and shutil.which("torchrun") is None:
        pytest.skip("torchrun is not installed")
    proc = workspace.run(command)
    assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
