"""``python -m mlptrain.plot`` of a run of many models (mlptrain.cli.plot): each member's validation and test
curves beside the ensemble's, labelled by fold, learning rate or weight decay; a sweep's members in its colour."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlptrain.cli import plot
from mlptrain.cli.plot import MEMBER_LABELS, curves_figure, member_labels

pytest.importorskip("matplotlib")


def write_run(
    run: Path,
    members: int,
    *,
    lrs: list[float] | None = None,
    folds: bool = False,
    running: bool = False,
    epochs: int = 3,
) -> dict:
    """A run directory whose metrics.jsonl holds ``members`` members' scores (random, seeded by the path); returns
    the epoch records written."""
    rng = np.random.default_rng(len(str(run)) + members)
    run.mkdir(parents=True)
    records: list[dict[str, Any]] = [
        {"kind": "step", "step": s, "epoch": 1, "train/loss": 2.0 / (s + 1)} for s in range(6)
    ]
    for e in range(1, epochs + 1):
        r: dict[str, Any] = {"kind": "epoch", "epoch": e, "step": 2 * e}
        for split in ("val", "test"):
            r[f"{split}/loss"], r[f"{split}/acc"] = float(rng.random()), float(rng.random())
            for k in range(members):
                r[f"member{k}/{split}/loss"], r[f"member{k}/{split}/acc"] = float(rng.random()), float(rng.random())
        for k, lr in enumerate(lrs or []):
            r[f"member{k}/lr"], r[f"member{k}/weight_decay"] = lr, 0.0
        records.append(r)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if folds and not running:
        (run / "folds.json").write_text("{}")
    if running:  # folds.json comes at the end: till then run.json's config says the run is a cross-validation
        (run / "run.json").write_text(
            json.dumps({"config": {"ensemble": {"size": 1, "folds": members if folds else 0}}})
        )
    return {r["epoch"]: r for r in records if r["kind"] == "epoch"}


def drawn(monkeypatch: pytest.MonkeyPatch, target: Path) -> Any:
    """The figure curves_figure draws for ``target`` (kept instead of written; closed figures keep their lines)."""
    kept = []
    monkeypatch.setattr(plot, "_save", lambda fig, path: kept.append(fig))
    curves_figure(target)
    return kept[0]


def lines(ax: Any) -> dict[str, Any]:
    return {str(line.get_label()): line for line in ax.lines}


def test_member_labels_name_the_fold_and_the_values_that_differ(tmp_path: Path) -> None:
    epochs = list(write_run(tmp_path / "sweep", 3, lrs=[0.1, 0.01, 0.1]).values())
    assert member_labels(tmp_path / "sweep", epochs) == {
        0: "member 0 lr=0.1",
        1: "member 1 lr=0.01",
        2: "member 2 lr=0.1",
    }
    epochs = list(write_run(tmp_path / "cv", 5, folds=True).values())
    assert member_labels(tmp_path / "cv", epochs) == {k: f"fold {k}" for k in range(5)}
    one = list(write_run(tmp_path / "one", 0).values())
    assert member_labels(tmp_path / "one", one) == {}
    going = list(write_run(tmp_path / "going", 3, folds=True, running=True).values())
    assert member_labels(tmp_path / "going", going) == {k: f"fold {k}" for k in range(3)}
    seeds = list(write_run(tmp_path / "seeds", 2, running=True).values())
    assert member_labels(tmp_path / "seeds", seeds) == {0: "member 0", 1: "member 1"}


def test_a_member_without_a_swept_value_keeps_its_label(tmp_path: Path) -> None:
    epochs = list(write_run(tmp_path / "sweep", 3, lrs=[0.1, 0.01, 0.1]).values())
    del epochs[-1]["member2/lr"]
    epochs[-1]["member0/weight_decay"] = 1e-4  # the decays differ too
    assert member_labels(tmp_path / "sweep", epochs) == {
        0: "member 0 lr=0.1 weight_decay=0.0001",
        1: "member 1 lr=0.01 weight_decay=0",
        2: "member 2 weight_decay=0",
    }


def test_each_member_is_drawn_beside_the_ensemble_with_its_own_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    epochs = write_run(tmp_path / "run", 3, lrs=[0.2, 0.05, 0.01])
    fig = drawn(monkeypatch, tmp_path / "run")
    loss, acc = lines(fig.axes[1]), lines(fig.axes[2])
    assert np.array_equal(loss["ensemble val"].get_ydata(), [epochs[e]["val/loss"] for e in (1, 2, 3)])
    assert np.array_equal(acc["ensemble test"].get_ydata(), [epochs[e]["test/acc"] for e in (1, 2, 3)])
    for k, lr in enumerate([0.2, 0.05, 0.01]):
        line = loss[f"member {k} lr={lr:g}"]
        assert np.array_equal(line.get_ydata(), [epochs[e][f"member{k}/val/loss"] for e in (1, 2, 3)])
    members_test = [ln for ln in fig.axes[1].lines if ln.get_linestyle() == ":" and ln.get_label().startswith("_")]
    assert sorted(tuple(ln.get_ydata()) for ln in members_test) == sorted(
        tuple(epochs[e][f"member{k}/test/loss"] for e in (1, 2, 3)) for k in range(3)
    )
    assert "(1 run, 3 members)" in fig._suptitle.get_text()


def test_a_cross_validations_own_line_is_out_of_fold_and_many_members_are_one_legend_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_run(tmp_path / "cv", 5, folds=True)
    fig = drawn(monkeypatch, tmp_path / "cv")
    assert {"out-of-fold val", "ensemble test", "fold 0", "fold 4"} <= set(lines(fig.axes[1]))
    assert "(1 run, 5 folds)" in fig._suptitle.get_text()
    many = MEMBER_LABELS + 2
    write_run(tmp_path / "many", many)
    fig = drawn(monkeypatch, tmp_path / "many")
    named = [label for label in lines(fig.axes[1]) if not label.startswith("_")]
    assert sorted(named) == sorted(["ensemble val", "ensemble test", f"members ({many})"])
    assert len(fig.axes[1].lines) == 2 + 2 * many


def test_a_sweeps_members_take_their_runs_colour_unlabelled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_run(tmp_path / "sweep" / "a", 2)
    write_run(tmp_path / "sweep" / "b", 2)
    fig = drawn(monkeypatch, tmp_path / "sweep")
    by_run = [ln for ln in fig.axes[1].lines if not ln.get_label().startswith("_")]
    assert sorted(str(ln.get_label()) for ln in by_run) == ["a test", "a val", "b test", "b val"]
    colours = {str(ln.get_label()).split()[0]: ln.get_color() for ln in by_run}
    members = [ln for ln in fig.axes[1].lines if ln.get_label().startswith("_")]
    assert len(members) == 8 and {ln.get_color() for ln in members} == set(colours.values())
    assert "(2 runs)" in fig._suptitle.get_text()
