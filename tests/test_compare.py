"""mlptrain.compare (`python -m mlptrain.compare`): its numbers from hand-written sweeps, its errors, its outputs,
and one real sweep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlptrain.tools import compare

REPO = Path(__file__).resolve().parent.parent


BATCH = 64


def write_run(
    root: Path,
    mode: str,
    seed: int,
    losses: list[float],
    step_ms: list[float | None],
    test_acc: list[float],
    *,
    steps_per_epoch: int = 2,
    summary: bool = True,
    precision: str = "fp32",
    lr: float = 0.05,
    activation: str = "relu",
    device: str = "cpu (NumPy)",
) -> Path:
    """A job directory as train() writes it: run.json and metrics.jsonl with the given numbers.

    ``step_ms[i]`` is the interval time written on step i (None: not the last step of an interval).
    """
    path = root / f"execution={mode},seed={seed}"
    path.mkdir(parents=True)
    config = {
        "model": {"hidden": [16], "activation": activation},
        "data": {"name": "digits", "batch_size": BATCH},
        "optimizer": {"name": "sgd", "lr": lr},
        "execution": {"mode": mode, "bgrad": "auto"},
        "precision": {"name": precision},
        "device": "cpu",
        "seed": seed,
        "log_every": 1,
        "progress": None,
    }
    record = {"mlptrain": "0.1.0", "device": device, "widths": [64, 16, 10], "config": config}
    (path / "run.json").write_text(json.dumps(record))
    lines = []
    for i, (loss, ms) in enumerate(zip(losses, step_ms, strict=True)):
        rec: dict[str, Any] = {"kind": "step", "step": i, "epoch": i // steps_per_epoch, "train/loss": loss}
        if ms is not None:
            rec.update(step_time_ms=ms, samples_per_s=BATCH * 1e3 / ms)
        lines.append(rec)
        if (i + 1) % steps_per_epoch == 0:
            epoch = i // steps_per_epoch
            lines.append({"kind": "epoch", "epoch": epoch, "train/loss": loss, "test/acc": test_acc[epoch]})
    if summary:
        lines.append(
            {"kind": "summary", "steps": len(losses), "wall_s": 1.0, "train/loss": losses[-1], "test/acc": test_acc[-1]}
        )
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


EPS = 2.0**-20  # exactly representable: the relative difference below is exactly 2**-17
FUSED = {0: [1.0, 0.5, 0.25, 0.125 + EPS], 1: [2.0, 1.0, 0.5, 0.25]}
NAIVE = {0: [1.0, 0.5, 0.25, 0.125], 1: [2.0, 1.0, 0.5, 0.25]}
FUSED_MS = {0: [90.0, 2.0, 4.0, 6.0], 1: [90.0, 3.0, 5.0, 7.0]}  # step 0 is warm-up
NAIVE_MS = {0: [80.0, 4.0, 8.0, 12.0], 1: [80.0, 6.0, 10.0, 14.0]}
ACC = {("fused", 0): [0.5, 0.9], ("fused", 1): [0.6, 0.8], ("naive", 0): [0.5, 0.9], ("naive", 1): [0.6, 0.8]}


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    root = tmp_path / "sweep"
    for seed in (0, 1):
        write_run(root, "fused", seed, FUSED[seed], FUSED_MS[seed], ACC["fused", seed])
        write_run(root, "naive", seed, NAIVE[seed], NAIVE_MS[seed], ACC["naive", seed])
    return root


def test_summary_numbers_are_exact(sweep: Path) -> None:
    pairs = compare.load_runs(sweep)
    assert sorted(pairs) == [0, 1] and all(sorted(p) == ["fused", "naive"] for p in pairs.values())
    s = compare.summarize(pairs)
    assert s["max_rel_diff"] == 2.0**-17  # |f - n| / |n| = 2**-20 / 2**-3, at seed 0, step 3
    assert s["max_rel_diff_at"] == {"seed": 0, "step": 3}
    assert s["max_abs_diff"] == EPS
    assert s["tolerance"] == 1e-5 and s["agree"] is True  # 7.6e-6 < 1e-5
    assert s["first_above_tolerance"] is None
    fused, naive = s["modes"]["fused"], s["modes"]["naive"]
    # Medians over the intervals of both seeds, warm-up (step 0) left out: [2, 4, 6, 3, 5, 7] and twice that.
    assert fused["step_time_ms"] == 4.5 and naive["step_time_ms"] == 9.0
    assert fused["timed_intervals"] == 6
    assert s["speedup"] == 2.0
    assert fused["samples_per_s"] == pytest.approx(np.median(BATCH * 1e3 / np.array([2, 4, 6, 3, 5, 7.0])))
    assert fused["test/acc"]["mean"] == pytest.approx(0.85)
    assert fused["test/acc"]["std"] == pytest.approx(np.std([0.9, 0.8], ddof=1))
    assert fused["train/loss"]["per_seed"] == [0.125 + EPS, 0.25]
    assert s["steps"] == 4 and s["epochs"] == 2 and s["seeds"] == [0, 1] and s["precision"] == "fp32"


def test_fp64_tolerance_flags_a_difference(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    write_run(root, "fused", 0, FUSED[0], FUSED_MS[0], ACC["fused", 0], precision="fp64")
    write_run(root, "naive", 0, NAIVE[0], NAIVE_MS[0], ACC["naive", 0], precision="fp64")
    s = compare.summarize(compare.load_runs(root))
    assert s["tolerance"] == 1e-10 and s["agree"] is False
    assert s["first_above_tolerance"] == {"seed": 0, "step": 3}
    assert compare.verdict(s).startswith("DIFFER") and compare.verdict(s).endswith("first at step 3 (seed 0)")


def test_half_precision_is_reported_without_a_tolerance(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    write_run(root, "fused", 0, [1.0, 0.6, 0.4, 0.3], FUSED_MS[0], ACC["fused", 0], precision="bf16")
    write_run(root, "naive", 0, [1.0, 0.5, 0.4, 0.3], NAIVE_MS[0], ACC["naive", 0], precision="bf16")
    s = compare.summarize(compare.load_runs(root))
    assert s["tolerance"] is None and s["agree"] is None
    assert s["max_rel_diff"] == pytest.approx(0.2)
    assert "not step by step" in compare.verdict(s)


def test_intervals_that_cross_an_epoch_are_not_timed(tmp_path: Path) -> None:
    # log_every=3 over epochs of 4 steps: intervals [0-2] (warm-up), [3-5] (crosses into epoch 1), [6-7].
    ms = [None, None, 30.0, None, None, 1.0, None, 5.0]
    path = write_run(tmp_path, "fused", 0, [1.0] * 8, ms, [0.5, 0.6], steps_per_epoch=4)
    run = compare.load_run(path)
    times, sps = run.timed_intervals()
    assert times.tolist() == [5.0]
    assert sps.tolist() == [BATCH * 1e3 / 5.0]


def test_outputs_are_written_and_hold_the_numbers(sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert compare.main([str(sweep), "--out", str(out)]) == 0
    png = (out / "compare.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    md = (out / "compare.md").read_text()
    assert "2.00x" in md  # speedup
    assert "7.63e-06 (seed 0, step 3)" in md  # largest relative difference
    assert "85.00% ± 7.07%" in md  # test accuracy, mean ± std over the two seeds
    assert "| median time per step (ms) | 4.5 | 9 |" in md
    assert "agree" in md and "fp32 tolerance 1e-05" in md
    assert f"python -m mlptrain.compare {sweep} --out {out}" in md
    data = json.loads((out / "compare.json").read_text())
    assert data["speedup"] == 2.0 and data["max_rel_diff"] == 2.0**-17 and data["agree"] is True
    assert not (sweep / "compare.png").exists()  # --out, not the sweep directory


def test_plot_draws_both_modes_over_every_step(sweep: Path, tmp_path: Path) -> None:
    pairs = compare.load_runs(sweep)
    fig = compare.plot(pairs, compare.summarize(pairs), tmp_path / "f.png")
    loss_ax = fig.axes[0]
    lines = {line.get_label(): line for line in loss_ax.get_lines()}
    assert set(lines) == {"fused", "naive"}
    np.testing.assert_array_equal(lines["naive"].get_ydata(), np.mean([NAIVE[0], NAIVE[1]], axis=0))
    assert loss_ax.get_yscale() == "log"
    diff_ax = fig.axes[2]
    assert any(line.get_label() == "fp32 tolerance" for line in diff_ax.get_lines())


def _error(sweep: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert compare.main([str(sweep)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_missing_mode_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "sweep"
    write_run(root, "fused", 0, FUSED[0], FUSED_MS[0], ACC["fused", 0])
    msg = _error(root, capsys)
    assert "no naive run" in msg and str(root) in msg


def test_run_without_summary_is_named(sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = sweep / "execution=naive,seed=1"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # killed before the summary
    msg = _error(sweep, capsys)
    assert str(run) in msg and "no summary" in msg


def test_run_with_fewer_steps_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "sweep"
    write_run(root, "fused", 0, FUSED[0], FUSED_MS[0], ACC["fused", 0])
    short = write_run(root, "naive", 0, NAIVE[0][:2], NAIVE_MS[0][:2], ACC["naive", 0][:1])
    msg = _error(root, capsys)
    assert str(short) in msg and "incomplete" in msg and "2 step" in msg


def test_job_that_failed_before_training_is_named(sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    failed = sweep / "execution=naive,seed=2"
    (failed / ".hydra").mkdir(parents=True)  # Hydra made the job directory, training never started
    msg = _error(sweep, capsys)
    assert str(failed) in msg and "no run.json" in msg


def test_unpaired_seed_and_missing_directory(sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(sweep, "fused", 7, FUSED[0], FUSED_MS[0], ACC["fused", 0])
    msg = _error(sweep, capsys)
    assert "seed 7" in msg and "no naive run" in msg
    msg = _error(tmp_path / "nowhere", capsys)
    assert "does not exist" in msg


def test_runs_of_different_configs_are_not_compared(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    write_run(root, "fused", 0, FUSED[0], FUSED_MS[0], ACC["fused", 0])
    write_run(root, "naive", 0, NAIVE[0], NAIVE_MS[0], ACC["naive", 0], lr=0.1)
    with pytest.raises(compare.CompareError, match=r"differ in optimizer\.lr"):
        compare.load_runs(root)


def test_a_real_sweep_end_to_end(tmp_path: Path) -> None:
    """The CLI's compare config on the CPU: both modes run, and the curves agree within fp32's tolerance."""
    sweep = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "HYDRA_MAIN_MODULE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-m", "mlptrain", "--config-name", "compare", f"hydra.sweep.dir={sweep}"]
        + ["epochs=2", "model.hidden=[16]", "progress=false"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert compare.main([str(sweep)]) == 0
    data = json.loads((sweep / "compare.json").read_text())
    assert data["seeds"] == [0] and data["precision"] == "fp32" and data["log_every"] == 1
    assert data["agree"] is True and data["max_rel_diff"] <= 1e-5
    assert data["steps"] == 2 * 21  # digits: 1294 training samples in batches of 64
    md = (sweep / "compare.md").read_text()
    assert "make compare ARGS='epochs=2 model.hidden=[16] progress=false'" in md


# --------------------------------------------------------------------------- how fast the modes part, and the recipe

H200 = "gpu NVIDIA H200 (CuPy 14.2.0)"


def test_divergence_is_the_first_step_past_each_threshold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "sweep"
    ms = [9.0, 1.0, 1.0, 1.0, 1.0]
    # seed 0: relative differences 0, 5e-4, 2e-2, 0.5, 0; seed 1: 0, then 2e-3 from step 1 on
    fused = {0: [1.0, 1.0005, 1.02, 1.5, 1.0], 1: [1.0, 1.002, 1.002, 1.002, 1.002]}
    for seed in (0, 1):
        kw = {"steps_per_epoch": 5, "precision": "bf16", "device": H200}
        write_run(root, "fused", seed, fused[seed], ms, [0.5], **kw)
        write_run(root, "naive", seed, [1.0] * 5, ms, [0.5], **kw)
    s = compare.summarize(compare.load_runs(root))
    assert s["divergence"] == [
        {"above": 1e-3, "step": 1, "seed": 1, "per_seed": [2, 1]},
        {"above": 1e-2, "step": 2, "seed": 0, "per_seed": [2, None]},
        {"above": 1e-1, "step": 3, "seed": 0, "per_seed": [3, None]},
    ]
    out = tmp_path / "out"
    assert compare.main([str(root), "--out", str(out)]) == 0
    md = (out / "compare.md").read_text()
    assert "| first step where the relative difference passes 0.1 % / 1 % / 10 % (earliest seed) | 1 / 2 / 3 |" in md
    # on a GPU in half precision the table says why the curves part, and when they did
    assert "first differed by more than 1 % at step 2 (seed 0)" in md
    assert "rounded to bf16 (unit roundoff 0.0039" in md and "as different as two seeds" in md
    assert "GELU" not in md  # a ReLU model: no word about the GELU kernels
    assert json.loads((out / "compare.json").read_text())["divergence"][1]["per_seed"] == [2, None]


def test_modes_that_never_part_say_never(sweep: Path) -> None:
    s = compare.summarize(compare.load_runs(sweep))  # at most 2**-17 apart
    assert [d["step"] for d in s["divergence"]] == [None, None, None]
    assert compare.divergence_cells(s) == "never / never / never"


def test_summary_keeps_the_activation_and_the_recipe(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    for mode in compare.MODES:
        write_run(root, mode, 0, NAIVE[0], FUSED_MS[0], ACC[mode, 0], activation="gelu", precision="fp16", device=H200)
    s = compare.summarize(compare.load_runs(root))
    assert s["activation"] == "gelu" and s["optimizer"] == {"name": "sgd", "lr": 0.05}
    assert "64-16-10 gelu, fp16" in compare.title(s)
    note = compare.half_precision_note(s)
    assert "GELU is evaluated by cuBLASLt's epilog in one and by a separate kernel" in note
    assert "never differed by more than 1 %" in note


# --------------------------------------------------------------------------- the GPU recipe: its configs and its script


def test_gpu_comparison_configs_compose() -> None:
    from mlptrain.cli.main import compose_config

    cfg = compose_config(["model.activation=gelu", "precision=fp16"], config_name="compare_gpu")
    assert (cfg.data.name.value, cfg.model.hidden, cfg.model.activation) == ("mnist1d", [256, 256], "gelu")
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.warmup_steps) == ("adamw", 0.01, 100)
    assert cfg.optimizer.schedule.value == "cosine" and cfg.data.batch_size == 128 and cfg.data.drop_last
    assert (cfg.device.value, cfg.graph, cfg.epochs, cfg.precision.name) == ("gpu", True, 30, "fp16")
    speed = compose_config(["precision=bf16"], config_name="compare_gpu_speed")
    assert (speed.data.name.value, speed.model.hidden, speed.data.batch_size) == ("synthetic", [4096] * 3, 8192)
    assert speed.optimizer.name == "adamw" and speed.graph is True and speed.epochs == 1


def test_gpu_recipe_steps_are_as_documented() -> None:
    """conf/compare_gpu.yaml says 28 steps an epoch (840 in all), compare_gpu_speed.yaml 95."""
    pytest.importorskip("mnist1d")
    from mlptrain.cli.main import compose_config
    from mlptrain.data import load_dataset

    cfg = compose_config(["device=cpu", "graph=null", "precision=fp32"], config_name="compare_gpu")
    ds = load_dataset(cfg.data)
    assert len(ds.y_train) // cfg.data.batch_size * cfg.epochs == 840
    speed = compose_config(["device=cpu", "graph=null", "precision=fp32"], config_name="compare_gpu_speed")
    n = speed.data.samples
    test = round(n * speed.data.test_fraction)
    val = round((n - test) * speed.data.val_fraction)
    assert (n - test - val) // speed.data.batch_size == 95


SCRIPT = REPO / "scripts" / "compare.sh"


def _script(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "HYDRA_MAIN_MODULE")}
    env["PYTHON"] = sys.executable
    return subprocess.run(
        ["bash", str(SCRIPT), "--suite", "gpu", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_gpu_script_usage_errors(tmp_path: Path) -> None:
    proc = _script(cwd=tmp_path)
    assert proc.returncode == 2 and "usage: scripts/compare.sh --suite gpu|fp8 OUT_DIR" in proc.stderr
    proc = _script(str(tmp_path / "out"), "--nope", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown option --nope" in proc.stderr
    proc = _script(str(tmp_path / "out"), "--tasks", "wide", cwd=tmp_path)  # an option of the other suite
    assert proc.returncode == 2 and "--tasks is an option of --suite fp8" in proc.stderr
    proc = _script(str(tmp_path / "out"), "--suite", "cpu", cwd=tmp_path)  # the last --suite given wins
    assert proc.returncode == 2 and "unknown suite cpu (expected gpu or fp8)" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_gpu_script_stops_at_once_without_a_gpu(tmp_path: Path) -> None:
    from mlptrain.base.backend import probe_gpu

    if probe_gpu()[0]:
        pytest.skip("a GPU is present: the script would run the whole recipe")
    proc = _script("out", cwd=tmp_path)
    assert proc.returncode == 2 and "cannot start, missing: a GPU" in proc.stderr
    assert not (tmp_path / "out" / "runs").exists()


def test_gpu_script_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    """The recipe in its --smoke form: the sweeps, the reports, the index and the archive, for one panel."""
    pytest.importorskip("mnist1d")
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    args = "out --smoke --activations gelu --precisions fp32 --tar pack/cg.tar.gz -- seed=0".split()
    proc = _script(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    docs = out / "docs" / "compare-gpu"
    data = json.loads((docs / "gelu-fp32" / "compare.json").read_text())
    assert (data["dataset"], data["activation"], data["precision"], data["seeds"]) == ("mnist1d", "gelu", "fp32", [0])
    assert data["agree"] is True and data["max_rel_diff"] == 0.0  # the CPU: both modes make the same BLAS calls
    assert data["optimizer"]["name"] == "adamw" and data["steps"] == 2 * 28
    speed = json.loads((docs / "gelu-fp32" / "speed" / "compare.json").read_text())
    assert speed["dataset"] == "synthetic" and speed["widths"] == [32, 64, 64, 10] and speed["seeds"] == [0]
    md = (docs / "gelu-fp32" / "compare.md").read_text()
    # the recorded commands are the ones to type at the repository's root
    assert "python -m mlptrain.compare runs/compare-gpu/gelu-fp32 --out docs/compare-gpu/gelu-fp32" in md
    index = (docs / "README.md").read_text()
    assert "| [gelu-fp32](gelu-fp32/compare.md) | gelu | fp32 |" in index
    assert "scripts/compare.sh --suite gpu OUT_DIR --smoke --activations 'gelu' --precisions 'fp32' -- seed=0" in index
    assert not list((out / "runs").rglob("checkpoints"))
    assert "finished in" in (out / "compare_gpu.log").read_text()
    import tarfile

    with tarfile.open(tmp_path / "pack" / "cg.tar.gz") as tar:
        names = tar.getnames()
    assert "docs/compare-gpu/README.md" in names and "compare_gpu.log" in names
    assert "docs/compare-gpu/gelu-fp32/speed/compare.png" in names
