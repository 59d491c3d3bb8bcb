"""Where a run's wall clock goes, from the process's start to its summary (issue #31).

A training step can be at the hardware's limit while the run around it is not: a run of a few
seconds' steps can spend as long again importing, composing its config, starting CUDA, loading its
data and planning its GEMMs. The run keeps one :class:`Timeline` of those phases, in the order they
happen, each ended by :meth:`Timeline.mark`::

    python    the interpreter's own start-up, until ``python -m mlptrain`` runs its first line
    imports   Hydra, OmegaConf and mlptrain's command line imported
    config    Hydra's compose and the config checked
    backend   CuPy and nvmath imported, the CUDA context made (the kernels start compiling on threads)
    data      the dataset read, checked, split and put where the loader reads it
    model     the parameters, the GEMM plans' objects, the loaders, the optimizer
    bgrad     the measured bias-gradient choice (``execution.bgrad=auto`` on the GPU; cached per shape)
    accept    the run directory written (run.json, Hydra's files, the log)
    loop      the epochs: steps, evaluation, checkpoints (:meth:`Timeline.part` splits it)

The loop's parts are what it spent evaluating, saving checkpoints (queuing them and waiting for the
writer thread), taking its first steps (the uncaptured warm-up steps and the CUDA graphs' capture:
:data:`FIRST_STEPS`), and ``training``: the rest, the steps and the host's work between them (log
intervals, progress bars). The run writes the timeline into ``run.json`` (``timeline``) and logs it
in one line at the end; ``benchmarks/bench_run.py`` reads it.

``python -m mlptrain`` marks the process's phases on :data:`PROCESS`; :func:`mlptrain.run.run.train`
called from Python starts a timeline of its own at the call, and :func:`active` makes it the one
that :func:`mark` and :func:`part` add to.

The process's start is read from ``/proc/self/stat`` (Linux, 10 ms ticks); elsewhere the timeline
starts when this module is imported, and the ``python`` phase is absent.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

# Steps of a run's first epoch counted as its "first steps": two uncaptured warm-up steps and the step that
# captures the graph (mlptrain.step.cuda.graph.GraphedStep's warmup=2), the short last batch's capture ahead included.
FIRST_STEPS = 3


def _process_start() -> float | None:
    """The process's start as a ``time.perf_counter()`` value (Linux), else None."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: starttime, in ticks since boot
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    age = uptime - started
    return time.perf_counter() - age if 0.0 <= age < 3600.0 else None


class Timeline:
    """Phases of a run ended one after another (:meth:`mark`), and the loop's parts (:meth:`part`)."""

    def __init__(self, start: float | None = None) -> None:
        self.start = start if start is not None else time.perf_counter()
        self.from_process_start = start is not None
        self.last = self.start
        self.phases: dict[str, float] = {}  # name -> seconds, in the order they ended
        self.parts: dict[str, float] = {}  # the loop's parts: evaluate, save, first steps

    def mark(self, name: str) -> float:
        """End phase ``name`` now (it began where the last one ended); returns its seconds. A phase marked
        again (a multirun's second job) adds to what it had."""
        now = time.perf_counter()
        took = now - self.last
        self.phases[name] = self.phases.get(name, 0.0) + took
        self.last = now
        return took

    def skip(self) -> None:
        """Start the next phase now: what passed since the last mark belongs to no phase (between jobs)."""
        self.last = time.perf_counter()

    def part(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to the loop's part ``name`` (``evaluate``, ``save``, ``first steps``)."""
        self.parts[name] = self.parts.get(name, 0.0) + seconds

    def record(self) -> dict[str, Any]:
        """What ``run.json`` holds: seconds per phase, the loop's parts, and the total so far."""
        parts = dict(self.parts)
        if "loop" in self.phases and parts:
            parts["training"] = max(self.phases["loop"] - sum(parts.values()), 0.0)
        return {
            "from_process_start": self.from_process_start,
            "phases_s": {k: round(v, 4) for k, v in self.phases.items()},
            "loop_s": {k: round(v, 4) for k, v in parts.items()},
            "total_s": round(self.last - self.start, 4),
        }

    def describe(self) -> str:
        """``3.71 s: python 0.04 s, imports 0.61 s, ... loop 1.21 s (evaluate 0.10 s, ..., training 0.52 s)``."""
        rec = self.record()
        words = [f"{k} {v:.2f} s" for k, v in rec["phases_s"].items()]
        if rec["loop_s"] and words and "loop" in rec["phases_s"]:
            inner = ", ".join(f"{k} {v:.2f} s" for k, v in rec["loop_s"].items())
            words[list(rec["phases_s"]).index("loop")] += f" ({inner})"
        return f"{rec['total_s']:.2f} s: " + ", ".join(words)


# The process's timeline: python -m mlptrain marks its phases on it, the first job of the process runs on it.
PROCESS = Timeline(_process_start())
_active: Timeline | None = None


@contextlib.contextmanager
def active(timeline: Timeline) -> Iterator[Timeline]:
    """Make ``timeline`` the one :func:`mark` and :func:`part` add to, for the ``with`` block (a run)."""
    global _active
    before, _active = _active, timeline
    try:
        yield timeline
    finally:
        _active = before


def current() -> Timeline | None:
    """The active run's timeline, or None."""
    return _active


def mark(name: str) -> None:
    """End phase ``name`` of the active run's timeline (none active: nothing)."""
    if _active is not None:
        _active.mark(name)


def part(name: str, seconds: float) -> None:
    """Add ``seconds`` to the loop's part ``name`` on the active run's timeline (none active: nothing)."""
    if _active is not None:
        _active.part(name, seconds)


@contextlib.contextmanager
def timed(name: str) -> Iterator[None]:
    """Add the ``with`` block's seconds to the loop's part ``name`` (:func:`part`)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        part(name, time.perf_counter() - start)
