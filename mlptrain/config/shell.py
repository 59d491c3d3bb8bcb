"""Commands a user can paste: Hydra overrides written so that a POSIX shell (bash, zsh) passes them unchanged.

Every message that suggests a command builds it here, so that what it prints is exactly what can be
pasted: ``model.hidden=[512,512]`` (a list without spaces, which Hydra's parser needs), quoted for the
shell where it holds a character the shell would expand or split (``[`` is a glob in bash and zsh)::

    >>> override("model.hidden", [512, 512])
    "'model.hidden=[512,512]'"
    >>> command(["python -m mlptrain"], {"epochs": 5, "model.hidden": [64, 64]})
    "python -m mlptrain epochs=5 'model.hidden=[64,64]'"
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from typing import Any

# A Hydra value that needs no quotes of its own: letters, digits and these (no space, comma, bracket, quote).
_PLAIN = re.compile(r"^[A-Za-z0-9_./:+\-@%~]+$")


def hydra_value(value: Any) -> str:
    """``value`` as Hydra's override grammar reads it back: ``true``, ``null``, ``[1,2]``, ``'a b'``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in ("true", "false", "null", "none"):
        return text
    # A quoted string in Hydra's grammar: backslashes are doubled only before a quote or at the end.
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    text = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text)
    return "'" + text + "'"


def override(key: str, value: Any) -> str:
    """``key=value`` as one shell word: Hydra's spelling of the value, quoted for the shell if it must be."""
    return shlex.quote(f"{key}={hydra_value(value)}")


def command(program: Iterable[str], overrides: Mapping[str, Any] | Iterable[str] = ()) -> str:
    """``program`` (words already safe, such as ``python -m mlptrain``) followed by the overrides.

    ``overrides``: a mapping of keys to values (written with :func:`override`), or override strings as
    Hydra received them (``model.hidden=[64,64]``), each quoted for the shell as it needs.
    """
    words = list(program)
    if isinstance(overrides, Mapping):
        words += [override(k, v) for k, v in overrides.items()]
    else:
        words += [shlex.quote(o) for o in overrides]
    return " ".join(words)
