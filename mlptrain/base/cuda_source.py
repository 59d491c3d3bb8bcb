"""Pieces of CUDA source that CPU modules write: plain Python, importable without a GPU.

The optimizer, the loss scaler, the learning-rate schedule and the step log each know their own
arithmetic, so each writes the CUDA statements of it (``mlptrain_lr_at``, the scaler update, ...)
next to its NumPy version. The GPU modules (:mod:`mlptrain.step.cuda.multitensor`,
:mod:`mlptrain.base.cuda.kernels`) compile and launch them. Each object that writes CUDA source also
declares how to compile it ahead (:class:`Job`, its ``precompile_jobs()``), beside that source;
:mod:`mlptrain.step.cuda.precompile` only runs the jobs on threads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KernelTail:
    """Work appended to a multi-tensor kernel's last block: CUDA statements, their parameters
    (raw arrays, named so they cannot clash with the kernel's own), the arguments, and the device
    functions they call. The training step hands the optimizer its end-of-step bookkeeping this way
    (:meth:`mlptrain.step.steplog.StepLog.tail`), which saves a kernel launch per step."""

    code: str
    params: str
    args: tuple
    preamble: str = ""


@dataclass(frozen=True)
class Job:
    """``run()`` compiles the kernels ``name`` describes, by the very call the run will make, on zero-filled scratch
    arrays (the run's own call then finds them in CuPy's cache); ``stage``: the part of the run that first launches
    them (:data:`mlptrain.step.cuda.precompile.STAGES`); ``scratch``: the bytes of zeros it allocates (a job over
    :data:`mlptrain.step.cuda.precompile.SCRATCH_LIMIT` is left to the kernel's first launch). ``run`` writes only to
    its own scratch and copies, never to the state of the object that declared it."""

    name: str
    stage: str
    run: Callable[[], Any]
    scratch: int = 0


def c_literal(x: float) -> str:
    """``x`` as a CUDA double literal that parses to the same double."""
    return repr(float(x))
