"""Data-parallel runs end to end on the CPU (ranks as threads of a LocalGroup), and the launcher's
supervision of worker processes: what NCCL runs carry, checked without GPUs."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import make_cfg, records

from mlptrain.base.errors import ConfigError, TrainingInterrupted
from mlptrain.base.stopping import Stop, StopRequest
from mlptrain.cli import launcher
from mlptrain.config.schema import Device
from mlptrain.distributed.comm import LocalGroup
from mlptrain.distributed.control import EXIT_HUNG, AgreedStop, Watchdog
from mlptrain.run import checkpoint
from mlptrain.run.run import train


def _cfg(**kw):
    base = {"data__batch_size": 63, "precision__name": "fp64", "log_every": 5, "epochs": 2}
    return make_cfg(**{**base, **kw})


def _ranks(world: int, cfg, out: Path, stop_at_flush: dict[int, int] | None = None):
    """Run ``train`` on ``world`` thread ranks into ``out``; returns each rank's result or exception."""
    group = LocalGroup(world, timeout=120)
    results: list = [None] * world

    def rank(r: int) -> None:
        try:
            results[r] = train(cfg, out, comm=group.communicator(r))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


def test_two_ranks_write_one_run_with_the_metrics_of_one_rank(tmp_path):
    """fp64, batch 63 split 32 + 31: rank 0's run directory has the same records as a one-rank run
    (losses to 1e-12; accuracies counted over the global batches), and rank 1 writes nothing there."""
    one = train(_cfg(), tmp_path / "one")
    res = _ranks(2, _cfg(), tmp_path / "two")
    assert all(isinstance(r, dict) for r in res), res
    a, b = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["kind"] for r in a] == [r["kind"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for k, v in ra.items():
            if isinstance(v, float):
                np.testing.assert_allclose(rb[k], v, rtol=1e-12, err_msg=k)
            elif k not in ("summary", "best"):
                assert rb[k] == v, k
    assert res[0]["test/acc"] == one["test/acc"] == res[1]["test/acc"]
    written = sorted(p.name for p in (tmp_path / "two").iterdir())
    assert "metrics.jsonl" in written and "checkpoints" in written
    left = list(Path(os.environ.get("TMPDIR", "/tmp")).glob("mlptrain-rank1-*"))
    assert left == []  # rank 1's private directory is gone


class _AskOnce:
    """A StopRequest stand-in: asks to stop at the ``at``-th read of ``requested`` on thread ``rank1``."""

    def __init__(self, at: int) -> None:
        self.at, self.reads, self.deferred, self.signum = at, 0, False, int(signal.SIGTERM)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def defer(self) -> None:
        self.deferred = True

    @property
    def requested(self) -> bool:
        if threading.current_thread().name != "rank1":
            return False
        self.reads += 1
        return self.reads >= self.at


def test_a_stop_asked_of_one_rank_stops_both_at_the_same_step_and_resumes_on_one(tmp_path, monkeypatch):
    """Rank 1 alone is asked to stop; the ranks agree at the next log interval, rank 0 saves ``last``
    there, and a one-rank resume of that checkpoint finishes with the uninterrupted run's numbers."""
    full = train(_cfg(), tmp_path / "full")
    stops = iter([_AskOnce(3), _AskOnce(3)])
    monkeypatch.setattr("mlptrain.run.run.StopRequest", lambda: next(stops))
    res = _ranks(2, _cfg(), tmp_path / "run")
    assert all(isinstance(r, TrainingInterrupted) for r in res), res
    assert res[0].step == res[1].step == 15  # the third flush: log_every=5
    assert res[0].checkpoint == tmp_path / "run" / "checkpoints" / "last.npz"
    monkeypatch.undo()
    resumed = train(_cfg(resume="last"), tmp_path / "run")  # world 1 continues the world-2 run
    np.testing.assert_allclose(resumed["test/loss"], full["test/loss"], rtol=1e-10)
    assert resumed["test/acc"] == full["test/acc"]
    a = checkpoint.load(tmp_path / "full" / "checkpoints" / "last.npz")
    b = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.npz")
    for k, v in a.arrays.items():
        if k.startswith("param/"):
            np.testing.assert_allclose(b.arrays[k], v, rtol=1e-10, atol=1e-12, err_msg=k)


def test_agreement_is_an_all_reduce_of_the_flags():
    group = LocalGroup(3)
    asked = [False, True, False]
    out: list = [None] * 3

    class Flag:
        def __init__(self, v):
            self.requested, self.signum = v, int(signal.SIGINT)

    def rank(r):
        out[r] = AgreedStop(Flag(asked[r]), group.communicator(r)).agree()

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    [t.start() for t in ts]
    [t.join(10) for t in ts]
    assert out == [True, True, True]


def test_one_process_and_a_rank_stop_through_the_same_protocol():
    """The loop calls ``beat`` and ``agree`` on any stop: a no-op and ``requested`` in one process, the
    watchdog's heart and the all-reduce of the flags for a rank (``mlptrain.base.stopping.Stop``)."""
    one = StopRequest()
    rank = AgreedStop(one, LocalGroup(1).communicator(0))
    assert isinstance(one, Stop) and isinstance(rank, Stop)
    one.beat()
    assert one.agree() is False and rank.agree() is False
    one.requested = True
    assert one.agree() is True and rank.agree() is True and rank.requested
    src = "\n".join(p.read_text() for p in Path(launcher.__file__).parent.rglob("*.py"))
    assert 'hasattr(stop, "beat")' not in src and 'hasattr(self.stop, "' not in src


def test_the_watchdog_aborts_and_exits_when_nothing_moves():
    calls = []
    dog = Watchdog(0.3, rank=1, on_timeout=lambda: calls.append("abort"), exit=lambda code: calls.append(code))
    dog.start()
    time.sleep(1.0)
    assert calls == ["abort", EXIT_HUNG]


def test_the_watchdog_stays_quiet_while_the_heart_beats():
    calls = []
    dog = Watchdog(0.4, rank=0, on_timeout=lambda: calls.append("abort"), exit=lambda code: calls.append(code))
    dog.start()
    for _ in range(10):
        time.sleep(0.1)
        dog.beat()
    dog.stop()
    assert calls == []


def test_more_gpus_than_the_host_has_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "device_count", lambda: 1)
    cfg = _cfg(device=Device.auto, distributed__gpus=2)
    with pytest.raises(ConfigError, match="distributed.gpus=2, but this host has 1 GPU$"):
        launcher.launch(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"distributed__gpus": 2}, "distributed.gpus=2 needs GPUs"),
        ({"distributed__gpus": 0, "device": Device.auto}, "distributed.gpus=0 must be a positive number"),
        ({"distributed__gpus": 4, "device": Device.auto, "data__batch_size": 3}, "must be at least distributed.gpus=4"),
        ({"distributed__timeout_s": 10.0}, r"distributed.timeout_s=10.0 is not used.*applies to data parallel runs"),
    ],
)
def test_distributed_settings_are_checked(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        train(_cfg(**overrides), tmp_path / "run")
    assert not (tmp_path / "run").exists()


# --- the launcher's supervision, with stand-in worker processes ---------------------------------


def _exit_with(code: int, after: float) -> None:
    time.sleep(after)
    sys.exit(code)


def _wait_for_stop(marker: str, stop) -> None:
    os.setpgrp()  # as the real workers
    Path(marker + ".ready").touch()
    deadline = time.monotonic() + 20
    while not stop.value and time.monotonic() < deadline:
        time.sleep(0.01)
    Path(marker).write_text(str(stop.value))
    sys.exit(128 + stop.value if stop.value else 1)


def test_a_rank_that_fails_stops_the_others_within_the_grace_period(monkeypatch):
    monkeypatch.setattr(launcher, "GRACE_S", 1.0)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_exit_with, args=(0, 60.0)), ctx.Process(target=_exit_with, args=(3, 0.2))]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    failure = launcher._supervise(procs)
    assert failure == "rank 1 exited with status 3"
    assert time.monotonic() - t0 < 15
    assert procs[0].exitcode is not None and procs[0].exitcode != 0  # stopped, not left running


