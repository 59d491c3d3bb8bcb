"""The training loop on the GPU (#31): log intervals written one interval late, with the device's own timing."""

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg, records

from mlptrain.config.schema import Bgrad, Device
from mlptrain.run import checkpoint
from mlptrain.run.loop import Loop
from mlptrain.run.metrics import read_metrics
from mlptrain.run.run import train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_lagged_intervals_write_the_records_of_intervals_written_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: str
) -> None:
    cfg = dict(device=Device.gpu, epochs=3, log_every=4, checkpoint_steps=10, execution__bgrad=Bgrad.bgradb)
    cfg["precision__name"] = precision
    lagged = train(make_cfg(**cfg), tmp_path / "lagged")
    original = Loop.__init__

    def at_once(self: Loop, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        assert self.lagged  # the GPU's default
        self.lagged = False

    monkeypatch.setattr(Loop, "__init__", at_once)
    train(make_cfg(**cfg), tmp_path / "at-once")
    assert lagged["steps"] == 63
    assert records(tmp_path / "lagged") == records(tmp_path / "at-once")
    a = checkpoint.load(tmp_path / "lagged" / "checkpoints" / "last.npz").arrays
    b = checkpoint.load(tmp_path / "at-once" / "checkpoints" / "last.npz").arrays
    assert all(np.array_equal(a[k], b[k]) for k in a)
    timed = [r for r in read_metrics(tmp_path / "lagged" / "metrics.jsonl") if "step_time_ms" in r]
    # CUDA events: a step of this model takes tens of microseconds, never zero, never seconds
    assert timed and all(0 < r["step_time_ms"] < 1000 for r in timed), [r["step_time_ms"] for r in timed]
