"""Bad input to the many-models runs (docs/ensembles.md): each refused with one message naming the value and
what was expected, and what a run writes kept as the other outputs keep it."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from mlptrain.base.backend import get_backend
from mlptrain.base.errors import ConfigError, NonFiniteError, OutputError
from mlptrain.config.schema import Device, TrainConfig
from mlptrain.data import Dataset
from mlptrain.run.faults import out_of_memory
from mlptrain.run.run import train
from mlptrain.step.checks import check_ensemble


def make_cfg(size: int = 1, folds: int = 0) -> TrainConfig:
    cfg = TrainConfig()
    cfg.device, cfg.progress, cfg.epochs = Device.cpu, False, 1
    cfg.model.hidden = [16]
    cfg.ensemble.size, cfg.ensemble.folds = size, folds
    return cfg


@pytest.mark.parametrize("key", ["lr", "weight_decay"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_sweep_value_that_is_not_finite_is_refused_by_name(key: str, bad: float) -> None:
    cfg = make_cfg(size=2)
    setattr(cfg.ensemble, key, [0.1, bad])
    with pytest.raises(ConfigError, match=rf"ensemble.{key}=\[0.1, {bad}\]: each must be a finite number"):
        check_ensemble(cfg)
    setattr(cfg.ensemble, key, [0.1, 0.2])  # (the same list of finite values runs)
    check_ensemble(cfg)


def test_a_sweep_of_a_cross_validation_is_counted_against_its_folds() -> None:
    cfg = make_cfg(folds=3)
    cfg.ensemble.lr = [0.1, 0.2]
    with pytest.raises(ConfigError, match=r"ensemble.lr=\[0.1, 0.2\] has 2 values; .*\(ensemble.folds=3: 3 members"):
        check_ensemble(cfg)


@pytest.mark.parametrize("swept", [True, False])
def test_a_member_that_diverges_is_named_with_the_rate_to_lower(tmp_path: Path, swept: bool) -> None:
    cfg = make_cfg(size=3)
    if swept:  # a batched sweep whose last rate is far too high: that member's, not optimizer.lr, is the one to lower
        cfg.ensemble.lr = [0.01, 0.05, 1e6]
    else:  # one rate for all: every member diverges, and optimizer.lr is the one to lower
        cfg.optimizer.lr = 1e6
    with pytest.raises(NonFiniteError) as err:
        train(cfg, tmp_path / "run")
    message = str(err.value)
    if swept:
        assert "member 2 (ensemble.lr[2]=1e+06) diverged" in message
        assert "lower ensemble.lr=[0.01, 0.05, 1000000.0]" in message and "optimizer.lr" not in message
    else:
        assert "members 0, 1, 2 diverged" in message and "lower optimizer.lr (now " in message


def test_a_member_that_diverges_in_a_sweep_of_the_weight_decay_is_named_with_it(tmp_path: Path) -> None:
    cfg = make_cfg(size=2)
    cfg.optimizer.momentum = 0.0
    cfg.ensemble.weight_decay = [0.0, 1e5]  # w (1 - lr wd) with lr wd = 5000: member 1's weights grow without bound
    with pytest.raises(NonFiniteError) as err:
        train(cfg, tmp_path / "run")
    assert "member 1 (ensemble.weight_decay[1]=100000) diverged; lower ensemble.weight_decay=[0.0, 100000.0]" in str(
        err.value
    )


def test_the_out_of_fold_predictions_never_write_a_class_name_a_spreadsheet_runs(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(120, 4)), np.arange(120) % 3
    names = ['=HYPERLINK("http://x")', "-2", "plain"]  # a formula; a number, written as it is; plain text
    data = Dataset("cells", x[:80], y[:80], x[80:100], y[80:100], x[100:], y[100:], 3, names)  # train, val, test
    cfg = make_cfg(folds=3)
    train(cfg, tmp_path / "run", dataset=data)
    with (tmp_path / "run" / "oof_predictions.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 100  # the pool: training and validation rows
    written = {'=HYPERLINK("http://x")': '\'=HYPERLINK("http://x")', "-2": "-2", "plain": "plain"}
    targets = [names[int(t)] for t in np.concatenate([y[:80], y[80:100]])]
    assert [r["target"] for r in rows] == [written[t] for t in targets]
    assert {r["prediction"] for r in rows} <= set(written.values())
    assert not any(r[c].startswith(("=", "+", "@")) for r in rows for c in ("target", "prediction"))


@pytest.mark.parametrize(("size", "folds", "named"), [(4000, 0, "ensemble.size=4000"), (1, 500, "ensemble.folds=500")])
def test_running_out_of_memory_names_the_member_count(size: int, folds: int, named: str) -> None:
    cfg = make_cfg(size=size, folds=folds)
    error = out_of_memory(MemoryError("Unable to allocate 38 GiB"), cfg, get_backend("cpu"), None, None)
    assert f"{named} (members of model.hidden=[16] each)" in str(error)
    assert f"; lower {named.split('=')[0]} (the members), data.batch_size or model.hidden" in str(error)
    one = str(out_of_memory(MemoryError("x"), make_cfg(), get_backend("cpu"), None, None))
    assert "ensemble" not in one and "; lower data.batch_size or model.hidden" in one  # (one model: as it was)


def rare_positives() -> Dataset:
    """Two classes, two positive rows in the 36 of the pool: one of three folds holds none."""
    rng = np.random.default_rng(1)
    y = (np.arange(40) % 20 == 0).astype(np.int64)
    x = rng.normal(size=(40, 3)) + y[:, None]
    return Dataset("rare", x[:30], y[:30], x[30:36], y[30:36], x[36:], y[36:], 2)


def test_a_fold_metric_that_a_fold_cannot_measure_is_refused_before_the_run(tmp_path: Path) -> None:
    cfg = make_cfg(folds=3)
    cfg.early_stopping.metric = "val/roc_auc"  # undefined on a fold of one class: that fold would keep epoch 1
    with pytest.raises(ConfigError, match=r"early_stopping.metric=val/roc_auc is undefined on fold \d of ensemble"):
        train(cfg, tmp_path / "run", dataset=rare_positives())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the run was accepted


def test_folds_json_is_json_where_a_score_is_undefined(tmp_path: Path) -> None:
    cfg = make_cfg(folds=3)
    train(cfg, tmp_path / "run", dataset=rare_positives())

    def refuse(constant: str) -> None:
        raise AssertionError(f"folds.json holds {constant}, which is not JSON")

    report = json.loads((tmp_path / "run" / "folds.json").read_text(), parse_constant=refuse)
    aucs = [report["out_of_fold"][f"member{k}/val/roc_auc"] for k in range(3)]
    assert None in aucs and any(isinstance(v, float) for v in aucs)  # the fold of one class has none


@pytest.mark.parametrize(("size", "folds", "named"), [(2, 0, "ensemble.size=2"), (1, 3, "ensemble.folds=3")])
def test_what_an_ensemble_does_not_run_with_is_refused_naming_the_setting_given(size: int, folds: int, named: str):
    cfg = make_cfg(size=size, folds=folds)
    cfg.distributed.gpus = 2
    with pytest.raises(ConfigError, match=rf"^{named} does not run with data parallel \(distributed.gpus > 1"):
        check_ensemble(cfg)


def test_a_cross_validation_of_a_table_stops_on_the_out_of_fold_loss_even_without_a_validation_split() -> None:
    from mlptrain.cli.main import compose_config

    table = ["data=file", "data.path=train.csv"]
    # docs/ensembles.md: data.val_fraction=0 keeps the usual validation rows out of the pool; the folds still
    # give val/ (out of fold), so the table's recipe stops on val/loss, not on the training loss
    assert compose_config([*table, "ensemble.folds=5", "data.val_fraction=0"]).early_stopping.metric == "val/loss"
    assert compose_config([*table, "ensemble.folds=5"]).early_stopping.metric == "val/loss"
    assert compose_config([*table, "data.val_fraction=0"]).early_stopping.metric == "train/loss"  # (one model)
    assert compose_config([*table, "ensemble.size=3", "data.val_fraction=0"]).early_stopping.metric == "train/loss"


@pytest.mark.parametrize("name", ["members.md", "folds.json", "oof_predictions.csv"])
def test_a_link_planted_as_a_report_of_the_folds_is_refused_and_the_file_it_names_kept(
    tmp_path: Path, name: str
) -> None:
    cfg = make_cfg(folds=3)
    run = tmp_path / "run"
    train(cfg, run)
    outside = tmp_path / "precious"
    outside.write_text("precious\n")
    (run / name).unlink()
    (run / name).symlink_to(outside)
    cfg.epochs, cfg.resume = 2, "last"
    with pytest.raises(OutputError, match=rf"{name} is a symbolic link \(to {outside}\); a run writes only its own"):
        train(cfg, run)
    assert outside.read_text() == "precious\n"  # the run never wrote through the link


def test_a_class_rarer_than_the_folds_is_named_in_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    names = ["common", "rare"]
    data = rare_positives()
    data.class_names = names
    with caplog.at_level(logging.WARNING, logger="mlptrain.run.folds"):
        train(make_cfg(folds=3), tmp_path / "run", dataset=data)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        "class 'rare' has 2 rows in the pool, fewer than ensemble.folds=3: 1 fold holds none of it, and its "
        "scores leave that class out (scikit-learn's StratifiedKFold warns alike)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlptrain.run.folds"):
        train(make_cfg(folds=2), tmp_path / "two", dataset=data)  # two rows, two folds: one in each
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_the_out_of_fold_scores_cover_every_pool_row_with_drop_last(tmp_path: Path) -> None:
    cfg = make_cfg(folds=3)
    cfg.data.drop_last, cfg.data.eval_batch_size = True, 500  # (the training batches drop; evaluation never does)
    summary = train(cfg, tmp_path / "run")
    with (tmp_path / "run" / "oof_predictions.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1438  # digits: 1294 training and 144 validation rows, every one predicted out of fold
    assert len({r["row"] for r in rows}) == 1438
    hits = sum(r["target"] == r["prediction"] for r in rows) / len(rows)
    report = json.loads((tmp_path / "run" / "folds.json").read_text())
    assert report["out_of_fold"]["val/acc"] == pytest.approx(hits, abs=1e-12)  # scored on all of them
    assert summary["epochs"] == 1


def test_evaluating_a_cross_validation_on_its_validation_split_is_refused(tmp_path: Path) -> None:
    from mlptrain.cli.evaluate import EvaluateArgs, evaluate

    cfg = make_cfg(folds=3)
    summary = train(cfg, tmp_path / "run")
    ckpt = str(tmp_path / "run" / "checkpoints" / "best.npz")
    with pytest.raises(ConfigError, match=r"split=val of a cross-validation \(ensemble.folds=3\): its rows trained 2"):
        evaluate(EvaluateArgs(ckpt=ckpt, split="val"))  # (in-sample for 2 of 3 members: not a validation score)
    assert not (tmp_path / "run" / "evaluation" / "best-val").exists()
    found, _ = evaluate(EvaluateArgs(ckpt=ckpt, split="test"))  # the test split was never in the folds
    assert (found["samples"], found["acc"]) == (359, pytest.approx(summary["best/test/acc"], abs=1e-12))


def test_the_run_line_counts_the_parameters_of_a_member_and_of_the_members(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    one = 64 * 16 + 16 + 16 * 10 + 10  # digits 64-16-10: one model's weights and biases
    with caplog.at_level(logging.INFO, logger="mlptrain.run.run"):
        train(make_cfg(size=3), tmp_path / "run")
        train(make_cfg(), tmp_path / "one")
    lines = [r.getMessage() for r in caplog.records if "dataset digits" in r.getMessage()]
    assert f"model 64-16-10 ({one:,} params each, 3 members: {3 * one:,})" in lines[0]
    assert f"model 64-16-10 ({one:,} params)" in lines[1]


def test_folds_whose_members_hold_fewer_rows_than_a_batch_with_drop_last_are_refused(tmp_path: Path) -> None:
    cfg = make_cfg(folds=3)
    data = rare_positives()  # a pool of 36 rows: each member trains on the 24 of two folds
    cfg.data.drop_last, cfg.data.batch_size = True, 30  # (the pool holds a batch of 30; no member does)
    with pytest.raises(ConfigError, match=r"batch_size=30 with drop_last=true gives no batch for a member's 24 rows"):
        train(cfg, tmp_path / "run", dataset=data)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the run was accepted
    cfg.data.batch_size = 24  # one batch each
    assert train(cfg, tmp_path / "ok", dataset=data)["steps"] == 1


def test_an_ensemble_of_mse_classifiers_predicts_the_members_mean_output(tmp_path: Path) -> None:
    """model.loss=mse on one-hot classes: the members' outputs are no logits, so the ensemble is their mean output
    (as a regression's), scored by the loss the members train with; the mean of their softmaxes was scored as MSE
    of its log (val/loss 5.9 beside members' 0.1)."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from mlptrain.cli.export import ExportArgs, export
    from mlptrain.inference.predictor import Predictor
    from mlptrain.run import checkpoint

    cfg = make_cfg(size=3)
    cfg.model.loss = "mse"
    summary = train(cfg, tmp_path / "run")
    members = [summary[f"member{k}/val/loss"] for k in range(3)]
    assert summary["val/loss"] <= np.mean(members) + 1e-12  # the MSE of a mean is at most the members' mean MSE
    ckpt = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.npz")
    x = np.random.default_rng(0).uniform(0, 16, size=(40, 64))
    outputs = []
    for k in range(3):  # member k as a one-model checkpoint
        arrays = {n: (a[k] if n.startswith("param/") else a) for n, a in ckpt.arrays.items()}
        meta = {n: v for n, v in ckpt.meta.items() if n != "members"}
        outputs.append(Predictor(checkpoint.Checkpoint(ckpt.path, arrays, meta), device="cpu").logits(x))
    together = Predictor(ckpt, device="cpu").logits(x)
    np.testing.assert_allclose(together, np.mean(outputs, axis=0), rtol=1e-5, atol=1e-6)
    onnx = export(ExportArgs(ckpt=str(ckpt.path), format="onnx", output=str(tmp_path / "e.onnx")))
    session = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"x": x.astype(np.float32)})
    np.testing.assert_allclose(logits, together, rtol=1e-5, atol=1e-5)


