"""``python -m mlptrain distributed.gpus=N``: one training process per GPU of this host.

The layer above the run: the launcher starts processes that each call :func:`mlptrain.run.run.train`,
which runs data parallelism (:mod:`mlptrain.distributed`, below it). Only the CLI imports this module;
nothing in :mod:`mlptrain.distributed` does (``tests/test_architecture.py``).

The launching process (the Hydra job) makes NCCL's unique id and starts ``N`` worker processes
(``multiprocessing``'s spawn: a fresh interpreter each, as CUDA requires), handing each its rank and
the id; each selects GPU ``rank``, joins the NCCL communicator and runs :func:`mlptrain.run.run.train`
with it. Rank 0 writes the run directory; the others write nothing there. Then the launcher:

* waits, and reports rank 0's result (its summary, or its error, as a run on one GPU would);
* stops the others when a rank fails: SIGTERM, then SIGKILL after a grace period, and reports
  which rank failed and how (a rank that hung is ended by its own watchdog,
  :mod:`mlptrain.distributed.control`);
* forwards Ctrl-C and SIGTERM once to every rank (the workers are in their own process groups, so
  a terminal's Ctrl-C reaches them only through the launcher, once): they agree on a step, rank 0
  saves ``last`` there, and the launcher exits as a run on one GPU does.

Under ``torchrun`` or ``mpirun`` every process is a launched rank already: :func:`join` makes its
communicator, with the id passed through torchrun's store or over
:func:`mlptrain.distributed.launch.rendezvous` (:func:`mlptrain.distributed.launch.exchange_id`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from mlptrain.base.errors import ConfigError, DeviceError, Interrupted, MlptrainError
from mlptrain.distributed.comm import Communicator
from mlptrain.distributed.launch import DistEnv, exchange_id

log = logging.getLogger(__name__)

GRACE_S = 10.0  # after a rank failed, how long the others get to stop before SIGKILL


def device_count() -> int:
    """GPUs on this host (0 without CuPy or a driver)."""
    try:
        from mlptrain.distributed.cuda.nccl import device_count as count

        return count()
    except Exception:
        return 0


def launch(
    cfg: Any, out_dir: Path, *, accept_files: dict[str, str] | None = None, overrides: list[str] | None = None
) -> dict[str, Any]:
    """Train ``cfg`` on ``cfg.distributed.gpus`` GPUs of this host; returns rank 0's summary.

    Args:
        accept_files: files rank 0 writes into ``out_dir`` once its run is accepted (the CLI's
            ``.hydra/`` configs, path -> text), with ``mlptrain.log`` opened then too.
        overrides: the CLI's overrides, for every rank's :func:`mlptrain.run.run.train` (what the user set).

    Raises:
        ConfigError: more GPUs asked for than this host has.
        Interrupted: Ctrl-C or SIGTERM (rank 0 saved ``last``: the message says where).
        MlptrainError: rank 0's error, or a rank that failed (named, with its exit status).
    """
    world = cfg.distributed.gpus
    have = device_count()
    if world > have:
        raise ConfigError(f"distributed.gpus={world}, but this host has {have} GPU{'s' if have != 1 else ''}")
    from mlptrain.distributed.cuda.nccl import NcclComm

    uid = NcclComm.new_id()
    ctx = mp.get_context("spawn")
    results, stop = ctx.Queue(), ctx.Value("i", 0)  # stop: the signal the launcher got, 0 while none
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world, uid, cfg, str(out_dir), accept_files, results, stop, overrides),
            name=f"rank{r}",
        )
        for r in range(world)
    ]
    with _Signals() as received:  # from before the first rank starts: no Ctrl-C leaves ranks unsupervised
        try:
            for p in procs:
                p.start()
            log.info("data parallel on %d GPUs: ranks started (pids %s)", world, [p.pid for p in procs])
            failure = _supervise(procs, cfg.distributed.timeout_s, stop, received)
        finally:
            _signal_all(procs, signal.SIGKILL)  # nothing outlives the launcher (a no-op after a clean end)
    return _outcome(_drain(results, world), failure, procs)


class _Signals:
    """Ctrl-C and SIGTERM recorded (a list of signal numbers), not raised, while the ranks run."""

    def __enter__(self) -> list[int]:
        self.received: list[int] = []
        self.previous = {
            s: signal.signal(s, lambda n, f: self.received.append(n)) for s in (signal.SIGINT, signal.SIGTERM)
        }
        return self.received

    def __exit__(self, *exc: object) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)


def _supervise(
    procs: list[Any], stop_timeout: float = 300.0, stop: Any = None, received: list[int] | None = None
) -> str | None:
    """Wait for every rank; pass a stop request on; stop the rest when one fails. Returns the failure, if any.

    A first Ctrl-C or SIGTERM (in ``received``) is passed to the ranks through ``stop`` (a shared
    integer the ranks read at each log interval, not a signal: a rank that a scheduler also signals
    directly would take a second signal for "stop at once" and not save). They get ``stop_timeout``
    seconds (``distributed.timeout_s``) to agree on a step and save; then they are killed. A second
    signal kills them at once, as a second Ctrl-C stops a one-GPU run at once.
    """
    received = [] if received is None else received
    failure, failed_at, seen = None, 0.0, 0
    while any(p.is_alive() for p in procs):
        if len(received) > seen:
            if failure is None:  # the first request: the ranks agree on a step and save
                if stop is not None:
                    stop.value = received[0]
                failure = f"stopped by {signal.Signals(received[0]).name}"
                failed_at = time.monotonic() + stop_timeout - GRACE_S  # killed after stop_timeout
            if len(received) > 1:
                failed_at = -float("inf")  # a second signal: at once
            seen = len(received)
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead and failure is None:
            r, code = dead[0]
            failure, failed_at = f"rank {r} exited with status {code}", time.monotonic()
            log.error("%s; stopping the other ranks", failure)
            _signal_all(procs, signal.SIGTERM)
        if failure is not None and time.monotonic() - failed_at > GRACE_S:
            _signal_all(procs, signal.SIGKILL)
        time.sleep(0.05)
    for p in procs:
        p.join()
    return failure


def _signal_all(procs: list[Any], signum: int) -> None:
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass


def _drain(results: Any, world: int) -> dict[int, tuple]:
    got: dict[int, tuple] = {}
    while len(got) < world:
        try:
            rank, *rest = results.get(timeout=0.5)
        except Exception:  # nothing more: a rank was killed before it could report
            break
        got[rank] = tuple(rest)
    return got


def _outcome(got: dict[int, tuple], failure: str | None, procs: list[Any]) -> dict[str, Any]:
    """Rank 0's result; when a rank died, the first error a rank reported (rank 0 may only say that the
    launcher's SIGTERM stopped it), else a message naming every rank's exit status."""
    first = got.get(0)
    died = failure is not None and failure.startswith("rank ")
    if first is not None and first[0] == "ok" and not died:
        return first[1]
    errors = [v[1] for _, v in sorted(got.items()) if v[0] == "error"]
    if died and errors:
        raise errors[0]
    if not died and first is not None and first[0] == "interrupted":
        raise Interrupted(first[1], first[2])
    if not died and first is not None and first[0] == "error":
        raise first[1]
    others = [f"rank {r}: {v[1]}" for r, v in sorted(got.items()) if v[0] in ("error", "crash")]
    codes = ", ".join(f"rank {r} status {p.exitcode}" for r, p in enumerate(procs))
    raise MlptrainError(
        f"data-parallel run failed ({failure or 'rank 0 did not report'}; {codes})"
        + (f": {'; '.join(others)}" if others else "")
    )


def _worker(
    rank: int,
    world: int,
    uid: bytes,
    cfg: Any,
    out_dir: str,
    accept_files: dict[str, str] | None,
    results: Any,
    stop: Any = None,
    overrides: list[str] | None = None,
) -> None:
    """One rank: GPU ``rank``, the NCCL communicator, then the run (reports to the launcher)."""
    os.setpgrp()  # a terminal's Ctrl-C reaches the launcher only; it passes the request on, once
    _die_with_parent()
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] - %(message)s",
    )
    code = 0
    try:
        from mlptrain.distributed.cuda.nccl import NcclComm
        from mlptrain.run.run import train

        comm = NcclComm(rank, world, uid, device=rank)
        comm.stop_signal = stop  # read by the agreed stop (mlptrain.distributed.control.AgreedStop)
        on_accept = _writer(accept_files) if rank == 0 else None
        summary = train(cfg, Path(out_dir), on_accept=on_accept, comm=comm, overrides=overrides)
        results.put((rank, "ok", summary))
    except Interrupted as exc:
        results.put((rank, "interrupted", str(exc), exc.signum))
        code = 128 + exc.signum
    except MlptrainError as exc:
        results.put((rank, "error", exc if _picklable(exc) else MlptrainError(str(exc))))
        code = 2
    except BaseException as exc:  # a bug: its traceback, and the launcher names the rank
        traceback.print_exc()
        results.put((rank, "crash", f"{type(exc).__name__}: {exc}"))
        code = 1
    results.close()
    results.join_thread()  # the report is in the pipe
    # Leave without the interpreter's teardown: finalisers of NCCL communicators and captured CUDA
    # graphs, run in whatever order, can wait on each other (seen on the H200: a finished rank that
    # never exited). The process's exit releases the GPU's resources; the run's files are written.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _die_with_parent() -> None:
    """Linux: SIGTERM this rank when the launcher dies (even by SIGKILL), so that no rank trains on alone."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _picklable(exc: BaseException) -> bool:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return True
    except Exception:
        return False


