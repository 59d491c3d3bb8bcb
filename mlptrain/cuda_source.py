"""Pieces of CUDA source that CPU modules write: plain Python, importable without a GPU.

The optimizer, the loss scaler, the learning-rate schedule and the step log each know their own
arithmetic, so each writes the CUDA statements of it (``mlptrain_lr_at``, the scaler update, ...)
next to its NumPy version. The GPU modules (:mod:`mlptrain.gpu.multitensor`,
:mod:`mlptrain.gpu.kernels`) compile and launch them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelTail:
    """Work appended to a multi-tensor kernel's last block: CUDA statements, their parameters
    (raw arrays, named so they cannot clash with the kernel's own), the arguments, and the device
    functions they call. The training step hands the optimizer its end-of-step bookkeeping this way
    (:meth:`mlptrain.steplog.StepLog.tail`), which saves a kernel launch per step."""

    code: str
    params: str
    args: tuple
    preamble: str = ""


def c_literal(x: float) -> str:
    """``x`` as a CUDA double literal that parses to the same double."""
    return repr(float(x))
