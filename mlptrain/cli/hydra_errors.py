"""Hydra's and OmegaConf's errors as mlptrain's one line (:func:`one_line`), for :mod:`mlptrain.cli.main`.

Hydra prints its errors with a stack and exits 1; :func:`hydra_errors_raised` makes it raise them
instead, and :func:`one_line` keeps what a user needs: the message, the options of a group, the real
key for an unknown one, the install command of a plugin that is missing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from hydra.errors import HydraException

from mlptrain.config.keys import suggest


@contextlib.contextmanager
def hydra_errors_raised() -> Iterator[None]:
    """Let Hydra raise its own errors (instead of printing a stack and exiting 1) so that they become one line."""
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous


def one_line(exc: BaseException) -> str:
    """A Hydra or OmegaConf error (and its cause) as one line.

    The key-path details and Hydra's search path are dropped; a list under a line ending in ``:``
    (the available options of a group) is joined with commas. An unknown key is said as mlptrain says
    it, with the real key to use (:func:`mlptrain.config.keys.suggest`) instead of Hydra's advice to add it
    with ``+`` (which :func:`mlptrain.step.checks.validate` would refuse); a group option that an extra
    brings gets its install command.
    """
    lines: list[str] = []
    while exc is not None and len(lines) < 40:
        lines += [line.strip() for line in str(exc).splitlines()]
        exc = exc.__cause__  # type: ignore[assignment]
    unknown = _unknown_key(lines)
    if unknown:
        return unknown
    skip = ("full_key:", "object_type=", "reference_type=", "Set the environment", "Config search path", "provider=")
    parts: list[str] = []
    listing = False
    for line in (x for x in lines if x and not x.startswith(skip)):
        if listing and " " not in line:  # an item of the list the line above announced
            parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line
            continue
        listing = line.endswith(":")
        parts.append(line if listing else line.rstrip("."))
    parts += [hint for missing, hint in EXTRAS.items() if any(f"Could not find '{missing}'" in p for p in parts)]
    return "; ".join(dict.fromkeys(parts))


# Group options that a plugin brings: the install command for each (mlptrain's extra where it has one).
EXTRAS = {
    "hydra/sweeper/optuna": "the Optuna sweeper is an extra: pip install -e '.[optuna]'",
    "hydra/sweeper/nevergrad": "the Nevergrad sweeper is a Hydra plugin: pip install hydra-nevergrad-sweeper",
    "hydra/sweeper/ax": "the Ax sweeper is a Hydra plugin: pip install hydra-ax-sweeper",
    "hydra/launcher/joblib": "the joblib launcher is an extra: pip install -e '.[sweep]'",
    "hydra/launcher/submitit_slurm": "the Slurm launcher is a Hydra plugin: pip install hydra-submitit-launcher",
    "hydra/launcher/submitit_local": "the submitit launcher is a Hydra plugin: pip install hydra-submitit-launcher",
}


def _unknown_key(lines: list[str]) -> str | None:
    """``optimizer.learning_rate is not a setting; use optimizer.lr=0.1`` for Hydra's "Key ... not in"
    error of an override, else None."""
    if not any(line.startswith("Key '") and "' not in '" in line for line in lines):
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser

    key = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("full_key:")), "")
    given = next((x.split(" use +", 1)[1] for x in lines if x.startswith("To append to your config use +")), None)
    if given is None:
        return f"{key} is not a setting{suggest(key)}" if key else None
    try:  # the value as Hydra read it, so that the suggestion is written back the way Hydra parses
        parsed = OverridesParser.create().parse_override(given)
        key, value = parsed.key_or_group, parsed.value()
    except HydraException:
        key, value = given.split("=", 1)[0], given.split("=", 1)[1]
    return f"{key} is not a setting{suggest(key, value)}"
