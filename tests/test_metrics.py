"""metrics.jsonl: the writer never masks its own errors, and a resume keeps every good record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import make_cfg, records

from mlptrain.base.errors import OutputError, TrainingInterrupted
from mlptrain.run.metrics import MetricsWriter, plan_prefix, read_metrics
from mlptrain.run.run import train
from mlptrain.step.trainer import Trainer


def _lines(n: int) -> list[bytes]:
    return [json.dumps({"kind": "step", "step": i}).encode() + b"\n" for i in range(n)]


def test_a_damaged_line_is_moved_aside_and_the_records_around_it_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = _lines(106)
    lines[9] = b'{"kind": "step", "st\xff\x00ep": 9, garbage\n'  # line 10: not JSON, not even UTF-8
    path.write_bytes(b"".join(lines))
    plan = plan_prefix(path, 100)  # the checkpoint was written after 100 records
    assert plan.damaged == [(10, lines[9])] and plan.records == 99
    assert path.read_bytes() == b"".join(lines), "planning reads only"
    plan.apply(path)
    kept = read_metrics(path)
    assert [r["step"] for r in kept] == [i for i in range(100) if i != 9], "records on both sides of line 10 kept"
    assert (tmp_path / "metrics.jsonl.corrupt").read_bytes() == lines[9], "the damaged line is kept aside"


def test_a_torn_last_line_is_not_a_record(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(_lines(5)) + b'{"kind": "st')  # killed while writing record 6
    plan = plan_prefix(path, 8)
    assert plan.records == 5 and plan.damaged == [] and plan.torn == b'{"kind": "st'
    plan.apply(path)
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3, 4]


def test_resume_keeps_the_good_records_of_a_file_with_a_damaged_line(tmp_path: Path, monkeypatch: Any) -> None:
    """A run interrupted at step 40 whose line 10 got damaged resumes to the uninterrupted run's records
    minus that one line (kept aside); today's code before this fix kept only the 9 records above it."""
    straight = tmp_path / "straight"
    train(make_cfg(), straight)
    original = Trainer.step

    def stop_at_40(self: Trainer, x: Any, y: Any) -> Any:
        out = original(self, x, y)
        if self.step_count == 40:
            import signal

            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(Trainer, "step", stop_at_40)
    with pytest.raises(TrainingInterrupted):
        train(make_cfg(), tmp_path / "run")
    monkeypatch.undo()
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    lines[9] = b"#### a damaged disk block ####\n"
    metrics.write_bytes(b"".join(lines))
    train(make_cfg(resume="last"), tmp_path / "run")
    want = records(straight)
    del want[9]
    assert records(tmp_path / "run") == want
    assert (tmp_path / "run" / "metrics.jsonl.corrupt").read_bytes() == b"#### a damaged disk block ####\n"


class FullDisk:
    """A file on a full disk: every write, flush and close fails."""

    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        raise OSError(28, "No space left on device")


def test_a_full_disk_is_one_output_error_not_two(tmp_path: Path) -> None:
    """The write fails; closing the file (which flushes again) must not raise over the first error."""
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    writer._f = FullDisk()  # type: ignore[assignment]
    with pytest.raises(OutputError, match=r"cannot write .*metrics.jsonl \(OSError: \[Errno 28\] No space left"):
        with writer:
            writer.write(kind="step", step=0)


def test_a_run_that_cannot_write_its_metrics_stops_with_one_clear_error(tmp_path: Path, monkeypatch: Any) -> None:
    from mlptrain.run import metrics

    real = metrics.MetricsWriter.write
    calls = {"n": 0}

    def write(self: MetricsWriter, **record: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 30:  # the disk fills up under the 30th record
            self._f.close()
            self._f = FullDisk()  # type: ignore[assignment]
        real(self, **record)

    monkeypatch.setattr(metrics.MetricsWriter, "write", write)
    with pytest.raises(OutputError, match="No space left on device"):
        train(make_cfg(checkpoint_steps=10), tmp_path)
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 29
