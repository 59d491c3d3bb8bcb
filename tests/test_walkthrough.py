"""scripts/walkthrough.py runs to the end and prints what docs/tutorial.md says it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_walkthrough_runs_on_the_cpu(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds the checkout itself
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "walkthrough.py"), "--device", "cpu"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for line in (
        "== 0. device: cpu (NumPy); GEMM engine: NumpyGemm",
        "result Z^T: shape (12, 4) float32, F-contiguous (column-major), strides (4, 48) bytes",
        "y = Z^T.T:  shape (4, 12) float32, C-contiguous (row-major), strides (48, 4) bytes",
        "y and Z^T share memory: True",
        "relu_aux:   shape (16, 4) uint8, F-contiguous (column-major), strides (1, 16) bytes",
        "Mb = round_up(ceil(M / 8), 16) = round_up(ceil(12 / 8), 16) = 16; N = B = 4",
        "unpack_relu_mask(relu_aux).T equals the naive bool mask: True",
        "db0 (DRELU_BGRAD)",
        "db0 (BGRADB in the wgrad GEMM)",
        "walkthrough: all fused results matched naive",
    ):
        assert line in out, f"missing {line!r} in:\n{out}"
    # The bit dump: 12 rows, one per output feature of sample 0, each bit equal to the sign of z.
    rows = [
        ln.split() for ln in out.splitlines() if ln.strip().split(" ")[0].isdigit() and ("True" in ln or "False" in ln)
    ]
    assert len(rows) == 12
    for i, (idx, z, positive, byte, bit, aux_bit) in enumerate(rows):
        assert (int(idx), int(byte), int(bit)) == (i, i // 8, i % 8)
        assert positive == str(float(z) >= 0) and int(aux_bit) == (positive == "True")
    # Fused and naive trained alike and the loss went down.
    (rel,) = [
        ln.rsplit(": ", 1)[1] for ln in out.splitlines() if "largest relative loss difference over 30 steps" in ln
    ]
    assert float(rel) <= 1e-5
    assert "the loss went down from" in out
