"""Command line: ``python -m mlptrain [key=value ...]``, a Hydra app over :class:`~mlptrain.config.TrainConfig`.

Hydra composes ``conf/config.yaml`` with the typed schema, so an unknown key, a wrong type or an
unknown group option fails before anything runs (Hydra prints the message, exit status 1). Then
:func:`~mlptrain.config.validate` checks values, and :func:`mlptrain.train.train` runs in the
run directory Hydra made. Any :class:`~mlptrain.errors.MlptrainError` becomes one line
``error: <message>`` on stderr, without a traceback, and exit status 2. In a multirun the failed
job is reported the same way, the remaining jobs still run, and the exit status is 2 at the end.

The config directory is found by absolute path, which Hydra uses as is: ``mlptrain/conf`` in an
installed wheel (the top-level ``conf/`` is copied there at build time), else the top-level
``conf/`` of a source checkout or editable install.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from mlptrain.config import TrainConfig, register_configs, validate
from mlptrain.errors import MlptrainError

log = logging.getLogger(__name__)


def find_conf_dir() -> Path:
    """The directory holding ``config.yaml``: packaged (wheel) first, else the source checkout's."""
    here = Path(__file__).resolve().parent
    packaged = here / "conf"
    if packaged.is_dir():
        return packaged
    return here.parent / "conf"


CONF_DIR = find_conf_dir()

# Messages of the jobs that failed with an MlptrainError in this process (a multirun has several).
_failures: list[str] = []


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """Turn a composed config into a validated :class:`TrainConfig`.

    Raises:
        ConfigError: a value is out of range (every problem in one message).
    """
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, TrainConfig):  # only if config.yaml lost train_schema from its defaults
        raise TypeError(f"composed config is a {type(obj).__name__}, expected TrainConfig")
    return validate(obj)


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
    return to_train_config(cfg)


def _report(exc: MlptrainError) -> None:
    """Print ``error: <message>`` to stderr, and add it to the job's log file."""
    hc = HydraConfig.get()
    where = f"[job {hc.job.num}: {hc.job.override_dirname or 'no overrides'}] " if hc.mode == RunMode.MULTIRUN else ""
    line = f"error: {where}{exc}"
    _failures.append(line)
    print(line, file=sys.stderr, flush=True)
    # Only the file handlers: Hydra's console handler writes to stdout and would repeat the line.
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, line, (), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _run(cfg: DictConfig) -> dict[str, Any] | None:
    """One Hydra job: validate, then train into the job's output directory."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    try:
        config = to_train_config(cfg)
        from mlptrain.train import train  # imported here: the training stack is not needed for --help or errors

        out_dir = Path(HydraConfig.get().runtime.output_dir)
        with logging_redirect_tqdm():
            return train(config, out_dir)
    except MlptrainError as exc:
        _report(exc)
        return None


def main() -> None:
    """Console entry point (``mlptrain`` and ``python -m mlptrain``); Hydra parses ``sys.argv``."""
    register_configs()
    _failures.clear()
    try:
        _run()
    except KeyboardInterrupt as exc:
        # A first Ctrl-C (or SIGTERM) while training saves a checkpoint, and the message
        # (TrainingInterrupted) says how to resume. Exit status 128 + signal, as a shell reports it.
        print(f"mlptrain: {exc}" if str(exc) else "error: interrupted", file=sys.stderr, flush=True)
        sys.exit(128 + getattr(exc, "signum", 2))
    if _failures:
        if len(_failures) > 1:
            print(f"error: {len(_failures)} jobs failed (see above)", file=sys.stderr)
        sys.exit(2)
