"""Runs you can follow and tune: early stopping, per-epoch log lines, metrics.csv, TensorBoard,
the value a Hydra sweeper gets, a multirun's summary table, and ``--help``."""

from __future__ import annotations

import csv
import struct
from pathlib import Path

import pytest
from helpers import make_cfg, records
from test_cli import output, run_cli

from mlptrain.cli.main import sweep_value
from mlptrain.config.keys import all_keys
from mlptrain.config.schema import Logger
from mlptrain.run import checkpoint
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train

# --- early stopping ------------------------------------------------------------------------------


def test_early_stopping_stops_patience_epochs_after_the_last_improvement(tmp_path: Path) -> None:
    # lr=1e-12: the predictions never change, so val/acc is the same every epoch: epoch 0 is the last
    # improvement (a strict one is needed after it) and patience=2 ends the run after epoch 2; the
    # epochs that tie it move best.npz to the latest of them (#27.4).
    cfg = make_cfg(epochs=10, optimizer__lr=1e-12, early_stopping__patience=2)
    summary = train(cfg, tmp_path / "run")
    epochs = [r for r in records(tmp_path / "run") if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2, 3]  # counted from 1, as the log lines count them
    assert summary["stopped_early"] == 3 and summary["epochs"] == 3
    # a tie moves best to the later epoch; patience counts from the last improvement (epoch 1)
    assert summary["best"]["epoch"] == 3 and summary["best"]["improved"] == 1
    assert summary["best"]["metric"] == "val/acc"
    assert records(tmp_path / "run")[-1]["best"] == summary["best"], "train() returns the summary record"
    best = checkpoint.load(tmp_path / "run" / "checkpoints" / "best.npz")
    assert best.meta["best"]["epoch"] == 2 and best.position.epoch == 3  # the checkpoint counts from 0
    last = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.npz")
    assert last.position.epoch == 3, "last.npz is where the run stopped"


def test_early_stopping_waits_while_the_metric_improves(tmp_path: Path) -> None:
    # The training loss falls every epoch at a small learning rate: patience=1 never triggers.
    cfg = make_cfg(epochs=4, optimizer__lr=0.01, early_stopping__patience=1, early_stopping__metric="train/loss")
    summary = train(cfg, tmp_path / "run")
    losses = [r["train/loss"] for r in records(tmp_path / "run") if r["kind"] == "epoch"]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert "stopped_early" not in summary and summary["epochs"] == 4
    assert summary["best"] == {**summary["best"], "epoch": 4, "mode": "min", "metric": "train/loss"}


def test_summary_reports_the_best_checkpoints_test_scores(tmp_path: Path) -> None:
    cfg = make_cfg(epochs=3)
    summary = train(cfg, tmp_path / "run")
    best = checkpoint.load(tmp_path / "run" / "checkpoints" / "best.npz")
    # Evaluate best.npz independently: a fresh trainer loading its parameters.
    from mlptrain.step.trainer import Trainer

    tr = Trainer(cfg)
    tr.model.load_state_dict({k[6:]: v for k, v in best.arrays.items() if k.startswith("param/")})
    assert summary["best/test/acc"] == tr.evaluate("test")["test/acc"]
    assert summary["best/test/loss"] == pytest.approx(tr.evaluate("test")["test/loss"], rel=1e-12)
    assert "test/acc" in summary  # and the last epoch's, as before


def test_a_best_checkpoint_of_the_last_epoch_takes_that_epochs_test_scores(tmp_path: Path, monkeypatch) -> None:
    """best.npz holds the parameters the last epoch evaluated: its test scores are that epoch's, not evaluated
    again; a best of an earlier epoch is evaluated from best.npz (the test above)."""
    from mlptrain.step.trainer import Trainer

    evaluated = []
    real = Trainer.evaluate
    monkeypatch.setattr(Trainer, "evaluate", lambda self, split: evaluated.append(split) or real(self, split))
    cfg = make_cfg(epochs=4, optimizer__lr=0.01, early_stopping__metric="train/loss")  # falls every epoch
    summary = train(cfg, tmp_path / "run")
    assert summary["best"]["epoch"] == 4  # the last (1-based, as the summary line says)
    last = [r for r in records(tmp_path / "run") if r["kind"] == "epoch"][-1]
    assert summary["best/test/acc"] == last["test/acc"] and summary["best/test/loss"] == last["test/loss"]
    assert evaluated.count("test") == 4  # once an epoch, not once more for the summary
    tr = Trainer(cfg)  # and they are best.npz's
    best = checkpoint.load(tmp_path / "run" / "checkpoints" / "best.npz")
    tr.model.load_state_dict({k[6:]: v for k, v in best.arrays.items() if k.startswith("param/")})
    again = tr.evaluate("test")  # (NumPy's BLAS may round a fresh copy's products in their last bits)
    assert again["test/acc"] == last["test/acc"] and again["test/loss"] == pytest.approx(last["test/loss"], rel=1e-6)


