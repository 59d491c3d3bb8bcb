"""Exceptions that mlptrain raises for bad input and unusable environments.

Every error a user can cause derives from :class:`MlptrainError`. The CLI catches that base
class, prints the one-sentence message and exits non-zero, so a user never sees a traceback
from deep inside for a mistake of theirs. Messages name the object, the bad value and what
was expected; environment problems end with the fix.
"""

from __future__ import annotations


class MlptrainError(Exception):
    """Base class of every error caused by input or environment, not by a bug."""


class ConfigError(MlptrainError, ValueError):
    """A configuration value is out of range, unknown, or inconsistent with another."""


class DatasetError(MlptrainError):
    """A dataset is unknown, missing, corrupt (checksum), or cannot be downloaded."""


class DeviceError(MlptrainError):
    """The requested device or precision is not available on this machine."""


class CheckpointError(MlptrainError):
    """A checkpoint is missing, corrupt, or does not match the model being trained."""


class NonFiniteError(MlptrainError, FloatingPointError):
    """A loss or gradient became inf/NaN and the precision policy cannot recover."""


class ResourceError(MlptrainError, MemoryError):
    """The device ran out of memory; the message says which sizes to lower."""
