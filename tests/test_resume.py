"""Resume with the run's own settings (mlptrain.run.resume): restored from the checkpoint, refused where they
contradict.

A resume reads what the run was from its checkpoint: ``hydra.run.dir=<run> resume=last`` alone
continues it; a setting that was set and contradicts the run's is refused with the run's value,
except those that may change on resume (``epochs``, ``log_every`` ...), which are honoured and logged.
Every suggested command is pasted into a shell here and run.
"""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg, records
from test_checkpoint import interrupt_at, snapshot_of
from test_cli import REPO, output, run_cli

from mlptrain.base.errors import CheckpointError, ConfigError, OutputError, TrainingInterrupted
from mlptrain.config.schema import DatasetName, Device, Task, TrainConfig
from mlptrain.run import checkpoint
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train

# A run whose settings all differ from the defaults that a bare resume composes.
RUN = {"model__hidden": [16], "optimizer__lr": 0.1, "epochs": 2, "data__batch_size": 32, "seed": 3}


def bare_resume(**overrides: Any) -> TrainConfig:
    """What ``resume=last`` alone means from Python: TrainConfig's defaults (on the CPU, no bars)."""
    cfg = TrainConfig(resume="last", device=Device.cpu, progress=False)
    for key, value in overrides.items():
        obj: Any = cfg
        *path, last = key.split("__")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, value)
    return cfg


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("straight")
    train(make_cfg(**RUN), run)
    return run


@pytest.fixture
def interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run of RUN stopped by Ctrl-C at step 50 (of 2 x 41)."""
    run = tmp_path / "run"
    interrupt_at(monkeypatch, 50)
    with pytest.raises(TrainingInterrupted):
        train(make_cfg(**RUN), run)
    monkeypatch.undo()
    return run


def test_resume_with_the_run_directory_alone_continues_with_the_runs_settings(
    interrupted: Path, straight: Path
) -> None:
    summary = train(bare_resume(), interrupted)
    assert summary["steps"] == 82
    assert records(interrupted) == records(straight)
    a, b = checkpoint.load(interrupted / "checkpoints" / "last.npz"), checkpoint.load(straight / "checkpoints/last.npz")
    assert a.meta["widths"] == [64, 16, 10] and all(np.array_equal(a.arrays[k], b.arrays[k]) for k in b.arrays)


def test_a_setting_that_may_change_is_honoured_and_logged(interrupted: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mlptrain"):
        summary = train(bare_resume(epochs=3, log_every=7), interrupted)
    assert summary["epochs"] == 3 and summary["steps"] == 3 * 41
    assert "epochs 2 -> 3" in caplog.text and "log_every 10 -> 7" in caplog.text, caplog.text
    meta = checkpoint.load(interrupted / "checkpoints" / "last.npz").meta
    assert meta["config"]["model"]["hidden"] == [16] and meta["config"]["epochs"] == 3


@pytest.mark.parametrize(
    ("overrides", "saved", "given"),
    [
        ({"model__hidden": [8, 8]}, "model.hidden=[16]", "model.hidden=[8,8]"),
        ({"data__val_fraction": 0.0}, "data.val_fraction=0.1", "data.val_fraction=0.0"),
        ({"early_stopping__metric": "val/loss"}, "early_stopping.metric=auto", "early_stopping.metric=val/loss"),
    ],
    ids=["architecture", "no-validation-split", "early-stopping-metric"],
)
def test_a_setting_that_contradicts_the_run_is_refused_with_the_runs_value(
    interrupted: Path, overrides: dict[str, Any], saved: str, given: str
) -> None:
    before = snapshot_of(interrupted)
    with pytest.raises(ConfigError) as err:
        train(bare_resume(**overrides), interrupted)
    msg = str(err.value)
    assert saved in msg and given in msg, msg
    assert "out_dir" in msg and "hydra.run.dir" not in msg, "from Python the message names train()'s arguments"
    assert snapshot_of(interrupted) == before


def test_the_interruption_message_from_python_names_pythons_arguments(interrupted: Path) -> None:
    line = [r for r in read_metrics(interrupted / "metrics.jsonl") if r["kind"] == "interrupted"]
    assert line and line[0]["step"] == 51
    with pytest.raises(OutputError) as err:
        train(make_cfg(**RUN), interrupted)
    msg = str(err.value)
    assert "out_dir" in msg and "hydra.run.dir" not in msg and "resume='last'" in msg, msg


def shell(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a suggested ``python -m mlptrain ...`` command through bash, as a user pastes it."""
    assert command.startswith("python -m mlptrain "), command
    exe = shlex.quote(sys.executable)
    env = f"PYTHONPATH={shlex.quote(str(REPO))}"
    return subprocess.run(
        ["bash", "-c", f"{env} {exe} {command[len('python ') :]}"], cwd=cwd, capture_output=True, text=True
    )


