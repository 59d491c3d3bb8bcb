"""mlptrain.tools.compare.summary on hand-made runs: the loss differences of fused and naive pairs, and each mode's
numbers pooled over the timed intervals and averaged over the seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlptrain.tools import compare


def _run(mode: str, losses: list[float | None], ms: list[float | None], summary: dict | None = None) -> Any:
    steps = [
        {"kind": "step", "step": i, "epoch": i // 4, "train/loss": v, "step_time_ms": t, "samples_per_s": t and 1e3 / t}
        for i, (v, t) in enumerate(zip(losses, ms, strict=True))
    ]
    record = {"config": {"execution": {"mode": mode}, "seed": 0, "precision": {"name": "fp32"}}}
    return compare.Run(Path(mode), record, steps=steps, summary=summary)


def test_loss_differences_of_hand_made_pairs() -> None:
    from mlptrain.tools.compare.summary import loss_differences

    ms = [None] * 6
    pairs = {
        0: {
            "fused": _run("fused", [1.0, 1.0, 1.05, 2.0, 0.0, None], ms),
            "naive": _run("naive", [1.0, 1.0, 1.0, 1.0, 0.0, None], ms),
        },
        1: {"fused": _run("fused", [1.0, 1.002, 1.0, 1.0, 1.0, 1.0], ms), "naive": _run("naive", [1.0] * 6, ms)},
    }
    d = loss_differences(pairs, tol=1e-5)
    assert d["max_rel_diff"] == pytest.approx(1.0) and d["max_rel_diff_at"] == {"seed": 0, "step": 3}
    assert d["max_abs_diff"] == pytest.approx(1.0)
    assert d["first_above_tolerance"] == {"seed": 1, "step": 1}  # the earliest over the seeds
    by = {e["above"]: e for e in d["divergence"]}
    assert by[1e-3] == {"above": 1e-3, "step": 1, "seed": 1, "per_seed": [2, 1]}
    assert by[1e-2]["per_seed"] == [2, None] and by[1e-1]["per_seed"] == [3, None] and by[1e-1]["seed"] == 0
    assert (
        loss_differences({0: {"fused": _run("fused", [1.0], [None]), "naive": _run("naive", [1.0], [None])}}, None)[
            "first_above_tolerance"
        ]
        is None
    )


def test_mode_numbers_pool_the_timed_intervals_and_average_the_seeds() -> None:
    from mlptrain.tools.compare.summary import mode_numbers

    # steps 0-3 epoch 0, 4-7 epoch 1, timed every 2 steps: the first interval (9 ms) is warm-up and left
    # out, the other three (2, 3, 4 ms) of each seed are pooled
    ms = [None, 9.0, None, 2.0, None, 3.0, None, 4.0]
    runs = [
        _run("fused", [1.0] * 8, ms, {"train/loss": 0.5, "test/loss": 0.6, "test/acc": 0.9, "wall_s": 3}),
        _run("fused", [1.0] * 8, ms, {"train/loss": 0.7, "test/loss": 0.8, "test/acc": 0.8, "wall_s": 4}),
    ]
    out = mode_numbers(runs)
    assert out["test/acc"]["mean"] == pytest.approx(0.85) and out["test/acc"]["std"] == pytest.approx(0.0707107)
    assert out["timed_intervals"] == 6 and out["step_time_ms"] == pytest.approx(3.0)
    assert out["wall_s"] == [3.0, 4.0] and out["step_time_ms_per_seed"] == [3.0, 3.0]
    runs[1].summary = {"train/loss": None}
    assert mode_numbers(runs)["test/acc"] is None
