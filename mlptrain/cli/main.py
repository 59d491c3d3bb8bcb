"""Command line: ``python -m mlptrain [key=value ...]``, a Hydra app over :class:`~mlptrain.config.schema.TrainConfig`.

Hydra composes ``conf/config.yaml`` with the typed schema, so an unknown key, a wrong type or an
unknown group option fails before anything runs; :func:`mlptrain.run.run.train` then validates the
values and runs in the directory Hydra chose. Every mistake of the user's is one line
``error: <message>`` on stderr, no traceback, exit status 2: Hydra's own composition errors, a run
directory that cannot be created (:class:`RunDirectoryCheck`, before Hydra tries), and every
:class:`~mlptrain.base.errors.MlptrainError`. In a multirun the failed job is reported the same way,
the remaining jobs still run, the job's folder keeps its error for the sweep's summary (``failed.json``,
:func:`mlptrain.cli.sweep.record_failure`: a job of the joblib launcher fails in another process), and
the exit status is 2 at the end. A stop request exits with ``128 + signal`` (130 for Ctrl-C, 143 for
SIGTERM); with the joblib launcher the sweep's process passes it on to its workers and waits for their
runs to save (:mod:`mlptrain.cli.parallel`). A bug still shows its traceback (exit 1).

Nothing is written into a run directory before the run is accepted: Hydra's ``.hydra/`` files and
``mlptrain.log`` are written by :func:`_accepted` (``hydra.output_subdir`` is null and the job's
logging has no file handler in ``conf/``), and a run directory that a refused run created is
removed again (a refused job of a multirun leaves the folder Hydra made for it, with ``failed.json``).

The config directory is found by absolute path, which Hydra uses as is: ``mlptrain/conf`` in an
installed wheel (the top-level ``conf/`` is copied there at build time), else the top-level
``conf/`` of a source checkout or editable install.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mlptrain.base.errors import ConfigError, Interrupted, MlptrainError, OutputError
from mlptrain.base.fs import atomic_write, log_file_handler
from mlptrain.base.timeline import PROCESS, Timeline
from mlptrain.cli import parallel, sweep
from mlptrain.cli.help import register_configs, version
from mlptrain.cli.hydra_errors import hydra_errors_raised, one_line
from mlptrain.cli.runlog import EarlyWarnings, hold_signals_in_log_lines
from mlptrain.config.schema import TrainConfig
from mlptrain.step.checks import validate

log = logging.getLogger(__name__)

LOG_FILE = "mlptrain.log"  # mlptrain.run.rundir.LOG_FILE (not imported: cli starts light)
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def find_conf_dir() -> Path:
    """The directory holding ``config.yaml``: packaged (wheel) first, else the source checkout's."""
    here = Path(__file__).resolve().parent.parent  # mlptrain/ (this module is mlptrain/cli/main.py)
    packaged = here / "conf"
    if packaged.is_dir():
        return packaged
    return here.parent / "conf"


CONF_DIR = find_conf_dir()

# Messages of the jobs that failed with an MlptrainError in this process (a multirun has several).
_failures: list[str] = []
# Run directories that this process created (RunDirectoryCheck): removed again if the run is refused.
_created: set[Path] = set()
# The folder of this process's multirun (RunDirectoryCheck): its summary is written if the sweep is stopped.
_sweep_dirs: list[Path] = []
# The runs accepted in this process: once a run's stop request is gone (its end), its files are complete.
_accepted_runs: list[Path] = []


