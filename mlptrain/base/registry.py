"""A registry: the named options of one concept, and the value ranges of the settings they read.

Each concept keeps its own :class:`Registry` beside its code: the optimizers (``optim.OPTIMIZERS``),
the losses (``losses.LOSSES``), the activations (``execution.ACTIVATIONS``) and the precisions
(``precision.PRECISIONS``); :mod:`mlptrain.step.choices` says which schema field names which. The schema
holds those names as ``str`` (a structured config's enum is fixed when the schema is written; a
registry grows when a new option registers), :mod:`mlptrain.step.checks` refuses a name that is not
registered, and ``--help`` lists the registered names. A :class:`Range` is checked, and worded,
the same way by :mod:`mlptrain.step.checks` and by the constructor that receives the value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from mlptrain.base.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Range:
    """The values a number may take: ``low`` and ``high`` (None: unbounded), each open or closed.

    ``words`` replaces the generated wording (``positive``, ``>= 0``, ``in [0, 1)``); ``note`` follows it.
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    words: str | None = None
    note: str = ""

    def holds(self, value: Any) -> bool:
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        if self.words is not None:
            text = self.words
        elif self.high is None:
            low = self.low if self.low is not None else float("-inf")
            text = "positive" if (low == 0 and self.low_open) else f"{'>' if self.low_open else '>='} {_num(low)}"
        else:
            text = (
                f"in {'(' if self.low_open else '['}{_num(self.low if self.low is not None else float('-inf'))}, "
                f"{_num(self.high)}{')' if self.high_open else ']'}"
            )
        return f"{text} ({self.note})" if self.note else text

    def problem(self, key: str, value: Any) -> str | None:
        """``"<key>=<value> must be <range>"`` when ``value`` is outside, else None: the one wording."""
        return None if self.holds(value) else f"{key}={value} must be {self.describe()}"

    def check(self, key: str, value: Any) -> None:
        """Raise :class:`ConfigError` with :meth:`problem`'s message when ``value`` is outside."""
        if (message := self.problem(key, value)) is not None:
            raise ConfigError(message)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_ONE = Range(1)
UNIT = Range(0, 1, high_open=True)  # [0, 1): momentum, decays
FRACTION = Range(0, 1, low_open=True, high_open=True)  # (0, 1)


class Registry(Generic[T]):
    """Named entries of one concept, in registration order; ``key`` is the setting that names one."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._entries: dict[str, T] = {}
        self._help: dict[str, str] = {}

    def add(self, name: str, entry: T, help: str = "") -> T:
        """Register ``entry`` as ``name`` (``help``: a short note ``--help`` shows after the name)."""
        if name in self._entries:
            raise ValueError(f"{self.key}={name} is registered already")
        if not name.isidentifier():
            raise ValueError(f"{self.key}={name!r}: a name must be an identifier (it names a YAML file and a key)")
        self._entries[name] = entry
        self._help[name] = help
        return entry

    def register(self, name: str, help: str = "") -> Callable[[T], T]:
        """``@REGISTRY.register("name")`` over a class or a function: :meth:`add` as a decorator."""
        return lambda entry: self.add(name, entry, help)

    def remove(self, name: str) -> None:
        """Forget ``name`` (tests that register an option take it away again)."""
        del self._entries[name], self._help[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def items(self) -> list[tuple[str, T]]:
        return list(self._entries.items())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, name: str) -> T:
        if name not in self._entries:
            raise ConfigError(self.unknown(name))
        return self._entries[name]

    def unknown(self, name: Any) -> str:
        """The message for a name that is not registered: the registered ones listed."""
        return f"{self.key}={name!r} is unknown; expected one of {', '.join(self._entries)}"

    def help(self) -> str:
        """The names as ``--help`` lists them: ``relu, gelu (the tanh form) or none``."""
        return joined([f"{n} ({self._help[n]})" if self._help[n] else n for n in self._entries], "or")


def joined(names: list[str] | tuple[str, ...], word: str = "and") -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {word} {names[-1]}"
