"""The index of several comparisons (``python -m mlptrain.compare --index``): its links, how the modes differ by
the paired difference over the seeds (Student's t), the running median of its figures, its errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_compare import ACC, FUSED, FUSED_MS, H200, NAIVE, NAIVE_MS, write_run

from mlptrain.tools import compare


def _panel(root: Path, tmp: Path, name: str, precision: str, activation: str, naive_acc: list[float]) -> None:
    """A comparison of two seeds written by compare.main into root/name (fused acc 90% and 80%)."""
    sweep = tmp / f"sweep-{name}"
    for seed in (0, 1):
        kw = {"precision": precision, "activation": activation, "device": H200}
        write_run(sweep, "fused", seed, FUSED[seed], FUSED_MS[seed], [0.5, [0.9, 0.8][seed]], **kw)
        write_run(sweep, "naive", seed, NAIVE[seed], NAIVE_MS[seed], [0.5, naive_acc[seed]], **kw)
    assert compare.main([str(sweep), "--out", str(root / name)]) == 0


def test_index_links_the_panels_and_says_how_the_modes_differ(tmp_path: Path) -> None:
    root = tmp_path / "docs" / "compare-gpu"
    _panel(root, tmp_path, "relu-bf16", "bf16", "relu", [0.7, 0.61])  # naive 19.5 points below, steadily
    _panel(root, tmp_path, "gelu-fp16", "fp16", "gelu", [0.9, 0.8])
    _panel(root, tmp_path, "relu-fp16", "fp16", "relu", [0.9, 0.8])
    speed = tmp_path / "sweep-speed"  # the speed task of relu-bf16: one seed, naive twice as slow
    for mode, ms in (("fused", FUSED_MS[0]), ("naive", NAIVE_MS[0])):
        write_run(speed, mode, 0, NAIVE[0], ms, ACC[mode, 0], precision="bf16", device=H200)
    assert compare.main([str(speed), "--out", str(root / "relu-bf16" / "speed")]) == 0

    assert compare.main(["--index", str(root), "--made-by", "scripts/compare.sh --suite gpu OUT_DIR"]) == 0
    md = (root / "README.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| [")]
    # relu before gelu, fp16 before bf16
    assert [r.split("]")[0][3:] for r in rows] == ["relu-fp16", "relu-bf16", "gelu-fp16"]
    assert rows[1] == (
        "| [relu-bf16](relu-bf16/compare.md) | relu | bf16 | 85.00% ± 7.07% | 65.50% ± 6.36% | +19.50 ± 6.35 pp "
        "| NO | never | 7.63e-06 |"
    )
    assert "| +0.00 ± 0.00 pp | yes |" in rows[0] and "| gelu | fp16 |" in rows[2]
    speed_rows = [line for line in md.splitlines() if line.startswith("| relu-bf16 |") or line.startswith("| gelu")]
    assert speed_rows == [
        "| relu-bf16 | 4.5 | 9 | 2.00x | [4](relu-bf16/speed/compare.md) | 8 | 2.00x |",
        "| gelu-fp16 | 4.5 | 9 | 2.00x | n/a | n/a | n/a |",
    ]
    assert "![fused vs naive, gelu-fp16](gelu-fp16/compare.png)" in md
    assert "[speed task](relu-bf16/speed/compare.md)" in md
    assert "Speed task (for the time per step only): digits 64-16-10, batch 64, sgd at lr 0.05" in md
    assert "each step replayed as one CUDA graph" in md
    # how the two paths differ: the kernels, the reductions, GELU, and what is the same
    for fact in (
        "Different GEMM kernels",
        "round the product before",
        "relu'(0) = 1 in both",
        "GELU by two implementations",
        "| bias gradient | summed over the batch inside an epilog",
        "as different as two runs of one mode with different seeds",
    ):
        assert fact in md, fact
    assert "```\nscripts/compare.sh --suite gpu OUT_DIR\n```" in md


def test_paired_difference_pairs_by_seed_and_uses_students_t() -> None:
    # Seed by seed: +1, +2, -1 points. Mean 0.667, sample sd 1.528, t(2 df) = 4.303.
    d = compare.paired_difference([0.70, 0.72, 0.71], [0.69, 0.70, 0.72])
    assert d["n"] == 3 and d["per_seed"] == pytest.approx([0.01, 0.02, -0.01])
    assert d["mean"] == pytest.approx(0.02 / 3)
    assert d["half_width"] == pytest.approx(4.303 * np.std([0.01, 0.02, -0.01], ddof=1) / np.sqrt(3))
    assert d["contains_zero"] is True
    # Unpaired these accuracies overlap widely; paired, a steady lead of 2 to 3 points is a difference.
    lead = compare.paired_difference([0.72, 0.63, 0.82], [0.70, 0.60, 0.80])
    assert lead["mean"] == pytest.approx(0.07 / 3)
    assert lead["half_width"] == pytest.approx(4.303 * np.std([0.02, 0.03, 0.02], ddof=1) / np.sqrt(3))
    assert lead["contains_zero"] is False
    # What cannot be told is not told: one seed, no spread (unless the modes agree on every seed), NaN.
    assert compare.paired_difference([0.7], [0.6])["contains_zero"] is None
    steady = compare.paired_difference([0.8, 0.9], [0.7, 0.8])
    assert steady["contains_zero"] is None and steady["mean"] == pytest.approx(0.1)
    assert compare.paired_difference([0.8, 0.9], [0.8, 0.9])["contains_zero"] is True
    assert compare.paired_difference([0.8, float("nan")], [0.7, 0.8])["mean"] is None
    assert compare.verdict_cell(steady) == "n/a (no spread over the seeds)"
    assert compare.gap_cell(compare.paired_difference([float("nan")], [0.5])) == "n/a"
    assert [compare.t95(n) for n in (4, 13, 35, 100, 10**6)] == [2.776, 2.160, 2.042, 2.000, 1.980]


def test_running_median_skips_nans_and_keeps_the_length() -> None:
    x = np.array([1.0, 100.0, 2.0, np.nan, 3.0])
    assert compare.running_median(x, 3).tolist() == [1.0, 50.5, 2.0, 51.0, 2.5]
    assert compare.running_median(x, 1)[1] == 100.0


def test_index_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def error(*argv: str) -> str:
        assert compare.main(list(argv)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        return err[0]

    assert "does not exist" in error("--index", str(tmp_path / "nowhere"))
    assert "no comparisons in" in error("--index", str(tmp_path))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "compare.json").write_text("{")
    assert str(tmp_path / "broken" / "compare.json") in error("--index", str(tmp_path))
    with pytest.raises(SystemExit):  # a sweep and an index at once
        compare.main([str(tmp_path), "--index", str(tmp_path)])
    with pytest.raises(SystemExit):  # --note belongs to an index, not to a sweep
        compare.main([str(tmp_path), "--note", str(tmp_path / "note.md")])
    capsys.readouterr()  # argparse's usage lines
    _panel(tmp_path / "idx", tmp_path, "relu-fp16", "fp16", "relu", [0.9, 0.8])
    assert "--note " + str(tmp_path / "missing.md") in error(
        "--index", str(tmp_path / "idx"), "--note", str(tmp_path / "missing.md")
    )
    (tmp_path / "latin1.md").write_bytes("caf\xe9".encode("latin-1"))
    assert "not UTF-8" in error("--index", str(tmp_path / "idx"), "--note", str(tmp_path / "latin1.md"))
    (tmp_path / "note.md").write_text("**Read me** first.")
    assert compare.main(["--index", str(tmp_path / "idx"), "--note", str(tmp_path / "note.md")]) == 0
    md = (tmp_path / "idx" / "README.md").read_text()
    assert md.index("**Read me** first.") < md.index("## Speed")  # after the accuracy table
