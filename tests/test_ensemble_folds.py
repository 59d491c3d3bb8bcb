"""ensemble.folds=K: K-fold cross-validation in one run (docs/ensembles.md, mlptrain/run/folds.py)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import records
from test_ensemble import make_cfg

from mlptrain.base.errors import ConfigError
from mlptrain.config.schema import TrainConfig
from mlptrain.run.ensemble import EnsembleTrainer
from mlptrain.run.run import train


def test_stratified_folds_partition_the_rows_with_each_class_dealt_evenly() -> None:
    from mlptrain.data import stratified_folds

    y = np.repeat([0, 1, 2], [50, 23, 7])  # imbalanced: a random (unstratified) split misses this often
    fold = stratified_folds(y, 5, np.random.default_rng(3))
    assert fold.shape == y.shape and set(fold) == set(range(5))  # every row in exactly one fold
    sizes = np.bincount(fold, minlength=5)
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == len(y)
    for cls in range(3):
        counts = np.bincount(fold[y == cls], minlength=5)
        assert counts.max() - counts.min() <= 1, (cls, counts)
    np.testing.assert_array_equal(fold, stratified_folds(y, 5, np.random.default_rng(3)))  # seeded
    assert not np.array_equal(fold, stratified_folds(y, 5, np.random.default_rng(4)))
    with pytest.raises(ConfigError, match="ensemble.folds=1 needs 2 <= folds"):
        stratified_folds(y, 1, np.random.default_rng(0))


def folds_cfg(**kw) -> TrainConfig:
    cfg = make_cfg(**kw)
    cfg.ensemble.folds = 4
    return cfg


def test_member_k_trains_on_every_fold_but_k() -> None:
    tr = EnsembleTrainer(folds_cfg())
    folds = tr.folds
    assert folds is not None and tr.members == 4
    pool = tr.eval_loaders["val"]
    for k, rows in enumerate(folds.rows):
        assert set(rows) == set(np.flatnonzero(folds.fold != k))  # all the other folds, fold k never
        np.testing.assert_array_equal(tr.train_loader.rows[k], rows)  # its rows of the pool it gathers from
    np.testing.assert_array_equal(tr.train_loader.x, pool.x)
    assert len({len(r) for r in folds.rows}) == 1  # one batch size for all: the smaller sets topped up
    assert pool.num_samples == len(tr.dataset.y_train) + len(tr.dataset.y_val)


def test_a_frozen_member_is_not_updated_and_a_stalled_one_gets_its_best_weights_back() -> None:
    cfg = folds_cfg()
    cfg.early_stopping.patience = 1
    tr = EnsembleTrainer(cfg)
    folds = tr.folds
    assert folds is not None and tr.optimizer.members is not None
    first = tr.model.state_dict()
    found = {f"member{k}/val/acc": 0.5 for k in range(4)}
    folds.end_epoch(tr, found)  # epoch 0: every member's best so far, weights kept
    x, y = next(iter(tr.train_batches(0)))
    tr.step(x, y)
    found["member1/val/acc"] = 0.4  # member 1 got worse; the others improved
    found.update({f"member{k}/val/acc": 0.6 for k in (0, 2, 3)})
    out = folds.end_epoch(tr, found)
    assert out == {"member1/stopped": 2.0} and list(tr.optimizer.members.frozen) == [False, True, False, False]
    now = tr.model.state_dict()
    for name, a in now.items():
        np.testing.assert_array_equal(a[1], first[name][1])  # its best (epoch 0) weights back
        assert not np.array_equal(a[0], first[name][0])  # (the others trained)
    tr.step(x, y)
    for name, a in tr.model.state_dict().items():
        np.testing.assert_array_equal(a[1], first[name][1])  # frozen: no update
        assert not np.array_equal(a[2], now[name][2])


def test_a_cross_validation_run_reports_each_fold_and_the_out_of_fold_predictions(tmp_path: Path) -> None:
    cfg = folds_cfg(epochs=2)
    summary = train(cfg, tmp_path / "run")
    report = json.loads((tmp_path / "run" / "folds.json").read_text())
    values = [f["value"] for f in report["folds"]]
    assert len(values) == 4 and report["mean"] == pytest.approx(np.mean(values))
    assert report["std"] == pytest.approx(np.std(values)) and report["std"] > 0
    with (tmp_path / "run" / "oof_predictions.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert summary["epochs"] == 2 and {int(r["fold"]) for r in rows} == {0, 1, 2, 3}
    acc = np.mean([r["prediction"] == r["target"] for r in rows])
    assert acc == pytest.approx(report["out_of_fold"]["val/acc"])
    for k, fold in enumerate(report["folds"]):  # each fold's best, its member's weights then, on the fold's rows
        mine = [r["prediction"] == r["target"] for r in rows if int(r["fold"]) == k]
        assert fold["value"] == pytest.approx(np.mean(mine))


def stopping_cfg(**kw) -> TrainConfig:
    cfg = folds_cfg(epochs=8, **kw)
    cfg.early_stopping.patience = 1  # the folds stop at different epochs (fold 2 after epoch 4 with seed 5)
    return cfg


@pytest.fixture(scope="module")
def straight_folds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted cross-validation whose folds stop early at different epochs."""
    out = tmp_path_factory.mktemp("straight-folds")
    train(stopping_cfg(), out)
    return out