# --- what a run writes as it goes ------------------------------------------------------------


def test_off_a_terminal_every_epoch_is_one_log_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli("epochs=3", "device=cpu", "model.hidden=[16]", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    epochs = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "epoch"]
    for where in (proc.stderr, (run_dir / "mlptrain.log").read_text()):
        lines = [line for line in where.splitlines() if " - epoch " in line]
        assert len(lines) == 3, where
        for line, rec in zip(lines, epochs, strict=True):
            assert f"epoch {rec['epoch']}/3" in line  # one count of epochs in the file and the log
            assert f"train loss {rec['train/loss']:.4f} acc {rec['train/acc']:.4f}" in line
            assert f"val loss {rec['val/loss']:.4f}" in line and f"test loss {rec['test/loss']:.4f}" in line
            assert "lr " in line and "samples/s" in line
    assert "\r" not in proc.stderr, "no progress bar off a terminal"


def test_epochs_count_from_one_in_the_files_the_log_and_the_summary(tmp_path: Path) -> None:
    """#27.7: ``epoch`` was 0-based in metrics.jsonl and metrics.csv, 1-based in the log and the summary."""
    run_dir = tmp_path / "run"
    proc = run_cli(
        "epochs=3",
        "device=cpu",
        "model.hidden=[16]",
        "progress=false",
        "early_stopping.patience=1",
        "optimizer.lr=1e-12",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, output(proc)
    jsonl = read_metrics(run_dir / "metrics.jsonl")
    logged = [int(line.split(" - epoch ")[1].split("/")[0]) for line in proc.stderr.splitlines() if " - epoch " in line]
    assert [r["epoch"] for r in jsonl if r["kind"] == "epoch"] == logged == [1, 2]
    assert {r["epoch"] for r in jsonl if r["kind"] == "step"} == {1, 2}
    with open(run_dir / "metrics.csv", newline="") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f) if r["kind"] == "epoch"] == [1, 2]
    summary = jsonl[-1]
    # epoch 2 ties epoch 1 (lr 1e-12): best moves to the later epoch of the tie (#27.4)
    assert summary["best"]["epoch"] == 2 and summary["best"]["improved"] == 1 and summary["stopped_early"] == 2
    assert "best (epoch 2, val/acc" in proc.stdout and "stopped early after epoch 2" in proc.stdout


def test_resuming_a_run_written_with_epochs_from_zero_renumbers_it(tmp_path: Path) -> None:
    """A run written before epochs counted from 1 continues as one file with one count."""
    import json

    run_dir = tmp_path / "run"
    train(make_cfg(epochs=2), run_dir)
    old = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in old:  # as the earlier mlptrain wrote it
        for key in ("epoch", "stopped_early"):
            if key in r:
                r[key] -= 1
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    train(make_cfg(epochs=3, resume="last"), run_dir)
    jsonl = read_metrics(run_dir / "metrics.jsonl")
    assert [r["epoch"] for r in jsonl if r["kind"] == "epoch"] == [1, 2, 3]
    steps = [r for r in jsonl if r["kind"] == "step"]
    assert steps[0]["epoch"] == 1 and steps[-1]["epoch"] == 3


def test_metrics_csv_has_a_row_per_record_and_survives_a_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(make_cfg(epochs=2, log_every=5), run_dir)
    train(make_cfg(epochs=3, log_every=5, resume="last"), run_dir)
    jsonl = read_metrics(run_dir / "metrics.jsonl")
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(jsonl) and [r["kind"] for r in rows] == [r["kind"] for r in jsonl]
    for row, rec in zip(rows, jsonl, strict=True):
        for key in ("step", "train/loss", "val/acc", "lr"):
            if rec.get(key) is not None:
                assert float(row[key]) == pytest.approx(rec[key], rel=1e-12), (key, row, rec)


