"""scripts/fault_campaign.py in small: random SIGINT/SIGTERM/SIGKILL, resumes, a bit-for-bit comparison.

The recorded campaign (docs/reliability.md) has over 100 interruptions; this one keeps CI quick.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_small_random_interruption_campaign_ends_bit_for_bit(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "fault_campaign.py"), "--interruptions", "8", "--seed", "7",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (tmp_path / "campaign.md").read_text()
    assert "bit for bit (metrics records, last.npz, best.npz): yes; problems: 0" in report
