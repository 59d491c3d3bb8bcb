"""scripts/fault_campaign.py in small: random SIGINT/SIGTERM/SIGKILL, resumes, a bit-for-bit comparison.

The recorded campaign (docs/reliability.md) has over 100 interruptions; these keep CI quick: the plain
run, and one run of each other scenario (early stopping, TensorBoard, a sweep continued job by job).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def campaign(tmp_path: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "fault_campaign.py"), *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (tmp_path / "campaign.md").read_text()
    assert "bit for bit (metrics records, last.npz, best.npz): yes; problems: 0" in report
    return report


def test_a_small_random_interruption_campaign_ends_bit_for_bit(tmp_path: Path) -> None:
    campaign(tmp_path, "--interruptions", "8", "--seed", "7", "--scenarios", "plain")


@pytest.mark.parametrize("scenario", ["early stopping", "tensorboard", "sweep"])
def test_each_scenario_ends_bit_for_bit(tmp_path: Path, scenario: str) -> None:
    report = campaign(tmp_path, "--interruptions", "1", "--seed", "3", "--scenarios", scenario)
    assert f"| {scenario} |" in report
    if scenario == "tensorboard":
        assert "TensorBoard scalars equal to the uninterrupted run's (logger=tensorboard): 1 of 1 runs" in report
