"""The small commands beside training: ``python -m mlptrain.predict``, ``.evaluate``, ``.export``.

They take ``key=value`` arguments like the main command (no Hydra: they compose nothing and write
no run directory). Each declares its arguments as a dataclass whose fields carry a help text;
:func:`main` parses the command line into it, prints ``--help`` from it, and reports every mistake
as one line ``error: <message>`` on stderr with exit status 2, as ``python -m mlptrain`` does.
Ctrl-C or SIGTERM exits with ``128 + signal`` (130, 143), removing the temp file being written; an
interrupt before the outputs are renamed into place leaves every output file as it was, and the
message says which outputs, if any, were written (:mod:`mlptrain.inference.outputs`).
"""

from __future__ import annotations

import difflib
import logging
import signal
import sys
import threading
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, field, fields
from typing import Any, TypeVar

from mlptrain.base.errors import ConfigError, Interrupted, MlptrainError
from mlptrain.inference import outputs

T = TypeVar("T")

REQUIRED: Any = MISSING


def arg(default: Any, help: str) -> Any:
    """A command argument with its help text (``REQUIRED`` for one without a default)."""
    return field(default=default, metadata={"help": help})


def parse(cls: type[T], argv: Sequence[str]) -> T:
    """``key=value`` arguments into ``cls``; unknown keys, bad values and missing keys raise ConfigError."""
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for token in argv:
        key, eq, text = token.partition("=")
        if not eq:
            raise ConfigError(f"argument {token!r} is not key=value; the keys are {', '.join(known)}")
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"did you mean {close[0]}?" if close else f"the keys are {', '.join(known)}"
            raise ConfigError(f"unknown argument {key!r}; {hint}")
        values[key] = _convert(key, text, hints[key])
    missing = [name for name, f in known.items() if f.default is MISSING and name not in values]
    if missing:
        raise ConfigError(f"missing {', '.join(f'{m}=...' for m in missing)}; see --help")
    return cls(**values)


def _convert(key: str, text: str, hint: Any) -> Any:
    options = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = options[0] if options else hint
    if options and text.lower() in ("null", "none", ""):
        return None
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ConfigError(f"{key}={text!r}; expected true or false")
        return text.lower() in ("true", "1", "yes")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{key}={text!r}; expected a whole number") from None
    return text


def usage(cls: type, command: str, about: str) -> str:
    """``--help``: what the command does, and every argument with its default and description."""
    lines = [about, "", f"Usage: python -m {command} key=value ...", "", "Arguments (key = default):"]
    for f in fields(cls):
        default = "(required)" if f.default is MISSING else ("null" if f.default is None else f.default)
        shown = str(default).lower() if isinstance(default, bool) else str(default)
        lines.append(f"  {f.name + ' = ' + shown:<28} {f.metadata.get('help', '')}")
    return "\n".join(lines)


def main(
    cls: type[T], command: str, about: str, run: Callable[[T], int | None], argv: Sequence[str] | None = None
) -> int:
    """Parse the arguments, run, and turn errors into one line and an exit status (0, 2, 130, 143)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(usage(cls, command, about))
        return 0
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    outputs.written.clear()
    main_thread = threading.current_thread() is threading.main_thread()
    # SIGTERM as Ctrl-C: an exception, so that the temp file being written is removed on the way out
    previous = signal.signal(signal.SIGTERM, _stop) if main_thread else None
    try:
        return run(parse(cls, argv)) or 0
    except MlptrainError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        done = ", ".join(map(str, outputs.written))
        said = f"it had written {done}" if done else "no output was written"
        print(f"error: interrupted by {signal.Signals(signum).name}; {said}", file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _stop(signum: int, frame: Any) -> None:
    raise Interrupted(f"stopped by {signal.Signals(signum).name}", signum)
