"""Whether a checkpoint's training state fits the trainer built for it: checked before anything is loaded.

:meth:`mlptrain.step.trainer.Trainer.load_state_dict` calls :func:`check` first: the architecture, the
parameters' dtype (the precision) and the optimizer must be the run's, and the arrays exactly those the
trainer's :meth:`~mlptrain.step.trainer.Trainer.state_dict` writes (names, shapes, dtypes; the data's
normalisation aside, which is compared elsewhere). One exception: a checkpoint written before Adam kept its
second moment in the master dtype under ``optimizer.state_dtype=bfloat16`` holds it as bfloat16 bits, which the
optimizer widens on load (:func:`mlptrain.base.optim_state.load`). Each refusal names the checkpoint and says
how to resume it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlptrain.base import optim_state
from mlptrain.base.errors import CheckpointError
from mlptrain.config import shell
from mlptrain.nn import fp8


def check(tr: Any, arrays: dict[str, np.ndarray], m: dict[str, Any], where: str) -> None:
    """Raise :class:`~mlptrain.base.errors.CheckpointError` unless ``arrays`` and meta ``m`` (of the checkpoint
    ``where``) fit the trainer ``tr``: its widths, parameter dtype, optimizer and every array it holds."""
    if m["widths"] != tr.widths:
        raise CheckpointError(
            f"{where} is for model {_w(m['widths'])} but this run builds {_w(tr.widths)}; "
            f"resume with {shell.override('model.hidden', m['widths'][1:-1])} or start a new run"
        )
    members = m.get("members", 1)  # (checkpoints before ensembles hold one model)
    if members != tr.members:
        raise CheckpointError(
            f"{where} holds an ensemble of {members} member(s) but this run builds {tr.members}; "
            f"resume with {shell.override('ensemble.size', members)}"
            if members > 1
            else f"{where} holds one model but this run builds an ensemble of {tr.members}; resume with ensemble.size=1"
        )
    want_dtype = np.dtype(tr.precision.param_dtype).name
    if m["param_dtype"] != want_dtype:
        raise CheckpointError(
            f"{where} holds {m['param_dtype']} parameters (precision={m['precision']}) but this run uses "
            f"precision={tr.precision.name} with {want_dtype} parameters; resume with precision={m['precision']}"
        )
    if m["optimizer"] != tr.cfg.optimizer.name:
        raise CheckpointError(
            f"{where} holds {m['optimizer']} optimizer state but this run uses "
            f"optimizer={tr.cfg.optimizer.name}; resume with optimizer={m['optimizer']}"
        )
    _check_state_dtype(tr, m, where)
    expected = {f"param/{p.name}": (tuple(p.value.shape), want_dtype) for p in tr.model.params}
    expected.update({f"optim/{k}": (tuple(v.shape), v.dtype.name) for k, v in tr.optimizer.state_dict().items()})
    older = {f"optim/{n}/{s}": "uint16" for n in tr.optimizer.state for s in optim_state.kept_wide(tr.optimizer)}
    expected.update(fp8.expected_arrays(tr.gemm, arrays))
    for key, (shape, dtype) in expected.items():
        a = arrays.get(key)
        if a is None:
            raise CheckpointError(f"{where} has no {key!r} (optimizer settings such as momentum changed?)")
        if a.shape != shape or (dtype is not None and a.dtype.name not in (dtype, older.get(key))):
            raise CheckpointError(
                f"{where}: {key!r} is {a.dtype.name}{list(a.shape)}, expected {dtype or a.dtype.name}{list(shape)}"
            )
    extra = sorted(k for k in set(arrays) - set(expected) if not k.startswith("data/"))
    if extra:
        raise CheckpointError(
            f"{where} has state this run does not use: {', '.join(extra)} (optimizer settings changed?)"
        )


def _check_state_dtype(tr: Any, m: dict[str, Any], where: str) -> None:
    """Refused, not cast: a resumed run continues the saved one bit for bit, and a cast state would not (rounding
    float32 to bfloat16 loses bits; widening changes the update's arithmetic from that step on)."""
    saved, now = m.get("optimizer_state_dtype") or m["param_dtype"], tr.optimizer.state_dtype.name
    if saved != now:
        setting = "null" if saved == m["param_dtype"] else saved
        raise CheckpointError(
            f"{where} holds {saved} optimizer state but this run keeps it in {now}; resume with "
            f"optimizer.state_dtype={setting}, or start a new run"
        )


def _w(widths: list[int]) -> str:
    return "-".join(map(str, widths))
