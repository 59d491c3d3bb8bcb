"""A multirun's jobs in worker processes (Hydra's joblib launcher): a stop request across the processes.

``python -m mlptrain -m hydra/launcher=joblib hydra.launcher.n_jobs=4 ...`` runs the jobs of a sweep in
``n_jobs`` worker processes (joblib's loky backend: fresh interpreters, reused from job to job); each job
is a call of the CLI's task function with its own folder, config and logging (Hydra's ``run_job``), and
the sweep's process (the one ``python -m mlptrain`` started) waits for them, then writes ``summary.md``
(:mod:`mlptrain.cli.sweep`). A job that fails records its error in its folder, which the summary reads.

What one run does with Ctrl-C or SIGTERM (save ``last``, stop, :mod:`mlptrain.base.stopping`) has to
cross the processes here, as the data-parallel launcher's does (:mod:`mlptrain.cli.launcher`):

* in the sweep's process, a first signal is passed on to each worker once (:func:`forward_stop`): the
  sweep's process waits for the jobs to end, writes the stopped sweep's summary with the command that
  continues every job (``resume=last``), and exits ``128 + signal`` (:func:`sweep_ends_when_stopped`). A second
  signal raises :class:`~mlptrain.base.errors.Interrupted` there, and joblib kills the workers;
* a worker leaves the terminal's process group as its first job starts (:func:`enter_job`), so that a
  Ctrl-C reaches it once, through the sweep's process (two signals would stop its run without saving).
  Its running job saves ``last`` and stops (:func:`job_stopped`); a job it is given after that is not
  started, and its empty folder is removed (no row in the summary, as for a sequential sweep's jobs
  after the stop).

Nothing here runs under Hydra's basic launcher (the jobs run in the sweep's process) or under the Ray and
SLURM launchers (each job is a process of its own that the cluster signals: docs/sweeps.md).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
from collections.abc import Iterator
from typing import Any

from mlptrain.base.errors import Interrupted, MlptrainError

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_sweep_stop: list[int] = []  # the sweep's process: the signals that asked the sweep to stop
_worker_stop: list[int] = []  # a worker: the signal that stopped its jobs
_entered: list[int] = []  # a worker: the pid that set up its signals (once per process)
_starting: list[bool] = [False]  # a worker: a job runs, and its run is not yet accepted (nothing written)


def job_process() -> bool:
    """Whether this job runs in a worker of a parallel launcher (a child process of the sweep's: joblib's loky
    workers), not in the process that started the sweep."""
    return multiprocessing.parent_process() is not None


def enter_job() -> bool:
    """A job starts in a worker: returns False when the sweep was stopped (the job is not to start).

    The first time: the worker leaves the terminal's process group (a Ctrl-C reaches it through the sweep's
    process only, once) and installs its handler of a stop request outside a run's: before the job's run is
    accepted (reading its data) it stops the job at once, as the sweep's own process would exit (nothing is
    written yet); after the run and between two jobs it is recorded, not raised inside joblib's worker loop.
    A run installs its own handlers while it trains (:class:`mlptrain.base.stopping.StopRequest`).
    """
    if not _entered:
        _entered.append(os.getpid())
        try:
            os.setpgrp()
        except OSError as exc:  # a session leader cannot; it still stops at the forwarded signal
            log.debug("worker %d stays in its process group (%s)", os.getpid(), exc)
        for sig in STOP_SIGNALS:
            signal.signal(sig, _record_in_worker)
    _starting[0] = not _worker_stop
    return not _worker_stop


def run_accepted() -> None:
    """The job's run was accepted (its stop request is in place, its files are being written); from its end on, a
    signal that reaches this worker is only recorded."""
    _starting[0] = False


def job_stopped(exc: Interrupted) -> None:
    """The worker's run was stopped (it saved ``last`` where it had started training): no more jobs start here."""
    _worker_stop.append(exc.signum)
    log.warning("job stopped by %s: %s", signal.Signals(exc.signum).name, exc)


def job_ended() -> None:
    """The job returns (finished, failed or stopped): a signal from now on is only recorded."""
    _starting[0] = False


def _record_in_worker(signum: int, frame: Any) -> None:
    _worker_stop.append(signum)
    parent = multiprocessing.parent_process()  # (loky gives it no sentinel: is_alive() cannot tell)
    if not _starting[0] and parent is not None and os.getppid() != parent.pid:  # orphaned: no sweep waits for it
        os._exit(128 + signum)
    if _starting[0]:  # the job has not written anything: stop it now (a swallowed raise still skips the next jobs)
        _starting[0] = False
        raise Interrupted(
            f"stopped by {signal.Signals(signum).name} before training started; nothing was written", signum
        )


def forward_stop(signum: int) -> bool:
    """In the sweep's process: pass a first stop request on to the workers running jobs, once.

    Returns False when no job runs in a worker (the caller treats the signal as it would without them).
    A second request raises :class:`Interrupted` at once: joblib then kills its workers (their runs keep the
    last checkpoint they had saved), and the sweep's summary is written as for any stopped sweep.
    """
    workers = multiprocessing.active_children()
    if _sweep_stop:
        raise Interrupted(f"stopped by {signal.Signals(signum).name} a second time: the jobs were killed", signum)
    if not workers:
        return False
    _sweep_stop.append(signum)
    for pid in [p.pid for p in workers if p.pid is not None]:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    note = (
        f"mlptrain: {signal.Signals(signum).name}: each running job saves its last checkpoint and stops, the jobs "
        "not started are left out (a second signal stops at once)\n"
    )
    os.write(2, note.encode())  # from a signal handler: no stream that the interrupted code may be writing
    return True


@contextlib.contextmanager
def sweep_ends_when_stopped() -> Iterator[None]:
    """Around the sweep in its own process: once the launcher is done, a stopped sweep ends as a stopped run does.

    A worker that a terminal's Ctrl-C reached before its first job (still in the terminal's process group,
    unpickling the task) breaks joblib's pool: that error, after a stop request, is the stop too. A worker
    that died otherwise (the kernel's out-of-memory killer, a segfault) breaks it as well, and joblib ends
    the other workers: every job keeps the last checkpoint it saved, and ``resume=last`` continues them.

    Raises:
        Interrupted: a stop request was passed on to the workers (:func:`forward_stop`).
        MlptrainError: a worker died (joblib's ``TerminatedWorkerError``), named with its exit status.
    """
    try:
        yield
    except Exception as exc:
        if _sweep_stop:
            raise _stopped() from exc
        if _broken_pool(exc):
            detail = " ".join(str(exc).split())
            raise MlptrainError(
                f"a worker process of the sweep died and joblib ended the others ({type(exc).__name__}: {detail}); "
                "each job keeps the last checkpoint it saved (checkpoint_every, checkpoint_steps)"
            ) from exc
        raise
    if _sweep_stop:
        raise _stopped()


def _broken_pool(exc: BaseException) -> bool:
    """Whether ``exc`` is joblib's error for a worker that died (loky's ``BrokenProcessPool`` and its subclass
    ``TerminatedWorkerError``)."""
    try:
        from joblib.externals.loky.process_executor import BrokenProcessPool
    except ImportError:  # no joblib: no worker of its could have died
        return False
    return isinstance(exc, BrokenProcessPool)


def _stopped() -> Interrupted:
    name = signal.Signals(_sweep_stop[0]).name
    return Interrupted(f"the sweep was stopped by {name}; each running job saved its last checkpoint", _sweep_stop[0])


def reset() -> None:
    """The sweep's process starts (``python -m mlptrain``; tests call it more than once in one process)."""
    _sweep_stop.clear()