def test_a_cross_validation_killed_and_resumed_ends_as_an_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, straight_folds: Path
) -> None:
    from test_checkpoint import assert_same_state, interrupt_at

    from mlptrain.base.errors import TrainingInterrupted
    from mlptrain.run import checkpoint

    ref = straight_folds
    report = json.loads((ref / "folds.json").read_text())
    stops = sorted(f["stopped"] for f in report["folds"] if f["stopped"] is not None)
    spe = checkpoint.load(ref / "checkpoints" / "last.npz").meta["steps_per_epoch"]
    at = stops[0] * spe + 3  # inside the epoch after the first fold stopped, before the next one stops
    assert len(stops) >= 2 and stops[0] < stops[1] and stops[-1] < 8  # (what the interruption must carry over)
    interrupt_at(monkeypatch, at)
    with pytest.raises(TrainingInterrupted):
        train(stopping_cfg(), tmp_path)
    monkeypatch.undo()
    saved = checkpoint.load(tmp_path / "checkpoints" / "last.npz").meta["folds"]
    assert sum(s is not None for s in saved["stopped"]) == 1 and saved["epoch"] == stops[0]  # one fold stopped

    train(stopping_cfg(resume="last"), tmp_path)

    for name in ("folds.json", "oof_predictions.csv", "members.md"):
        assert (tmp_path / name).read_text() == (ref / name).read_text(), name
    assert records(tmp_path) == records(ref)
    assert_same_state(tmp_path / "checkpoints" / "last.npz", ref / "checkpoints" / "last.npz")  # folds/best/ too
    assert_same_state(tmp_path / "checkpoints" / "best.npz", ref / "checkpoints" / "best.npz")
    assert any(k.startswith("folds/best/") for k in checkpoint.load(ref / "checkpoints" / "last.npz").arrays)