def _events(folder: Path) -> list[tuple[str, int, float]]:
    """``(tag, step, value)`` of every scalar in a folder's TensorBoard event files (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_tensorboard_event_files_hold_the_metrics(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    run_dir = tmp_path / "run"
    train(make_cfg(epochs=2, log_every=7, logger=Logger.tensorboard), run_dir)
    events = _events(run_dir / "tensorboard")
    jsonl = read_metrics(run_dir / "metrics.jsonl")
    epochs = [r for r in jsonl if r["kind"] == "epoch"]
    got = {(tag, step): value for tag, step, value in events}
    for rec in epochs:
        assert got[("epoch/val/acc", rec["step"])] == pytest.approx(rec["val/acc"], rel=1e-6)
        assert got[("epoch/train/loss", rec["step"])] == pytest.approx(rec["train/loss"], rel=1e-6)
    steps = [r for r in jsonl if r["kind"] == "step"]
    assert [s for t, s, _ in events if t == "train/loss"] == [r["step"] for r in steps]


def test_tensorboard_holds_every_record_on_disk_when_last_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run SIGKILLed right after ``last.npz`` resumes from it and purges TensorBoard from its step: the event
    files must already hold every step below it (tensorboardX flushes its queue every two minutes)."""
    pytest.importorskip("tensorboardX")
    from mlptrain.run import loop

    run_dir, seen = tmp_path / "run", []
    real_save = loop.checkpoint.save

    def save(path: Path, arrays: dict, meta: dict) -> None:
        if Path(path).name == "last.npz":  # (on the checkpoint writer's thread: the loop may be further on)
            below = meta["position"]["step"]
            steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "step"]
            on_disk = [s for t, s, _ in _events(run_dir / "tensorboard") if t == "train/loss"]
            seen.append(([s for s in steps if s < below], [s for s in on_disk if s < below]))
        real_save(path, arrays, meta)

    monkeypatch.setattr(loop.checkpoint, "save", save)
    train(make_cfg(epochs=3, logger=Logger.tensorboard), run_dir)
    assert len(seen) == 3 and all(len(steps) > 0 for steps, _ in seen)
    for steps, on_disk in seen:
        assert on_disk == steps


# --- tuning: the sweeper's value and the sweep's table ---------------------------------------


def test_sweep_value_is_the_optimized_metric_or_the_best() -> None:
    summary = {"best": {"metric": "val/acc", "value": 0.75}, "test/acc": 0.5, "val/loss": 0.25}
    assert sweep_value(summary, None) == 0.75
    assert sweep_value(summary, "val/loss") == 0.25
    assert isinstance(sweep_value(summary, "test/acc"), float)
    assert sweep_value(summary, "nope") != sweep_value(summary, "nope")  # NaN: the job has no such value


def test_the_task_function_returns_a_float(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What Hydra's sweepers receive: ``_run`` returns ``float``, the optimized metric."""
    import sys

    from mlptrain.cli import main as cli

    seen: list[object] = []
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "mlptrain",
            "epochs=1",
            "device=cpu",
            "model.hidden=[8]",
            "progress=false",
            "optimized_metric=val/loss",
            f"hydra.run.dir={tmp_path}/run",
        ],
    )
    real = cli.sweep_value
    monkeypatch.setattr(cli, "sweep_value", lambda s, k: seen.append(real(s, k)) or seen[-1])
    monkeypatch.chdir(tmp_path)
    cli.register_configs()
    cli._run()
    summary = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert seen == [summary["val/loss"]] and isinstance(seen[0], float)


