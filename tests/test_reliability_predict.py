"""Issue #47, the commands after training (predict, evaluate, plot): what a new user and an adversarial
pass found, each case held here (see docs/reliability.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlptrain.plot import main as plot_main


def _run_dir(folder: Path) -> Path:
    """A run folder with a small ``metrics.jsonl`` (steps and epochs), as training writes it."""
    folder.mkdir(parents=True)
    records = [{"kind": "step", "step": s, "train/loss": 1.0 / s} for s in range(1, 5)]
    records += [{"kind": "epoch", "epoch": e, "val/loss": 0.5 / e, "val/acc": 0.5 + 0.1 * e} for e in (1, 2)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


@pytest.mark.parametrize(
    ("name", "make", "message"),
    [
        ("data.csv", lambda d: (d / "data.csv").write_text("a,label\n1,0\n"), "expected the name of an image file"),
        ("run/metrics.jsonl", lambda d: None, "expected the name of an image file"),
        ("data.png", lambda d: (d / "data.png").write_text("a,label\n1,0\n"), "exists and is not an image"),
        ("link.png", lambda d: (d / "link.png").symlink_to(d / "run/metrics.jsonl"), "is the metrics of the run"),
        ("run/checkpoints/best.png", lambda d: (d / "run/checkpoints").mkdir(), "in a checkpoints/ folder"),
    ],
)
def test_plot_out_is_an_image_and_never_an_input_or_another_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, make, message: str
) -> None:
    pytest.importorskip("matplotlib")
    run = _run_dir(tmp_path / "run")
    make(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert plot_main([str(run), "--out", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --out={tmp_path / name}") and message in err[0], err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing written or replaced


@pytest.mark.parametrize(("suffix", "magic"), [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF-")])
def test_plot_writes_the_image_format_its_name_says_and_replaces_an_image(tmp_path: Path, suffix: str, magic: bytes):
    pytest.importorskip("matplotlib")
    run = _run_dir(tmp_path / "run")
    out = tmp_path / f"curves{suffix}"
    assert plot_main([str(run), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(magic)
    assert plot_main([str(run), "--out", str(out)]) == 0  # an earlier figure may be replaced


def test_plot_names_the_file_and_line_of_a_binary_metrics_jsonl(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    run = _run_dir(tmp_path / "run")
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\xfe\x00garbage\n")
    assert plot_main([str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    byte = len((run / "metrics.jsonl").read_bytes()) - 11  # where the bad line starts
    assert err == [
        f"error: {run / 'metrics.jsonl'}: line 7 is not UTF-8 text (byte {byte}); expected the JSON lines "
        "of a run's metrics"
    ]
