"""Element-wise CUDA kernels compiled from the source that CPU modules write.

The loss scaler, the learning-rate schedule and the step log write their per-step arithmetic as
CUDA statements (:mod:`mlptrain.base.cuda_source`); :func:`elementwise` turns such a body into a CuPy
``ElementwiseKernel`` once per distinct source, so a training step launches a compiled kernel and
builds nothing.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp


@functools.cache
def elementwise(
    in_params: str,
    out_params: str,
    body: str,
    name: str,
    *,
    preamble: str = "",
    loop_prep: str = "",
    after_loop: str = "",
    options: tuple[str, ...] = (),
    no_return: bool = False,
) -> Any:
    """A cached ``cupy.ElementwiseKernel`` (arguments as CuPy takes them)."""
    return cp.ElementwiseKernel(
        in_params,
        out_params,
        body,
        name,
        preamble=preamble,
        loop_prep=loop_prep,
        after_loop=after_loop,
        options=options,
        no_return=no_return,
    )