def test_a_multirun_writes_its_summary_table(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_cli(
        "-m",
        "epochs=1",
        "device=cpu",
        "model.hidden=[8],[16]",
        "optimizer.lr=0.05,1e-9",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, output(proc)
    with open(sweep / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    for row in rows:
        summary = read_metrics(sweep / row["job"] / "metrics.jsonl")[-1]
        assert row["status"] == "finished"
        assert float(row["best"]) == pytest.approx(summary["best"]["value"], rel=1e-9)
        assert float(row["test acc"]) == pytest.approx(summary["test/acc"], rel=1e-9)
    assert sorted(r["overrides"] for r in rows) == sorted(
        f"model.hidden={h} optimizer.lr={lr}" for h in ("[8]", "[16]") for lr in ("0.05", "1e-09")
    )  # what differs between the jobs; what they share is above the table
    md = (sweep / "summary.md").read_text()
    assert "Every job: epochs=1 device=cpu" in md
    assert md.count("\n| ") == 1 + 4  # the header and a row per job


def test_help_lists_every_setting_with_its_default_and_description(tmp_path: Path) -> None:
    proc = run_cli("--help", cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    lines = proc.stdout.splitlines()
    for key in all_keys():
        line = next((x for x in lines if x.strip().startswith(f"{key} = ")), None)
        assert line is not None, f"--help does not list {key}"
        assert len(line.split(None, 3)) == 4, f"--help gives {key} no description: {line!r}"
    assert "optimizer.lr = 0.05" in proc.stdout and "data.split_seed = 0" in proc.stdout
    assert "optimizer: adam, adamw, sgd" in proc.stdout  # the groups, from Hydra
    chosen = run_cli("optimizer=adam", "data.batch_size=7", "--help", cwd=tmp_path).stdout
    assert "optimizer.lr = 0.001" in chosen and "data.batch_size = 7 " in chosen  # the composed values


def test_an_optuna_sweep_gets_each_jobs_value(tmp_path: Path) -> None:
    """The README's Optuna sweep, where the plugin is installed ('mlptrain[optuna]')."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    import yaml

    sweep = tmp_path / "sweep"
    proc = run_cli(
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.direction=maximize",
        "optimizer.lr=interval(0.01,0.2)",
        "model.hidden=choice([16],[32])",
        "epochs=1",
        "device=cpu",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, output(proc)
    values = [read_metrics(job / "metrics.jsonl")[-1]["best"]["value"] for job in sweep.glob("*/") if job.is_dir()]
    assert len(values) == 3
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert result["best_value"] == max(values)  # Optuna saw each job's val/acc
    assert (sweep / "summary.csv").read_text().count("\n") == 1 + 3


def _shown(folder: Path) -> dict[str, list[int]]:
    """The steps TensorBoard shows per tag: the events of every file in the order written, where a
    SessionLog START at step ``p`` (a writer's ``purge_step``) drops the earlier events from ``p`` on."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in folder.glob("events.out.tfevents.*"):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            events.append(event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n]))
            pos += 12 + n + 4
    points: list[tuple[str, int]] = []
    for event in sorted(events, key=lambda e: e.wall_time):
        if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
            points = [(tag, step) for tag, step in points if step < event.step]
        points += [(v.tag, event.step) for v in event.summary.value]
    shown: dict[str, list[int]] = {}
    for tag, step in points:
        shown.setdefault(tag, []).append(step)
    return {tag: sorted(steps) for tag, steps in shown.items()}


def test_a_resumed_run_keeps_the_epoch_point_at_its_checkpoint_in_tensorboard(tmp_path: Path) -> None:
    """#28.7: resuming 3 -> 5 epochs left the epoch points at 21, 42, 84, 105 (the purge dropped 63)."""
    pytest.importorskip("tensorboardX")
    run_dir = tmp_path / "run"
    train(make_cfg(epochs=3, log_every=7, logger=Logger.tensorboard), run_dir)
    train(make_cfg(epochs=5, log_every=7, logger=Logger.tensorboard, resume="last"), run_dir)
    jsonl = read_metrics(run_dir / "metrics.jsonl")
    epoch_steps = [r["step"] for r in jsonl if r["kind"] == "epoch"]
    assert len(epoch_steps) == 5
    shown = _shown(run_dir / "tensorboard")
    assert shown["epoch/val/acc"] == epoch_steps and shown["epoch/train/loss"] == epoch_steps
    assert shown["train/loss"] == [r["step"] for r in jsonl if r["kind"] == "step"], "each step once"


def test_a_resumed_run_tells_tensorboard_to_drop_what_it_logs_again(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    from tensorboardX.proto import event_pb2

    run_dir = tmp_path / "run"
    train(make_cfg(epochs=2, log_every=7, logger=Logger.tensorboard), run_dir)
    train(make_cfg(epochs=3, log_every=7, logger=Logger.tensorboard, resume="last"), run_dir)
    # a file per writer and per checkpoint (TensorBoardSink.flush), named in the order they were written
    files = sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) >= 2
    starts, first_times = [], []
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4
            if pos == 12 + n + 4:
                first_times.append(event.wall_time)
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                starts.append(event.step)
    assert first_times == sorted(first_times), "TensorBoard reads the files in the order of their names"
    resumed_at = checkpoint.load(run_dir / "checkpoints" / "last.npz").meta["steps_per_epoch"] * 2
    assert starts == [resumed_at]  # TensorBoard purges the first run's events from this step on
