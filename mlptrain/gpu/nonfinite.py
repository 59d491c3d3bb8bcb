"""Which of many tensors hold an inf or NaN: one launch, one program compiled once per machine.

The training loop checks the parameters (and gradients) every log interval
(:func:`mlptrain.faults.nonfinite_tensors`). A CuPy reduction per tensor compiles a kernel per
dtype, shape and block size the first time it runs: the default digits run compiled 20 of them,
most of its time from a cold cache. This kernel reads a table of pointers and sizes instead, so one
program serves every model, and it needs no headers: a value is inf or NaN
exactly when its exponent bits are all ones, which it tests on the raw bits of each dtype
(float16 ``0x7C00``, bfloat16 ``0x7F80``, float32 ``0x7F800000``, float64 ``0x7FF0...``). The four
variants are compiled in one NVRTC call with mlptrain's other header-free kernels
(:mod:`mlptrain.gpu.plain_kernels`) and cached on disk by CuPy.

Launch: ``grid = (blocks, tensors)``; block ``y`` scans tensor ``y`` with a grid-stride loop and
sets ``flags[y]`` if any element is non-finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cupy as cp
import numpy as np

from mlptrain.gpu.plain_kernels import function

_THREADS = 256


def nonfinite_flags(arrays: Sequence[Any]) -> list[bool]:
    """For each CuPy array (float16, bfloat16, float32 or float64), whether it holds inf or NaN.

    One launch per dtype present, and a wait for the device per dtype as its flags come back
    (no CuPy indexing or concatenation, which would compile kernels of their own).
    """
    flags = [False] * len(arrays)
    groups: dict[str, list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(np.dtype(a.dtype).name, []).append(i)
    for dtype, index in groups.items():
        kernel = function(f"mlptrain_nonfinite_{dtype}")
        # the scan reads a.size elements from the first: any one-piece layout (C or F order) will do
        tensors = [
            a if a.flags.c_contiguous or a.flags.f_contiguous else cp.ascontiguousarray(a)
            for a in (arrays[i] for i in index)
        ]
        ptrs = cp.asarray(np.array([a.data.ptr for a in tensors], dtype=np.uint64))
        sizes = cp.asarray(np.array([a.size for a in tensors], dtype=np.int64))
        out = cp.zeros(len(tensors), dtype=cp.int32)
        blocks = max(1, min(-(-max(a.size for a in tensors) // _THREADS), 1024))
        kernel((blocks, len(tensors)), (_THREADS,), (ptrs, sizes, out))
        for i, f in zip(index, out.get().tolist(), strict=True):
            flags[i] = bool(f)
    return flags