def test_a_cross_validation_checkpoint_from_before_the_folds_bests_still_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint without ``folds`` (written before each fold's best was kept) loads, and its resume says that
    the folds' tracking starts again; a ``folds`` entry that does not fit the run is one CheckpointError."""
    from test_checkpoint import interrupt_at

    from mlptrain.base.errors import CheckpointError, TrainingInterrupted
    from mlptrain.run import checkpoint

    interrupt_at(monkeypatch, 40)
    with pytest.raises(TrainingInterrupted):
        train(stopping_cfg(), tmp_path)
    monkeypatch.undo()
    last = tmp_path / "checkpoints" / "last.npz"
    ckpt = checkpoint.load(last)
    meta = {k: v for k, v in ckpt.meta.items() if k not in ("folds", "sha256")}
    old = {k: v for k, v in ckpt.arrays.items() if not k.startswith("folds/")}
    bad = {**ckpt.meta["folds"], "best": ckpt.meta["folds"]["best"][:3]}
    checkpoint.save(last, old, {**meta, "folds": bad})
    with pytest.raises(CheckpointError, match=r"tracks 3 folds' bests and 4 stops; this run has 4 folds"):
        train(stopping_cfg(resume="last"), tmp_path)
    checkpoint.save(last, old, meta)  # as written before the folds' bests were kept
    assert checkpoint.load(last).meta.get("folds") is None
    with caplog.at_level("WARNING"):
        train(stopping_cfg(resume="last"), tmp_path)
    assert "written before each fold's best was saved" in caplog.text
    report = json.loads((tmp_path / "folds.json").read_text())
    assert len(report["folds"]) == 4 and all(f["epoch"] > 2 for f in report["folds"])  # tracked from epoch 3 on


def test_a_resumed_cross_validation_sets_the_frozen_flags_the_gpu_kernel_reads() -> None:
    """A stopped fold frozen again on resume: the host mask and the (K,) flags the GPU's update kernel reads."""
    cfg = folds_cfg()
    cfg.early_stopping.patience = 1
    tr = EnsembleTrainer(cfg)
    assert tr.folds is not None
    found = {f"member{k}/val/acc": 0.5 for k in range(4)}
    tr.folds.end_epoch(tr, found)
    found["member2/val/acc"] = 0.4  # member 2 stops
    tr.folds.end_epoch(tr, found)
    arrays, meta = tr.folds.state_dict(tr)
    fresh = EnsembleTrainer(cfg)
    assert fresh.folds is not None and fresh.optimizer.members is not None
    fresh.folds.load_state_dict(fresh, arrays, meta, epoch=2, where="the test's checkpoint")
    assert list(fresh.optimizer.members.frozen) == [False, False, True, False]
    assert list(np.asarray(fresh.optimizer.members.frozen_flags)) == [0, 0, 1, 0]


def test_a_cross_validation_resumed_on_data_that_deals_other_folds_is_refused(tmp_path: Path) -> None:
    """The checkpoint keeps what its folds were dealt from (the pool's rows, a digest of each row's fold): a resume
    whose data deals other folds (the file changed) is one CheckpointError naming both, not the old folds' bests
    carried on over new folds; a checkpoint from before the deal was kept resumes as it did."""
    from mlptrain.base.errors import CheckpointError
    from mlptrain.run import checkpoint

    cfg = stopping_cfg()
    cfg.epochs = 2
    train(cfg, tmp_path)
    last = tmp_path / "checkpoints" / "last.npz"
    ckpt = checkpoint.load(last)
    deal = ckpt.meta["folds"]["deal"]
    assert deal["rows"] == len(np.loadtxt(tmp_path / "oof_predictions.csv", delimiter=",", skiprows=1, usecols=0))
    meta = {k: v for k, v in ckpt.meta.items() if k != "sha256"}
    other = {**meta, "folds": {**meta["folds"], "deal": {"rows": deal["rows"], "sha256": "0123456789abcdef"}}}
    checkpoint.save(last, ckpt.arrays, other)
    more = stopping_cfg(resume="last")
    more.epochs = 3
    with pytest.raises(
        CheckpointError,
        match=rf"trained folds dealt from {deal['rows']} pool rows \(fold digest "
        rf"0123456789abcdef\); the data now deals {deal['rows']} rows into other folds \(digest "
        rf"{deal['sha256']}\): the data changed",
    ):
        train(more, tmp_path)
    before = {**meta, "folds": {k: v for k, v in meta["folds"].items() if k != "deal"}}
    checkpoint.save(last, ckpt.arrays, before)
    train(more, tmp_path)
    assert checkpoint.load(last).meta["folds"]["deal"] == deal  # written again by the resumed run