def _writer(files: dict[str, str] | None) -> Any:
    def accept(out: Path) -> None:
        from mlptrain.base.fs import atomic_write, log_file_handler

        for name, text in (files or {}).items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(out / name, text)
        handler = log_file_handler(out / "mlptrain.log")
        handler.setFormatter(logging.getLogger().handlers[0].formatter)
        logging.getLogger().addHandler(handler)

    return accept


def join(env: DistEnv) -> Communicator:
    """This process's communicator, launched by torchrun or mpirun: GPU ``local_rank``, the id over TCP.

    Raises:
        DeviceError: this machine has no GPU (data parallelism runs on NCCL); checked before anything
            imports CuPy.
        ConfigError: the local rank names a GPU this host does not have.
    """
    from mlptrain.base.backend import probe_gpu

    available, reason = probe_gpu()
    if not available:
        raise DeviceError(
            f"{env.launcher} started rank {env.rank} of {env.world}, but this machine has no GPU ({reason}); data "
            f"parallelism runs on NCCL between GPUs: run it on GPU hosts, or run without {env.launcher} (a single "
            "process on the CPU)"
        )
    from mlptrain.distributed.cuda.nccl import NcclComm

    have = device_count()
    device = 0 if have == 1 else env.local_rank  # one GPU visible (CUDA_VISIBLE_DEVICES per rank): that one
    if device >= have:
        raise ConfigError(f"{env.launcher} gave local rank {env.local_rank}, but this host has {have} GPUs")
    uid = exchange_id(env, NcclComm.new_id() if env.rank == 0 else None)
    return NcclComm(env.rank, env.world, uid, device=device)
