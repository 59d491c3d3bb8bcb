"""A finished run against the uninterrupted one: bit for bit, and as TensorBoard would show it."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from fault_injection.runs import records, state


def compare(run: Path, reference: Path) -> tuple[list[str], bool | None]:
    """Problems of a finished run against the uninterrupted one, and whether TensorBoard would show the
    same scalars (None without TensorBoard files)."""
    problems = []
    if records(run) != records(reference):
        problems.append(f"{run}: metrics.jsonl differs from the uninterrupted run's")
    for name in ("last", "best"):
        a, b = state(run, name), state(reference, name)
        same = a is not None and b is not None and a[0] == b[0] and a[1].keys() == b[1].keys()
        if not same or not all(np.array_equal(a[1][k], b[1][k]) for k in b[1]):
            problems.append(f"{run}: {name}.npz differs from the uninterrupted run's")
    if (run / "metrics.jsonl.corrupt").exists() or list(run.rglob("*.tmp")):
        problems.append(f"{run}: a .corrupt or .tmp file is left")
    if not (reference / "tensorboard").is_dir():
        return problems, None
    same = tensorboard_scalars(run) == tensorboard_scalars(reference)
    if not same:
        problems.append(f"{run}: the TensorBoard scalars differ from the uninterrupted run's")
    return problems, same


def tensorboard_scalars(run: Path) -> dict[tuple[str, int], float]:
    """The scalars TensorBoard shows for ``run``: its event files read in the order they were started,
    a writer's ``purge_step`` (a START session log) dropping the earlier events from that step on."""
    from tensorboardX.proto import event_pb2

    files = []
    for path in (run / "tensorboard").glob("events.out.tfevents.*"):
        data, i, events = path.read_bytes(), 0, []
        while i + 12 <= len(data):  # TFRecord: length (8), its CRC (4), the record, its CRC (4)
            (n,) = struct.unpack("<Q", data[i : i + 8])
            if i + 16 + n > len(data):  # torn by a kill
                break
            events.append(event_pb2.Event.FromString(data[i + 12 : i + 12 + n]))
            i += 16 + n
        files.append(events)
    scalars: dict[tuple[str, int], float] = {}
    for events in sorted(files, key=lambda evs: evs[0].wall_time if evs else 0.0):
        for ev in events:
            if ev.HasField("session_log") and ev.session_log.status == event_pb2.SessionLog.START:
                scalars = {k: v for k, v in scalars.items() if k[1] < ev.step}
            for v in ev.summary.value:
                if not v.tag.endswith("samples_per_s"):  # a timing
                    scalars[(v.tag, ev.step)] = v.simple_value
    return scalars