def test_ctrl_c_on_the_launcher_reaches_every_rank_once_as_a_shared_stop(tmp_path):
    """The launcher's first signal goes to the ranks through the shared integer (not as a signal: a rank
    that a scheduler also signals directly would take the second for "stop at once"); every rank sees it."""
    ctx = mp.get_context("spawn")
    stop = ctx.Value("i", 0)
    markers = [tmp_path / f"r{r}" for r in range(2)]
    procs = [ctx.Process(target=_wait_for_stop, args=(str(m), stop)) for m in markers]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 60
    while not all(Path(f"{m}.ready").exists() for m in markers) and time.monotonic() < deadline:
        time.sleep(0.05)
    received: list[int] = []
    threading.Timer(0.2, received.append, (int(signal.SIGINT),)).start()
    assert launcher._supervise(procs, stop_timeout=30, stop=stop, received=received) == "stopped by SIGINT"
    assert [m.read_text() for m in markers] == [str(int(signal.SIGINT))] * 2
    assert [p.exitcode for p in procs] == [130, 130]


def test_the_launcher_records_ctrl_c_instead_of_raising_it():
    with launcher._Signals() as received:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
    assert received == [signal.SIGINT]


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.parametrize(("received", "limit"), [([int(signal.SIGINT)], 10), ([int(signal.SIGINT)] * 2, 3)])
def test_ranks_that_do_not_stop_are_killed_after_the_timeout_or_at_a_second_ctrl_c(monkeypatch, received, limit):
    monkeypatch.setattr(launcher, "GRACE_S", 0.5)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_sleep, args=(60,)) for _ in range(2)]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    failure = launcher._supervise(procs, stop_timeout=4.0, stop=ctx.Value("i", 0), received=received)
    assert failure == "stopped by SIGINT"
    took = time.monotonic() - t0
    assert took < limit and (len(received) > 1 or took > 3)  # the timeout waited, the second signal did not
    assert [p.exitcode for p in procs] == [-signal.SIGKILL, -signal.SIGKILL]


