"""What a comparison compares: the one config key whose two values split its runs into two arms.

``make compare`` sweeps ``execution=fused,naive``; ``conf/compare_fp8.yaml`` sweeps
``precision=bf16,fp8``. Each sweep also varies the seed, and nothing else. The axis is either named
(``python -m mlptrain.compare SWEEP --axis precision``, or ``--axis precision=fp8,bf16`` to fix the
order) or found: the config key, besides the seed, on which the runs differ. Its two values are the
arms, *candidate* first and *reference* second; every difference the report gives is candidate minus
reference (fused - naive, fp8 - bf16).

:class:`CompareError`, the one error of ``python -m mlptrain.compare``, lives here: this is the lowest module
of the package that raises it (``runs``, ``results`` and the package import it from here).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlptrain.config.schema import flatten

# Keys that differ between the runs of any comparison: the seed, and how progress was shown.
ALWAYS_SWEPT = ("seed", "progress")
# The axes mlptrain's sweeps vary, with their arms in the report's order (candidate before reference):
# the fused path against the plain one, a lower precision against a higher one.
KNOWN_ORDERS = {
    "execution.mode": ("fused", "naive"),
    "precision.name": ("fp8", "fp16", "bf16", "tf32", "fp32", "fp64"),
}
# A group named alone (--axis precision) means its option's field: precision.name, execution.mode.
LABEL_FIELDS = ("name", "mode")


class CompareError(Exception):
    """A run is missing, incomplete or not comparable; the message names the run directory (the one error
    of ``python -m mlptrain.compare``: exit status 2)."""


@dataclass(frozen=True)
class Axis:
    """The compared key (flattened, ``precision.name``) and its two values: ``(candidate, reference)``."""

    key: str
    arms: tuple[str, str]

    @property
    def name(self) -> str:
        """The key as a sweep writes it: ``precision`` for ``precision.name``, ``execution`` for ``execution.mode``."""
        group, _, field = self.key.rpartition(".")
        return group if group and field in LABEL_FIELDS else self.key

    @property
    def label(self) -> str:
        """``fp8 vs bf16``."""
        return f"{self.arms[0]} vs {self.arms[1]}"

    def value(self, config: dict[str, Any]) -> str | None:
        """This run's arm: its value of the key, as text (None when the config lacks the key)."""
        v = flatten(config).get(self.key)
        return None if v is None else str(v)

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "arms": list(self.arms)}


EXECUTION = Axis("execution.mode", ("fused", "naive"))


def parse_axis(text: str) -> tuple[str, tuple[str, str] | None]:
    """``"precision"`` -> ``("precision", None)``; ``"precision=fp8,bf16"`` -> ``("precision", ("fp8", "bf16"))``."""
    key, eq, values = text.partition("=")
    arms = tuple(v.strip() for v in values.split(",")) if eq else None
    if not key.strip() or (arms is not None and (len(arms) != 2 or not all(arms) or arms[0] == arms[1])):
        raise CompareError(
            f"--axis {text!r}: expected KEY or KEY=CANDIDATE,REFERENCE (two different values), "
            "e.g. --axis precision or --axis precision=fp8,bf16"
        )
    return key.strip(), arms  # type: ignore[return-value]


def differing_keys(configs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """``{key: its values}`` for every flattened key, the seed aside, whose value is not the same in all ``configs``."""
    flat = [flatten(c) for c in configs]
    keys = sorted(set().union(*flat)) if flat else []
    out = {}
    for key in keys:
        if key in ALWAYS_SWEPT:
            continue
        values = list(dict.fromkeys(str(f.get(key)) for f in flat))
        if len(values) > 1:
            out[key] = values
    return out


def resolve_key(name: str, configs: list[dict[str, Any]]) -> str:
    """The flattened key ``name`` means: itself, or its group's option field (``precision`` -> ``precision.name``)."""
    keys = set().union(*(flatten(c) for c in configs)) if configs else set()
    if name in keys:
        return name
    for field in LABEL_FIELDS:
        if f"{name}.{field}" in keys:
            return f"{name}.{field}"
    raise CompareError(f"--axis {name}: the runs' configs have no key {name!r} (nor {name}.name or {name}.mode)")


def order_arms(key: str, values: list[str]) -> tuple[str, str]:
    """Two values in the report's order: :data:`KNOWN_ORDERS` for the known axes, else sorted."""
    order = KNOWN_ORDERS.get(key)
    if order and all(v in order for v in values):
        return tuple(sorted(values, key=order.index))  # type: ignore[return-value]
    return tuple(sorted(values))  # type: ignore[return-value]


def choose_axis(configs: list[dict[str, Any]], sweep_dir: Path, requested: str | None = None) -> tuple[Axis, bool]:
    """The axis of a sweep's runs, and whether it was taken by default (nothing besides the seed differs).

    Named (``requested``): that key, with the arms given or the two values found. Found: the one key
    that differs; where several do and exactly one of them is a known axis (:data:`KNOWN_ORDERS`),
    that one (the others then fail the check that only the axis and the seed vary); where none
    differs, ``execution.mode``, the axis of ``make compare``, whose missing arm the caller names.

    Raises:
        CompareError: the key is unknown, the runs take more or fewer than two values of it, or
            several keys differ and none or more than one of them is a known axis.
    """
    diff = differing_keys(configs)
    if requested is not None:
        name, arms = parse_axis(requested)
        key = resolve_key(name, configs)
        found = diff.get(key) or list(dict.fromkeys(str(flatten(c).get(key)) for c in configs))
        if arms is None:
            if len(found) != 2:
                raise CompareError(
                    f"--axis {name}: the runs in {sweep_dir} take {len(found)} value(s) of {key} "
                    f"({', '.join(found)}); a comparison pairs two (name them: --axis {name}=A,B)"
                )
            arms = order_arms(key, found)
        return Axis(key, arms), False
    if not diff:
        return EXECUTION, True
    known = [k for k in diff if k in KNOWN_ORDERS]
    if len(diff) > 1 and len(known) != 1:
        listed = "; ".join(f"{k} ({' vs '.join(map(repr, v))})" for k, v in diff.items())
        raise CompareError(
            f"the runs in {sweep_dir} differ in {len(diff)} keys besides the seed: {listed}; a comparison "
            "varies one of them (name it with --axis KEY; the others must be equal in every run)"
        )
    key = known[0] if known else next(iter(diff))
    if len(diff[key]) != 2:
        raise CompareError(
            f"the runs in {sweep_dir} take {len(diff[key])} values of {key} ({', '.join(diff[key])}); a comparison "
            f"pairs two: give each pair its own sweep directory, or name them with --axis {key}=A,B"
        )
    return Axis(key, order_arms(key, diff[key])), False