class NotPrinted(logging.Filter):
    """The console handler's filter (``conf/hydra/job_logging``): a record marked ``printed`` (the run's
    summary line, which :func:`mlptrain.run.run.train` also prints on stdout) is left out when stdout is a
    terminal, so that a terminal shows it once; ``mlptrain.log`` and a redirected stderr keep it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (getattr(record, "printed", False) and sys.stdout.isatty())


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """Turn a composed config into a :class:`TrainConfig` (not yet validated: :func:`train` does that)."""
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, TrainConfig):  # only if config.yaml lost train_schema from its defaults
        raise TypeError(f"composed config is a {type(obj).__name__}, expected TrainConfig")
    return obj


def compose_config(overrides: Sequence[str] = (), config_name: str = "config") -> TrainConfig:
    """Compose ``conf/<config_name>.yaml`` with ``overrides``, as the CLI would, and validate it.

    For tests and scripts: no run directory, no logging set-up, no change of directory.

    Raises:
        hydra.errors.ConfigCompositionException: unknown key, wrong type, unknown option or enum value.
        ConfigError: a value is out of range.
    """
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="mlptrain"):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    return validate(to_train_config(cfg))


class RunDirectoryCheck(Callback):
    """Creates the run (or sweep) directory before Hydra does, so that failing to is one clean error.

    Listed in ``conf/config.yaml`` under ``hydra.callbacks``. Remembers a directory it created, so
    that a run refused before it wrote anything leaves no directory behind.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _create(Path(str(config.hydra.run.dir)), remember=True)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _create(Path(str(config.hydra.sweep.dir)), remember=False)
        _sweep_dirs.append(Path(str(config.hydra.sweep.dir)))


