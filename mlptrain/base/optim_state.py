"""An optimizer's per-parameter state (SGD's momentum, Adam's moments): the dtype it is stored in
(``optimizer.state_dtype``), the arithmetic of an element stored narrower than the master weights (written once
for NumPy and once as CUDA text), and its host form in a checkpoint.

The update of an element does not change: its state is *read and widened* to the update's compute type
(the master weights' dtype, ``P``), updated there as before, and *stored back rounded to nearest even*.
The update goes on with the value in registers, not the rounded one: SGD's weight step uses the unrounded
``buf``, Adam's the unrounded moments. With ``optimizer.state_dtype=null`` the state is the master's dtype,
widening and storing are no-ops, and the arithmetic is what it was, bit for bit.

bfloat16 is the one narrow dtype: it has float32's exponent range, so Adam's first moment (and SGD's momentum)
keeps its magnitude, with 8 bits of mantissa. float16 is refused: its range is too small for a state of small
gradients (below its smallest normal, 6e-5, a value loses mantissa bits; Adam's ``g * g`` is there once
``|g| < 8e-3``, and a momentum of gradients below 6e-5 is too). A state an optimizer names in
``wide_states`` stays in the master dtype whatever the setting: Adam's second moment ``exp_avg_sq`` decays by
``1 - beta2`` = 0.1% a step, less than half a bfloat16 step (0.2% to 0.4% of the value), so rounded to nearest in
bfloat16 it would never decay and only grow (docs/benchmarks.md, "Optimizer state in bfloat16"). A bfloat16
element is 2 bytes where a float32 one is 4: with float32 master weights SGD's update reads and writes 16 bytes a
parameter instead of 20, Adam's 24 instead of 28 (docs/tutorial.md, section 6). The cost: a change of less than
half a bfloat16 step rounds away from the momentum and the first moment.

A checkpoint written before ``wide_states`` holds Adam's ``exp_avg_sq`` as bfloat16 bits: :func:`load` widens it
to the master dtype (exact: every bfloat16 is a float32) and says which it widened, for the trainer to log.

Rounding goes through float32 (``float64 -> float32 -> bfloat16``), as CuPy's ``bfloat16(double)`` does, so that
a float64 master's state rounds the same on the CPU and the GPU (for float32 masters it is one rounding).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import ml_dtypes
import numpy as np

from mlptrain.base.errors import ConfigError

STATE_DTYPES: dict[str, np.dtype] = {"bfloat16": np.dtype(ml_dtypes.bfloat16)}


def state_dtype_problem(name: Any) -> str | None:
    """What is wrong with ``optimizer.state_dtype=name`` (None: null or a known dtype)."""
    if name is None or name in STATE_DTYPES:
        return None
    small = " (float16's range is too small: a momentum of gradients below 6e-5 loses its bits)"
    why = small if name == "float16" else ""
    return f"optimizer.state_dtype={name!r} must be null (the master weights' dtype) or bfloat16{why}"


def state_dtype(name: str | None, master: Any, optimizer: Any) -> np.dtype:
    """The dtype ``optimizer``'s state is stored in: ``master``'s for ``None``, else ``name``'s (ConfigError for an
    unknown name, or a narrow dtype for an optimizer whose update does not widen and round its state)."""
    if (problem := state_dtype_problem(name)) is not None:
        raise ConfigError(problem)
    if name is not None and not optimizer.narrow_state:
        raise ConfigError(
            f"optimizer.state_dtype={name} needs sgd, adam or adamw: {type(optimizer).__name__} keeps its state in "
            "the master dtype (its update does not widen and round it); use optimizer.state_dtype=null"
        )
    return np.dtype(master) if name is None else STATE_DTYPES[name]


def layout(name: str | None, optimizer: Any) -> tuple[np.dtype, dict[str, np.dtype], frozenset[str]]:
    """``optimizer``'s state under ``optimizer.state_dtype=name``: the setting's dtype (:func:`state_dtype`), each
    state's dtype (the setting's, but the master's for the optimizer's ``wide_states``), and the states stored
    narrower than the master (the update kernel's ``S`` roles)."""
    master = np.dtype(optimizer.params[0].value.dtype)
    dtype = state_dtype(name, master, optimizer)
    dtypes = {s: master if s in optimizer.wide_states else dtype for s in optimizer.state_names}
    return dtype, dtypes, frozenset(s for s, d in dtypes.items() if d != master)


def kept_wide(optimizer: Any) -> frozenset[str]:
    """The states ``optimizer`` keeps in the master dtype although its setting is narrow: those an older checkpoint
    of the same setting holds as bfloat16 bits (empty with ``optimizer.state_dtype=null``)."""
    narrow_setting = optimizer.state_dtype != optimizer.params[0].value.dtype
    return frozenset(optimizer.wide_states) if narrow_setting else frozenset()


def zeros(xp: Any, params: Any, dtypes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{param name: {state name: zeros of the parameter's shape in the state's dtype}}`` (``dtypes``: by state)."""
    return {p.name: {s: xp.zeros(p.value.shape, d) for s, d in dtypes.items()} for p in params}


def is_narrow(state: Any, master: Any) -> bool:
    """Whether ``state`` (an array) is stored narrower than the master dtype ``master``."""
    return np.dtype(state.dtype) != np.dtype(master)


# --- NumPy (the CPU's update) ---------------------------------------------------------------------------------


def widen(state: Any, master: Any) -> Any:
    """The state array as the update reads it: ``state`` itself when already in ``master`` (updated in place, as
    without a narrow state), else a copy widened to ``master`` (exact: every bfloat16 is a float32)."""
    return state.astype(master) if is_narrow(state, master) else state


def store(state: dict[str, Any], **wide: Any) -> None:
    """Write each updated array of ``wide`` back into its ``state[name]``, rounded to nearest even through float32
    (nothing where it is the state array itself: :func:`widen` gave it, updated in place)."""
    for name, w in wide.items():
        if w is not state[name]:
            state[name][...] = w.astype(np.float32).astype(state[name].dtype)


def to_file(state: Any) -> Any:
    """A host state array as a checkpoint keeps it: bfloat16 as its ``uint16`` bit pattern (``np.save`` writes
    ml_dtypes' bfloat16 as raw ``V2`` bytes that read back as no float), any other dtype as it is."""
    return state.view(np.uint16) if state.dtype == STATE_DTYPES["bfloat16"] else state


def _host(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.array(a)  # (CuPy's .get(): a copy to the host)


def to_host(state: dict[str, dict[str, Any]], t: Any) -> dict[str, np.ndarray]:
    """Host copies by ``"<param>/<state>"`` in their checkpoint form (:func:`to_file`), and ``"t"``, the count of
    applied updates."""
    out = {f"{name}/{s}": to_file(_host(a)) for name, st in state.items() for s, a in st.items()}
    return {**out, "t": _host(t)}


def load(
    xp: Any, state: dict[str, dict[str, Any]], t: Any, arrays: dict[str, Any], older_bf16: Collection[str] = ()
) -> list[str]:
    """Inverse of :func:`to_host`, in place; names and shapes must match exactly (KeyError, ValueError). A state
    named in ``older_bf16`` (:func:`kept_wide`) may come as bfloat16 bits, from before it was kept wide: it is
    widened to its dtype, exactly. Returns the ``"<param>/<state>"`` keys so widened."""
    widened = []
    for name, st in state.items():
        for s, a in st.items():
            key = f"{name}/{s}"
            if key not in arrays:
                raise KeyError(f"optimizer state {key!r} is missing")
            src = np.asarray(arrays[key])
            if tuple(src.shape) != tuple(a.shape):
                raise ValueError(f"optimizer state {key!r} has shape {tuple(src.shape)}, expected {a.shape}")
            if s in older_bf16 and src.dtype == np.uint16:  # (saved in bfloat16, before the state was kept wide)
                src = src.view(STATE_DTYPES["bfloat16"]).astype(a.dtype)
                widened.append(key)
            a[...] = xp.asarray(from_file(src, a.dtype, key), dtype=a.dtype)
    t[...] = xp.asarray(arrays["t"])
    return widened


def from_file(saved: Any, dtype: Any, key: str) -> Any:
    """The inverse of :func:`to_file` for a state array of ``dtype`` (ValueError if the file's dtype cannot be it)."""
    if np.dtype(dtype) == STATE_DTYPES["bfloat16"]:
        if saved.dtype != np.uint16:
            raise ValueError(f"optimizer state {key!r} is {saved.dtype}, expected bfloat16 bits (uint16)")
        return saved.view(STATE_DTYPES["bfloat16"])
    if saved.dtype.kind != "f":
        raise ValueError(f"optimizer state {key!r} is {saved.dtype}, expected {np.dtype(dtype).name}")
    return saved


# --- CUDA (the GPU's multi-tensor update: mlptrain.step.optim) ---------------------------------------------------


def cuda_read(role: str, narrow: bool) -> str:
    """The state element ``$role`` widened to the update's type ``P`` (a narrow role's placeholder is ``S``)."""
    return f"((P)(float)${role})" if narrow else f"${role}"


def cuda_store(narrow: Collection[str], **values: str) -> str:
    """``$role = value;`` for each role, the value rounded to nearest even to ``S`` through float32 for a role in
    ``narrow`` (the state names stored narrower than ``P``)."""
    return " ".join(f"${r} = (S)(float)({v});" if r in narrow else f"${r} = {v};" for r, v in values.items())