def test_rank_0s_error_is_the_runs_error():
    from mlptrain.base.errors import DatasetError

    err = DatasetError("data.path=x.csv: no such file")
    with pytest.raises(DatasetError, match="no such file"):
        launcher._outcome({0: ("error", err), 1: ("ok", {})}, None, [])
    with pytest.raises(Exception, match="rank 1 exited with status 3.*rank 1: RuntimeError: boom"):
        launcher._outcome({1: ("crash", "RuntimeError: boom")}, "rank 1 exited with status 3", [])
    assert launcher._outcome({0: ("ok", {"a": 1}), 1: ("ok", {})}, None, []) == {"a": 1}
    # rank 1 failed first; rank 0, stopped by the launcher's SIGTERM, only says it was interrupted
    with pytest.raises(DatasetError, match="no such file"):
        launcher._outcome(
            {0: ("interrupted", "stopped by SIGTERM", 15), 1: ("error", err)}, "rank 1 exited with status 2", []
        )


def test_adams_per_parameter_state_stays_identical_on_every_rank(tmp_path):
    """adam, whose state is per parameter: the replica check (a digest of every rank's parameters,
    all-reduced) passes after every step; a rank whose parameters drifted by one bit would fail it."""
    cfg = _cfg(optimizer__name="adam", optimizer__lr=1e-3, epochs=1, log_every=1, distributed__verify=True)
    res = _ranks(2, cfg, tmp_path / "run")
    assert all(isinstance(r, dict) for r in res), res
    assert res[0]["steps"] == res[1]["steps"] == 21


def test_replicas_that_differ_by_one_bit_are_caught():
    from mlptrain.base.errors import MlptrainError
    from mlptrain.distributed.control import check_replicas

    group = LocalGroup(2)
    w = np.linspace(-1, 1, 12).reshape(3, 4)
    flipped = w.copy()
    flipped.view(np.uint64)[1, 2] ^= 1  # the last bit of one value
    out: list = [None, None]

    def rank(r, arrays):
        try:
            check_replicas(group.communicator(r), arrays, step=7)
            out[r] = "same"
        except MlptrainError as exc:
            out[r] = str(exc)

    for variant in ({"w": w}, {"w": flipped}):
        ts = [threading.Thread(target=rank, args=(0, {"w": w})), threading.Thread(target=rank, args=(1, variant))]
        [t.start() for t in ts]
        [t.join(10) for t in ts]
        if variant["w"] is w:
            assert out == ["same", "same"]
        else:
            assert out == [f"rank {r}: after step 7 the parameters differ between the ranks" for r in (0, 1)]


def test_verified_thread_ranks_hold_the_same_parameters_at_every_interval(tmp_path):
    res = _ranks(2, _cfg(distributed__verify=True, log_every=1, epochs=1), tmp_path / "run")
    assert all(isinstance(r, dict) for r in res), res
