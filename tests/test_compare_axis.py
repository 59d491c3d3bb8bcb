"""mlptrain.compare across another axis than the execution mode (issue #30's fp8 vs bf16): the axis
found in the runs' configs or named, the refusal of ambiguous sweeps, the paired accuracy difference's
95 % interval against half a point, the report's lines, and scripts/compare.sh --suite fp8."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlptrain.tools import compare
from mlptrain.tools.compare.results import results_markdown

REPO = Path(__file__).resolve().parent.parent
LOSSES = [1.0, 0.5, 0.25, 0.125]
MS = [90.0, 2.0, 4.0, 6.0]
# Final test accuracies by seed: fp8 - bf16 = +0.1, -0.2, +0.3, 0.0, +0.1 points.
BF16_ACC = [0.700, 0.712, 0.690, 0.705, 0.698]
FP8_ACC = [0.701, 0.710, 0.693, 0.705, 0.699]


def write_run(root: Path, seed: int, acc: float, **config: Any) -> Path:
    """A finished job directory (run.json, metrics.jsonl): 4 steps in 2 epochs; ``config`` sets
    ``precision``, ``mode`` and ``lr`` (default bf16, fused, 0.05)."""
    precision, mode, lr = config.get("precision", "bf16"), config.get("mode", "fused"), config.get("lr", 0.05)
    path = root / f"precision={precision},mode={mode},lr={lr},seed={seed}"
    path.mkdir(parents=True)
    cfg = {
        "model": {"hidden": [16], "activation": "relu"},
        "data": {"name": "digits", "batch_size": 64},
        "optimizer": {"name": "adamw", "lr": lr, "weight_decay": config.get("weight_decay", 0.01)},
        "execution": {"mode": mode, "bgrad": "auto"},
        "precision": {"name": precision, "amax_history": 16},
        "device": "gpu",
        "seed": seed,
        "log_every": 1,
        "progress": None,
    }
    record = {"mlptrain": "0.1.0", "device": "gpu NVIDIA H200", "widths": [64, 16, 10], "config": cfg}
    (path / "run.json").write_text(json.dumps(record))
    lines: list[dict[str, Any]] = []
    for i, (loss, ms) in enumerate(zip(LOSSES, MS, strict=True)):
        lines.append(
            {"kind": "step", "step": i, "epoch": i // 2, "train/loss": loss * (1 + 0.01 * (precision == "fp8"))}
        )
        lines[-1].update(step_time_ms=ms, samples_per_s=64e3 / ms)
        if i % 2 == 1:
            lines.append({"kind": "epoch", "epoch": i // 2, "train/loss": loss, "test/acc": acc})
    lines.append({"kind": "summary", "steps": 4, "wall_s": 1.0, "train/loss": LOSSES[-1], "test/acc": acc})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


@pytest.fixture
def fp8_sweep(tmp_path: Path) -> Path:
    root = tmp_path / "sweep"
    for seed, (a8, a16) in enumerate(zip(FP8_ACC, BF16_ACC, strict=True)):
        write_run(root, seed, a8, precision="fp8")
        write_run(root, seed, a16, precision="bf16")
    return root


def test_precision_is_found_as_the_axis(fp8_sweep: Path) -> None:
    pairs = compare.load_runs(fp8_sweep)
    assert sorted(pairs) == [0, 1, 2, 3, 4] and all(list(p) == ["fp8", "bf16"] for p in pairs.values())
    assert all(p["fp8"].precision == "fp8" and p["bf16"].precision == "bf16" for p in pairs.values())
    s = compare.summarize(pairs)
    assert s["axis"] == {"key": "precision.name", "name": "precision", "arms": ["fp8", "bf16"]}
    assert set(s["modes"]) == {"fp8", "bf16"} and s["precision"] == "fp8"
    assert s["tolerance"] is None and s["agree"] is None  # two precisions have no exact contract
    assert s["paired"]["test/acc"]["per_seed"] == pytest.approx([0.001, -0.002, 0.003, 0.0, 0.001])
    assert s["max_rel_diff"] == pytest.approx(0.01)


def test_a_named_axis_sets_the_order_and_the_sign(fp8_sweep: Path) -> None:
    pairs = compare.load_runs(fp8_sweep, "precision=bf16,fp8")
    assert list(pairs[0]) == ["bf16", "fp8"]
    s = compare.summarize(pairs)
    assert s["axis"]["arms"] == ["bf16", "fp8"]
    assert s["paired"]["test/acc"]["mean"] == pytest.approx(-0.0006)
    assert list(compare.load_runs(fp8_sweep, "precision")[0]) == ["fp8", "bf16"]  # the known order
    with pytest.raises(compare.CompareError, match=r"run .*precision=bf16.* has precision\.name='bf16'; expected one"):
        compare.load_runs(fp8_sweep, "precision=fp8,fp16")
    with pytest.raises(compare.CompareError, match=r"--axis precison: the runs' configs have no key 'precison'"):
        compare.load_runs(fp8_sweep, "precison")
    with pytest.raises(compare.CompareError, match=r"expected KEY or KEY=CANDIDATE,REFERENCE"):
        compare.load_runs(fp8_sweep, "precision=fp8")


def test_ambiguous_axes_are_refused_with_the_keys_named(tmp_path: Path) -> None:
    # precision and execution mode both vary: two known axes, no way to tell which is compared
    root = tmp_path / "two"
    write_run(root, 0, 0.7, precision="fp8", mode="fused")
    write_run(root, 0, 0.7, precision="bf16", mode="naive")
    with pytest.raises(compare.CompareError) as err:
        compare.load_runs(root)
    msg = str(err.value)
    assert "differ in 2 keys besides the seed" in msg and "execution.mode ('" in msg and "precision.name ('" in msg
    assert "--axis KEY" in msg and str(root) in msg
    # two keys that are no known axis: the same refusal
    root = tmp_path / "lr-wd"
    write_run(root, 0, 0.7, lr=0.1, weight_decay=0.0)
    write_run(root, 0, 0.7, lr=0.2, weight_decay=0.1)
    with pytest.raises(compare.CompareError, match=r"differ in 2 keys besides the seed: optimizer\.lr"):
        compare.load_runs(root)
    # precision the axis, another key differing too: named as what must not vary
    root = tmp_path / "extra"
    write_run(root, 0, 0.7, precision="fp8", lr=0.1)
    write_run(root, 0, 0.7, precision="bf16", lr=0.2)
    with pytest.raises(compare.CompareError, match=r"differ in optimizer\.lr .*may vary only precision and seed"):
        compare.load_runs(root)


def test_one_other_key_is_an_axis_and_no_key_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "lr"
    write_run(root, 0, 0.70, lr=0.1)
    write_run(root, 0, 0.72, lr=0.05)
    s = compare.summarize(compare.load_runs(root))
    assert s["axis"] == {"key": "optimizer.lr", "name": "optimizer.lr", "arms": ["0.05", "0.1"]}
    root = tmp_path / "same"
    write_run(root, 0, 0.7, precision="fp8")
    write_run(root, 1, 0.7, precision="fp8")
    with pytest.raises(compare.CompareError, match=r"no naive run .*nothing to compare"):
        compare.load_runs(root)


def test_t_interval_of_the_paired_difference_against_a_hand_computation() -> None:
    # d = +0.1, -0.2, +0.3, 0.0, +0.1 points: mean 0.06; squared deviations 1.6, 67.6, 57.6, 3.6, 1.6 (x1e-3
    # points^2... in accuracy units x1e-7): sum 1.32e-5, variance 1.32e-5 / 4 = 3.3e-6, sd 1.81659e-3;
    # t(0.975, 4 dof) = 2.776; half-width 2.776 * 1.81659e-3 / sqrt(5) = 2.25523e-3.
    gap = compare.paired_difference(FP8_ACC, BF16_ACC)
    assert gap["n"] == 5 and gap["mean"] == pytest.approx(6e-4)
    assert gap["half_width"] == pytest.approx(2.776 * math.sqrt(3.3e-6) / math.sqrt(5), rel=1e-9)
    assert gap["half_width"] == pytest.approx(2.25523e-3, rel=1e-5)
    eq = compare.interval_within(gap, compare.ACCURACY_BOUND)
    assert eq["low"] == pytest.approx(6e-4 - 2.25523e-3, rel=1e-5) and eq["high"] == pytest.approx(2.85523e-3, rel=1e-5)
    assert eq["inside"] is True and eq["bound"] == 0.005
    # mean +0.5 points: the interval crosses the bound; a tighter bound fails the same interval
    far = compare.paired_difference([0.744, 0.746, 0.745, 0.747, 0.743], [0.74] * 5)
    assert compare.interval_within(far, 0.005)["inside"] is False
    assert compare.interval_within(gap, 0.002)["inside"] is False
    assert compare.interval_within(compare.paired_difference([0.7], [0.6]), 0.005)["inside"] is None
    assert compare.interval_within(None, 0.005) == {"bound": 0.005, "low": None, "high": None, "inside": None}
    assert (compare.t95(1), compare.t95(4), compare.t95(29)) == (12.706, 2.776, 2.045)


def test_the_report_says_whether_the_interval_is_inside_half_a_point(fp8_sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert compare.main([str(fp8_sweep), "--axis", "precision=fp8,bf16", "--out", str(out)]) == 0
    md = (out / "compare.md").read_text()
    assert md.startswith("# fp8 vs bf16: digits 64-16-10 relu, batch 64, gpu NVIDIA H200, 5 seeds\n")
    assert "| precision, 4 steps, 2 epochs | fp8 | bf16 |" in md
    assert "| final test accuracy, fp8 - bf16 paired by seed (95 % interval) | +0.06 ± 0.23 pp" in md
    row = "| 95 % interval of fp8 - bf16 (final test accuracy, paired by seed) "
    assert row + "| [-0.17, +0.29] pp, inside ± 0.5 pp: yes | |" in md
    assert "| speedup (bf16 / fp8 median time per step) | 1.00x |" in md
    assert "e4m3" in md and "e5m2" in md and "docs/compare-fp8/README.md" in md
    data = json.loads((out / "compare.json").read_text())
    assert data["equivalence"]["inside"] is True and data["axis"]["arms"] == ["fp8", "bf16"]
    table = results_markdown({"mnist1d": data})
    assert (
        "| [mnist1d](mnist1d/compare.md) | digits 64-16-10, batch 64 | 4 x 5 | 70.16% ± 0.64% | 70.10% ± 0.82% |"
        in table
    )
    assert "| +0.06 ± 0.23 pp | [-0.17, +0.29] pp, inside ± 0.5 pp: yes |" in table


def test_a_fused_vs_naive_report_gets_no_new_row(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    for seed, acc in enumerate(BF16_ACC[:3]):
        write_run(root, seed, acc, mode="fused")
        write_run(root, seed, acc + 0.001, mode="naive")
    assert compare.main([str(root), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "compare.md").read_text()
    assert (
        md.startswith("# fused vs naive: digits 64-16-10 relu, bf16, batch 64,")
        and "| bf16, 4 steps, 2 epochs | fused | naive |" in md
    )
    assert "95 % interval of" not in md and "| tolerance (bf16) |" in md


# --------------------------------------------------------------------------- the recipe and its script


def test_fp8_configs_sweep_the_precision_and_hold_the_execution() -> None:
    from omegaconf import OmegaConf

    from mlptrain.cli.main import compose_config

    for name, data, hidden in (("compare_fp8", "mnist1d", [256, 256]), ("compare_fp8_wide", "synthetic", [4096] * 3)):
        params = OmegaConf.load(REPO / "conf" / f"{name}.yaml").hydra.sweeper.params
        assert (params.execution, params.precision, params.seed) == ("fused", "bf16,fp8", "0,1,2,3,4")
        cfg = compose_config(["precision=fp8"], config_name=name)
        assert (cfg.data.name.value, cfg.model.hidden, cfg.precision.name, cfg.graph) == (data, hidden, "fp8", True)
    wide = compose_config([], config_name="compare_fp8_wide")
    n = wide.data.samples
    test = round(n * wide.data.test_fraction)
    val = round((n - test) * wide.data.val_fraction)
    assert test == 40000 and (n - test - val) // wide.data.batch_size * wide.epochs == 273  # as the config says


SCRIPT = REPO / "scripts" / "compare.sh"


def _script(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "HYDRA_MAIN_MODULE")}
    env["PYTHON"] = sys.executable
    return subprocess.run(
        ["bash", str(SCRIPT), "--suite", "fp8", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_fp8_script_usage_errors(tmp_path: Path) -> None:
    proc = _script(cwd=tmp_path)
    assert proc.returncode == 2 and "usage: scripts/compare.sh --suite gpu|fp8 OUT_DIR" in proc.stderr
    proc = _script(str(tmp_path / "out"), "--tasks", "mnist", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown task mnist" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_fp8_script_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    """--smoke for MNIST-1D: fp8 (emulated) against fp32, two seeds, the report and the results table."""
    pytest.importorskip("mnist1d")
    pytest.importorskip("matplotlib")
    proc = _script("out", "--smoke", "--tasks", "mnist1d", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    docs = tmp_path / "out" / "docs" / "compare-fp8"
    data = json.loads((docs / "mnist1d" / "compare.json").read_text())
    assert data["axis"]["arms"] == ["fp8", "fp32"] and data["seeds"] == [0, 1] and data["steps"] == 2 * 28
    assert data["max_rel_diff"] > 1e-3  # fp8 rounds the 256 x 256 layer's operands: the runs differ
    md = (docs / "mnist1d" / "compare.md").read_text()
    assert (
        "python -m mlptrain.compare runs/compare-fp8/mnist1d --axis precision=fp8,fp32 --out docs/compare-fp8/mnist1d"
        in md
    )
    assert "inside ± 0.5 pp" in (docs / "results.md").read_text()
    assert not list((tmp_path / "out" / "runs").rglob("checkpoints"))


def test_the_large_mnist1d_task_is_the_mnist1d_recipe_on_50000_samples() -> None:
    from omegaconf import OmegaConf

    from mlptrain.cli.main import compose_config

    params = OmegaConf.load(REPO / "conf" / "compare_fp8_mnist1d_50k.yaml").hydra.get("sweeper")
    assert params is None  # the sweep lists are compare_fp8.yaml's
    base, large = (
        compose_config([], config_name="compare_fp8"),
        compose_config([], config_name="compare_fp8_mnist1d_50k"),
    )
    assert (base.data.samples, large.data.samples) == (None, 50000)
    large.data.samples = None
    assert large == base  # nothing else differs
    train = 50000 * 4 // 5 - round(50000 * 4 // 5 * base.data.val_fraction)
    assert train // base.data.batch_size * base.epochs == 8430  # as the config and the script say


def test_fp8_script_runs_the_large_mnist1d_task_on_the_cpu(tmp_path: Path) -> None:
    """--smoke --tasks mnist1d-50k: its config, its folders, a 10,000-sample draw for 2 epochs."""
    pytest.importorskip("mnist1d")
    pytest.importorskip("matplotlib")
    proc = _script("out", "--smoke", "--tasks", "mnist1d-50k", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    docs = tmp_path / "out" / "docs" / "compare-fp8"
    data = json.loads((docs / "mnist1d-50k" / "compare.json").read_text())
    assert data["axis"]["arms"] == ["fp8", "fp32"] and data["seeds"] == [0, 1] and data["steps"] == 2 * 56
    assert "--config-name compare_fp8_mnist1d_50k" in (tmp_path / "out" / "compare_fp8.log").read_text()
    assert "[mnist1d-50k](mnist1d-50k/compare.md)" in (docs / "results.md").read_text()
    assert not list((tmp_path / "out" / "runs").rglob("checkpoints"))