def test_a_run_stopped_while_writing_its_fold_reports_is_finished_by_its_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlptrain.run.folds import Folds

    whole = tmp_path / "whole"
    train(make_cfg(folds=3), whole)
    write = Folds.write_predictions

    def full_disk(self: Folds, *args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Folds, "write_predictions", full_disk)
    run = tmp_path / "run"
    with pytest.raises(
        OutputError,
        match=r"cannot write the reports of the ensemble in .*No space left on device.*; "
        r"mend that \(a full disk, the folder.s permissions\), then resume=last writes them",
    ):
        train(make_cfg(folds=3), run)
    assert not (run / "oof_predictions.csv").exists()
    monkeypatch.setattr(Folds, "write_predictions", write)  # the disk has room again: resume finishes the run
    cfg = make_cfg(folds=3)
    cfg.resume = "last"
    train(cfg, run)
    for name in ("oof_predictions.csv", "folds.json", "members.md"):
        assert (run / name).read_text() == (whole / name).read_text(), name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records].count("summary") == 1


@pytest.mark.parametrize("folds", [0, 4])
def test_members_that_cannot_fit_in_the_hosts_memory_are_refused_before_they_are_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folds: int
) -> None:
    """ensemble.size=10**9 filled the host's memory making the members' seeds (the OOM killer's end, no error):
    each member's smallest possible arrays are counted first, here against 64 KiB said available."""
    from mlptrain.base.errors import ResourceError
    from mlptrain.step import memory

    monkeypatch.setattr(memory, "host_memory_available", lambda: 2**16)
    cfg = make_cfg(size=1 if folds else 400, folds=folds)
    cfg.data.batch_size = 256  # a member: more than its 256 x 16 float32 hidden inputs, 16 KiB
    key = "ensemble.folds=4" if folds else "ensemble.size=400"
    members = 4 if folds else 400
    with pytest.raises(
        ResourceError,
        match=rf"{key}: {members} members of at least 0.0\d+ MiB each need .* GiB, and the host has 6.1e-05 GiB "
        r"available; lower ensemble\.(size|folds), or train the members as separate runs",
    ):
        memory.members_fit(cfg, "cpu") if folds else train(cfg, tmp_path / "run")
    memory.members_fit(cfg, "gpu")  # the device's allocator says so on a GPU
    monkeypatch.setattr(memory, "host_memory_available", lambda: 2**40)
    memory.members_fit(cfg, "cpu")
