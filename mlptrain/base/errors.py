"""Every exception mlptrain raises for bad input, an unusable environment, or a stop request.

Every error a user can cause derives from :class:`MlptrainError`. The CLI catches that base
class, prints the one-sentence message and exits with status 2, so a user never sees a
traceback from deep inside for a mistake of theirs. Messages name the object, the bad value and
what was expected; environment problems end with the fix.

A stop request (Ctrl-C, SIGTERM) is not an error: it is a :class:`KeyboardInterrupt`,
:class:`Interrupted` carrying the signal, and the CLI exits with ``128 + signal`` as a shell does.
"""

from __future__ import annotations

import signal
from pathlib import Path


class MlptrainError(Exception):
    """Base class of every error caused by input or environment, not by a bug."""


class ConfigError(MlptrainError, ValueError):
    """A configuration value is out of range, unknown, unused, or inconsistent with another."""


class DatasetError(MlptrainError):
    """A dataset is unknown, missing, corrupt (checksum, bad values), or cannot be downloaded."""


class DeviceError(MlptrainError):
    """The requested device or precision is not available on this machine."""


class CheckpointError(MlptrainError):
    """A checkpoint is missing, corrupt, or does not match the model being trained."""


class OutputError(MlptrainError, OSError):
    """The run directory cannot be written, is in use, or holds a run that would be overwritten."""


class NonFiniteError(MlptrainError, FloatingPointError):
    """A loss, gradient or parameter became inf/NaN and the precision policy cannot recover."""


class ResourceError(MlptrainError, MemoryError):
    """The device ran out of memory; the message says which sizes to lower."""


class Interrupted(KeyboardInterrupt):
    """A stop request: ``signum`` is the signal (SIGINT for Ctrl-C, SIGTERM from a scheduler).

    Raised as is by a second signal, which does not wait for a checkpoint.
    """

    def __init__(self, message: str = "", signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = int(signum)


class TrainingInterrupted(Interrupted):
    """The first stop request: the run saved ``checkpoint`` at ``step`` and stopped.

    The message says how to resume.
    """

    def __init__(self, message: str, checkpoint: Path, step: int, signum: int = signal.SIGINT) -> None:
        super().__init__(message, signum)
        self.checkpoint = checkpoint
        self.step = step