def _create(path: Path, *, remember: bool) -> None:
    path = path.absolute()
    if path.is_dir():
        return
    try:
        path.mkdir(parents=True)
    except OSError as exc:
        if isinstance(exc, FileExistsError) and path.is_dir():
            return  # made a moment ago by a run started beside this one: not ours
        print(
            f"error: cannot create the output directory {path} ({type(exc).__name__}: {exc}); choose a writable "
            "hydra.run.dir (or hydra.sweep.dir for a multirun)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(2)
    if remember:
        _created.add(path)


def _report(exc: MlptrainError) -> None:
    """Print ``error: <message>`` to stderr (and to the job's log file, once there is one)."""
    hc = HydraConfig.get()
    where = f"[job {hc.job.num}: {hc.job.override_dirname or 'no overrides'}] " if hc.mode == RunMode.MULTIRUN else ""
    line = f"error: {where}{exc}"
    _failures.append(line)
    if hc.mode == RunMode.MULTIRUN:  # the summary names the job, wherever it ran (a joblib worker, here)
        sweep.record_failure(Path(hc.runtime.output_dir), str(exc), list(hc.overrides.task))
    print(line, file=sys.stderr, flush=True)
    # Only the file handlers: the console handler would print the line a second time.
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, line, (), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _hydra_files(cfg: DictConfig) -> dict[str, str]:
    """Hydra's ``.hydra/`` files of this job: relative path -> YAML text."""
    hc = HydraConfig.instance().cfg
    files = {"hydra.yaml": hc, "overrides.yaml": HydraConfig.get().overrides.task}
    # the run's values, resolved: conf/data/file.yaml derives model.loss and early_stopping.metric from other keys
    texts = {".hydra/config.yaml": OmegaConf.to_yaml(cfg, resolve=True)}
    return texts | {f".hydra/{name}": OmegaConf.to_yaml(node) for name, node in files.items()}


def _accepted(cfg: DictConfig, out_dir: Path, early: EarlyWarnings | None = None) -> logging.Handler:
    """The run is accepted: write Hydra's ``.hydra/`` files, and log into ``mlptrain.log`` from now on (``early``'s
    warnings first).

    Raises:
        OutputError: the folder is read-only or full; a ``.hydra/`` made here is removed again (each
            file is written whole or not at all), so a failed start leaves the folder as it was.
    """
    _accepted_runs.append(out_dir)
    parallel.run_accepted()
    hydra_dir = out_dir / ".hydra"
    made = not hydra_dir.is_dir()
    try:
        hydra_dir.mkdir(exist_ok=True)
        for name, text in _hydra_files(cfg).items():
            atomic_write(out_dir / name, text)
        handler = log_file_handler(out_dir / LOG_FILE)
    except OSError as exc:
        if made:
            shutil.rmtree(hydra_dir, ignore_errors=True)
        raise OutputError(
            f"cannot write the run's files in {out_dir} ({type(exc).__name__}: {exc}); free disk space or choose a "
            "writable hydra.run.dir"
        ) from exc
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    if early is not None:
        early.replay(handler)
    logging.getLogger().addHandler(handler)
    return handler


def sweep_value(summary: dict[str, Any], key: str | None) -> float:
    """What a job returns to a Hydra sweeper (Optuna...): ``optimized_metric`` of the summary, else the best
    checkpoint's metric. NaN when the run has no such value."""
    value = summary["best"]["value"] if key is None else summary.get(key)
    if value is None:
        log.warning("optimized_metric=%s is not in the run's summary (%s)", key, ", ".join(summary))
        return float("nan")
    return float(value)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _run(cfg: DictConfig) -> float:
    """One Hydra job: train into the job's output directory, once the run is accepted.

    Returns the value a sweeper optimises (:func:`sweep_value`); NaN for a job that failed.
    """
    from tqdm.contrib.logging import logging_redirect_tqdm

    from mlptrain.run.rundir import RunDirectory

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        sweep.clear_failure(out_dir)  # run again (resume=last): an earlier attempt's error no longer stands
        if parallel.job_process() and not parallel.enter_job():  # a joblib worker, after the sweep was stopped
            RunDirectory(out_dir).remove_if_empty()
            return float("nan")
    handlers: list[logging.Handler] = []
    early = EarlyWarnings()  # said before mlptrain.log exists: written into it once it does
    logging.getLogger().addHandler(early)
    # The process's first job carries its start-up (mlptrain.base.timeline); a multirun's later jobs start afresh.
    timeline = PROCESS if "config" not in PROCESS.phases else Timeline()
    try:
        config = to_train_config(cfg)
        timeline.mark("config")
        with logging_redirect_tqdm():
            hold_signals_in_log_lines()
            summary = _train_job(cfg, config, out_dir, handlers, timeline, early)
        return sweep_value(summary, config.optimized_metric)
    except MlptrainError as exc:
        _report(exc)
        if not handlers and out_dir.absolute() in _created:
            RunDirectory(out_dir).remove_if_empty()
        return float("nan")
    except Interrupted as exc:
        if not parallel.job_process():
            raise
        parallel.job_stopped(exc)  # the sweep's process passed the stop on, and says how to continue
        if not handlers:  # stopped before the run was accepted: nothing of it was written
            RunDirectory(out_dir).remove_if_empty()
        return float("nan")
    finally:
        parallel.job_ended()
        for handler in [early, *handlers]:
            logging.getLogger().removeHandler(handler)
            handler.close()


def _train_job(
    cfg: DictConfig,
    config: TrainConfig,
    out_dir: Path,
    handlers: list[logging.Handler],
    timeline: Timeline,
    early: EarlyWarnings,
) -> dict[str, Any]:
    """One run: here, on ``distributed.gpus`` GPUs of this host (one process each), or as one rank
    that torchrun or mpirun started (:mod:`mlptrain.distributed`)."""
    from mlptrain.distributed.launch import DistEnv
    from mlptrain.run.run import train  # imported here: the training stack is not needed for --help or errors

    if HydraConfig.get().mode == RunMode.MULTIRUN and config.resume == "last":
        summary = sweep.resumed_job(config, out_dir)
        if summary is not None:
            return summary
    env = DistEnv.from_environ(os.environ)
    overrides = list(HydraConfig.get().overrides.task)  # what the user set: a resume restores the rest
    if config.distributed.gpus > 1:
        if env is not None:
            raise ConfigError(
                f"distributed.gpus={config.distributed.gpus} under {env.launcher}, which started {env.world} "
                "ranks already: leave distributed.gpus at 1 and let the launcher set the number of processes"
            )
        from mlptrain.cli.launcher import launch

        validate(config)
        return launch(config, out_dir, accept_files=_hydra_files(cfg), overrides=overrides)
    if env is None:
        return train(
            config,
            out_dir,
            on_accept=lambda path: handlers.append(_accepted(cfg, path, early)),
            overrides=overrides,
            timeline=timeline,
        )
    from mlptrain.cli.launcher import join

    comm = join(env)
    accept = (lambda path: handlers.append(_accepted(cfg, path, early))) if env.rank == 0 else None
    summary = train(config, out_dir, on_accept=accept, comm=comm, overrides=overrides, timeline=timeline)
    if env.rank != 0 and out_dir.absolute() in _created:  # Hydra's directory of this rank: unused
        from mlptrain.run.rundir import RunDirectory

        RunDirectory(out_dir).remove_if_empty()
    return summary


def _exit_now(signum: int, frame: Any) -> None:
    """Ctrl-C or SIGTERM outside a run (Hydra composing the config, between the jobs of a multirun):
    nothing of a run is being written, so exit at once, with one line and ``128 + signal``. Raising in
    the middle of Hydra's or OmegaConf's code could leave a half-built object to fail on (a traceback).
    A run installs its own handlers (:class:`mlptrain.base.stopping.StopRequest`). While a multirun's jobs run
    in joblib's workers, a first signal is passed on to them instead (:func:`mlptrain.cli.parallel.forward_stop`)."""
    if _sweep_dirs and parallel.forward_stop(signum):  # a sweep's jobs in joblib's workers: they save and stop
        return
    name = signal.Signals(signum).name
    if _accepted_runs:  # outside a run's stop request, after one: its end, or between two jobs
        n = len(_accepted_runs)
        runs = (
            f"the run in {_accepted_runs[-1]} is" if n == 1 else f"the {n} runs (the last in {_accepted_runs[-1]}) are"
        )
        line = f"error: stopped by {name} after training; {runs} complete as written\n"
    else:
        line = f"error: stopped by {name} before training; nothing was written\n"
    os.write(2, line.encode())
    os._exit(128 + signum)


def _ended_early(line: str, status: int) -> NoReturn:
    """Say why the run or sweep ended early and exit; a sweep gets its summary, with the command that continues it."""
    print(line, file=sys.stderr, flush=True)
    for sweep_dir in _sweep_dirs:
        sweep.stopped_sweep(sweep_dir, sys.argv[1:])
    sys.exit(status)


def main() -> None:
    """Console entry point (``mlptrain`` and ``python -m mlptrain``); Hydra parses ``sys.argv``.

    The process's entry point: it owns the signal handlers, and when it is done a late Ctrl-C or SIGTERM is
    ignored (the run's work is written; there is nothing left to stop).
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_now)
    PROCESS.mark("imports")  # (the console script: the interpreter's start-up too)
    if sys.argv[1:] == ["--version"]:  # mlptrain's, not Hydra's
        print(version())  # mlptrain.cli.help.version
        return
    register_configs()
    sweep.register_resolvers()
    _failures.clear()
    _sweep_dirs.clear()
    _accepted_runs.clear()
    parallel.reset()
    try:
        with hydra_errors_raised(), parallel.sweep_ends_when_stopped():  # jobs in joblib's workers: stopped here
            _run()
    except (HydraException, OmegaConfBaseException) as exc:  # composition: unknown key, option, type
        print(f"error: {one_line(exc)}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Interrupted as exc:
        # A first Ctrl-C (or SIGTERM) while training saves a checkpoint, and the message
        # (TrainingInterrupted) says how to resume. Exit status 128 + signal, as a shell reports it.
        _ended_early(f"mlptrain: {exc}" if str(exc) else "error: interrupted", 128 + exc.signum)
    except MlptrainError as exc:  # a joblib worker of the sweep died (mlptrain.cli.parallel): the others were ended
        _ended_early(f"error: {exc}", 2)
    finally:  # the work is done (or reported): a late Ctrl-C or SIGTERM has nothing left to stop
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Jobs that ran in workers (joblib) reported their errors there; their folders hold them (the summary's rows).
    failed = _failures or [job for sweep_dir in _sweep_dirs for job in sweep.failed_jobs(sweep_dir)]
    if failed:
        if len(failed) > 1:
            print(f"error: {len(failed)} jobs failed (see above)", file=sys.stderr)
        sys.exit(2)