def suggested(text: str) -> str:
    """The command after ``continue with: `` in a message."""
    return text.split("continue with: ", 1)[1].strip().splitlines()[0]


def test_the_interruption_message_from_the_cli_pastes_into_a_shell(
    tmp_path: Path, straight: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "my run"  # a space: the command must quote it
    interrupt_at(monkeypatch, 50)
    overrides = ["model.hidden=[16]", "optimizer.lr=0.1", "epochs=2", "data.batch_size=32", "seed=3", "device=cpu"]
    with pytest.raises(TrainingInterrupted) as err:
        train(make_cfg(**RUN), run, overrides=overrides)
    monkeypatch.undo()
    command = suggested(str(err.value))
    assert "<the same overrides>" not in command
    assert command.endswith(" resume=last device=cpu") and "seed" not in command, command
    proc = shell(command + " progress=false", tmp_path)
    assert proc.returncode == 0, output(proc)
    assert records(run) == records(straight)


def test_the_cli_refuses_a_contradiction_once_and_its_suggestion_runs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = run_cli("model.hidden=[16]", "epochs=1", "device=cpu", f"hydra.run.dir={run}", cwd=tmp_path)
    assert first.returncode == 0, output(first)
    before = snapshot_of(run)
    proc = run_cli(f"hydra.run.dir={run}", "resume=last", "model.hidden=[8,8]", "epochs=2", "device=cpu", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in output(proc), output(proc)
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert "model.hidden=[16]" in line and "model.hidden=[8,8]" in line, line
    assert snapshot_of(run) == before, "a refused resume changes nothing"
    command = suggested(line)
    assert "model.hidden" not in command and "epochs=2" in command, command
    again = shell(command, tmp_path)
    assert again.returncode == 0, output(again)
    summary = read_metrics(run / "metrics.jsonl")[-1]
    assert summary["kind"] == "summary" and summary["epochs"] == 2
    assert json.loads((run / "run.json").read_text())["widths"] == [64, 16, 10]


def test_resume_refuses_relabelled_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Labels renamed in place (cat -> kitty) would re-map the class ids: refused, naming both."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    labels = np.where(x[:, 0] > 0, "dog", "cat")
    data = tmp_path / "pets.csv"
    rows = ["a,b,c,label"] + [f"{r[0]},{r[1]},{r[2]},{y}" for r, y in zip(x, labels, strict=True)]
    data.write_text("\n".join(rows) + "\n")
    cfg = dict(data__name=DatasetName.file, data__path=str(data), data__cache=False, epochs=2)
    run = tmp_path / "run"
    interrupt_at(monkeypatch, 3)
    with pytest.raises(TrainingInterrupted):
        train(make_cfg(**cfg), run)
    monkeypatch.undo()
    data.write_text(data.read_text().replace(",cat\n", ",kitty\n"))
    before = snapshot_of(run)
    with pytest.raises(CheckpointError) as err:
        train(make_cfg(resume="last", **cfg), run)
    msg = str(err.value)
    assert "classes cat, dog" in msg and "classes dog, kitty" in msg, msg
    assert snapshot_of(run) == before


def test_a_regression_checkpoint_is_not_resumed_as_a_classification(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 2))
    y = rng.integers(0, 3, size=120)
    data = tmp_path / "t.csv"
    data.write_text("a,b,y\n" + "".join(f"{r[0]},{r[1]},{v}\n" for r, v in zip(x, y, strict=True)))
    base = dict(data__name=DatasetName.file, data__path=str(data), data__target="y", data__cache=False)
    run = tmp_path / "run"
    train(make_cfg(data__task=Task.regression, model__loss="mse", epochs=1, **base), run)
    with pytest.raises(ConfigError) as err:
        train(make_cfg(resume="last", epochs=2, data__task=Task.classification, **base), run)
    msg = str(err.value)
    assert "data.task=regression" in msg and "data.task=classification" in msg, msg
    summary = train(make_cfg(resume="last", epochs=2, **base), run)  # the run's own task: a regression
    assert "best/test/loss" in summary and "test/acc" not in summary and summary["best"]["metric"] == "val/loss"


def _pets(path: Path, header: str = "a,b,c,label,kind") -> None:
    """Two classes of three features, and a fourth feature (``kind``, 0 or 1) that could be a target too."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    labels = np.where(x[:, 0] > 0, "dog", "cat")
    kinds = (x[:, 1] > 0).astype(int)
    rows = [header] + [f"{r[0]},{r[1]},{r[2]},{y},{k}" for r, y, k in zip(x, labels, kinds, strict=True)]
    path.write_text("\n".join(rows) + "\n")


def test_resume_refuses_data_whose_feature_column_was_renamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """#28.6: a feature column renamed (c -> z) since the checkpoint: refused, naming both sets of columns."""
    data = tmp_path / "pets.csv"
    _pets(data)
    cfg = dict(data__name=DatasetName.file, data__path=str(data), data__cache=False, epochs=2)
    run = tmp_path / "run"
    interrupt_at(monkeypatch, 3)
    with pytest.raises(TrainingInterrupted):
        train(make_cfg(**cfg), run)
    monkeypatch.undo()
    _pets(data, header="a,b,z,label,kind")
    before = snapshot_of(run)
    with pytest.raises(CheckpointError) as err:
        train(make_cfg(resume="last", **cfg), run)
    msg = str(err.value)
    assert (
        "was trained on data with feature columns a, b, c, kind, but this run's data has feature columns "
        "a, b, z, kind; resume with the data of the run, or start a new run"
    ) in msg, msg
    assert snapshot_of(run) == before


def test_resume_refuses_another_target_column(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """#28.6: the same file with another column as the target (label -> kind): refused, naming both."""
    data = tmp_path / "pets.csv"
    _pets(data)
    cfg = dict(data__name=DatasetName.file, data__path=str(data), data__cache=False, epochs=2)
    run = tmp_path / "run"
    interrupt_at(monkeypatch, 3)
    with pytest.raises(TrainingInterrupted):
        train(make_cfg(**cfg), run)
    monkeypatch.undo()
    before = snapshot_of(run)
    with pytest.raises((ConfigError, CheckpointError)) as err:
        train(make_cfg(resume="last", data__target="kind", **cfg), run)
    msg = str(err.value)
    assert "data.target=label" in msg and "data.target=kind" in msg, msg
    assert snapshot_of(run) == before


def test_a_classification_checkpoint_is_not_resumed_as_a_regression(tmp_path: Path) -> None:
    """#28.12: a classification resumed with data.task=regression model.loss=mse was a KeyError: 'val/acc'."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 2))
    y = rng.integers(0, 3, size=120)
    data = tmp_path / "t.csv"
    data.write_text("a,b,y\n" + "".join(f"{r[0]},{r[1]},{v}\n" for r, v in zip(x, y, strict=True)))
    base = dict(data__name=DatasetName.file, data__path=str(data), data__target="y", data__cache=False)
    run = tmp_path / "run"
    train(make_cfg(epochs=1, **base), run)
    before = snapshot_of(run)
    with pytest.raises(ConfigError) as err:
        train(make_cfg(resume="last", epochs=2, data__task=Task.regression, model__loss="mse", **base), run)
    msg = str(err.value)
    assert "holds a run with model.loss=cross_entropy, data.task=auto, but this resume sets model.loss=mse, " in msg
    assert "data.task=regression" in msg and "\n" not in msg, msg
    assert snapshot_of(run) == before


@pytest.mark.parametrize(
    ("first", "then", "saved"),
    [
        ([], ["data.task=regression", "model.loss=mse"], "data.task=auto"),  # labels 0, 1, 2: a classification
        (["data.task=regression", "model.loss=mse"], ["data.task=classification"], "data.task=regression"),
    ],
)
def test_the_cli_refuses_a_resume_as_another_task_in_one_line(
    tmp_path: Path, first: list[str], then: list[str], saved: str
) -> None:
    """#28.12 from the command line: exit 2, one line naming the run's task and the asked one, no traceback."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 2))
    (tmp_path / "t.csv").write_text(
        "a,b,y\n" + "".join(f"{r[0]},{r[1]},{v}\n" for r, v in zip(x, rng.integers(0, 3, 120), strict=True))
    )
    run = tmp_path / "run"
    data = ["data=file", "data.path=t.csv", "data.target=y", "data.cache=false"]
    proc = run_cli(*data, *first, "epochs=1", "device=cpu", "progress=false", f"hydra.run.dir={run}", cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    before = snapshot_of(run)
    proc = run_cli(f"hydra.run.dir={run}", "resume=last", "epochs=2", *then, "device=cpu", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in output(proc), output(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and saved in errors[0] and then[0] in errors[0], output(proc)
    assert snapshot_of(run) == before


def test_a_checkpoint_that_does_not_fit_its_own_settings_suggests_a_pasteable_fix(tmp_path: Path) -> None:
    """A re-signed checkpoint whose widths disagree with its config: the trainer's check names the fix."""
    run = tmp_path / "run"
    train(make_cfg(model__hidden=[32, 32], epochs=1), run)
    last = run / "checkpoints" / "last.npz"
    ckpt = checkpoint.load(last)
    ckpt.meta["config"]["model"]["hidden"] = [16]
    checkpoint.save(last, ckpt.arrays, {k: v for k, v in ckpt.meta.items() if k != "sha256"})
    with pytest.raises(CheckpointError) as err:
        train(bare_resume(epochs=2), run)
    msg = str(err.value)
    assert "is for model 64-32-32-10 but this run builds 64-16-10" in msg
    assert msg.endswith("resume with 'model.hidden=[32,32]' or start a new run"), msg


def test_an_early_stopped_run_killed_before_its_summary_only_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after its final last.npz, before its summary: the resume trains no further epoch (#28.2)."""
    from mlptrain.run.loop import Loop

    cfg = dict(early_stopping__patience=1, epochs=12)
    straight = tmp_path / "straight"
    summary = train(make_cfg(**cfg), straight)
    stop = summary["stopped_early"]  # (epoch 3 on digits, 4 before #47's standardisation of narrow pixels)
    assert 1 < stop < 12 and summary["steps"] == 21 * stop, "the reference must stop early"

    def killed(self: Loop, epochs: int, t_start: float) -> Any:
        raise SystemExit("killed")

    run = tmp_path / "run"
    monkeypatch.setattr(Loop, "summary", killed)
    with pytest.raises(SystemExit):
        train(make_cfg(**cfg), run)
    monkeypatch.undo()
    assert read_metrics(run / "metrics.jsonl")[-1]["kind"] == "epoch"
    again = train(make_cfg(resume="last", **cfg), run)
    assert again["steps"] == 21 * stop and again["stopped_early"] == stop and again["epochs"] == summary["epochs"]
    assert records(run) == records(straight)
    a, b = checkpoint.load(run / "checkpoints/last.npz"), checkpoint.load(straight / "checkpoints/last.npz")
    assert a.position == b.position and all(np.array_equal(a.arrays[k], b.arrays[k]) for k in b.arrays)
    with pytest.raises(ConfigError, match=f"stopped early after epoch {stop} .* raise early_stopping.patience"):
        train(make_cfg(resume="last", **cfg), run)  # finished: nothing left to do
    longer = train(make_cfg(resume="last", **{**cfg, "early_stopping__patience": 3}), run)  # honoured
    assert longer["steps"] > 21 * stop


def scripted_val_acc(monkeypatch: pytest.MonkeyPatch, accs: list[float]) -> None:
    """The validation accuracy of epoch ``e`` is ``accs[e]`` (the rest of evaluation as it is)."""
    from mlptrain.step.trainer import Trainer

    original = Trainer.evaluate

    def evaluate(self: Trainer, split: str) -> dict[str, float]:
        out = original(self, split)
        if split == "val":
            out["val/acc"] = accs[self.step_count // self.steps_per_epoch - 1]
        return out

    monkeypatch.setattr(Trainer, "evaluate", evaluate)


def test_a_tie_moves_best_to_the_later_epoch_and_patience_counts_from_the_improvement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#27.4: on a small validation split the accuracy ties often; the first of a tie is an early model."""
    scripted_val_acc(monkeypatch, [0.5, 0.8, 0.8, 0.8, 0.9, 0.9])
    summary = train(make_cfg(epochs=6, early_stopping__patience=2), tmp_path)
    # the summary counts epochs from 1: epochs 3 and 4 tie epoch 2, two epochs without an improvement
    assert summary["stopped_early"] == 4
    assert summary["best"] == {"metric": "val/acc", "value": 0.8, "epoch": 4, "step": 84, "mode": "max", "improved": 2}
    best = checkpoint.load(tmp_path / "checkpoints" / "best.npz")
    assert best.position.step == 84, "best.npz holds the last epoch of the tie"
    last = checkpoint.load(tmp_path / "checkpoints" / "last.npz")
    assert all(np.array_equal(best.arrays[k], last.arrays[k]) for k in best.arrays if k.startswith("param/"))
