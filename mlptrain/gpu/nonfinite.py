"""Which of many tensors hold an inf or NaN: one launch, one program compiled once per machine.

The training loop checks the parameters (and gradients) every log interval
(:func:`mlptrain.faults.nonfinite_tensors`). A CuPy reduction per tensor compiles a kernel per
dtype, shape and block size the first time it runs: on the H200 the default digits run compiled
20 of them, 7 of its 10 seconds from a cold cache. This kernel reads a table of pointers and
sizes instead, so one program serves every model, and it needs no headers: a value is inf or NaN
exactly when its exponent bits are all ones, which it tests on the raw bits of each dtype
(float16 ``0x7C00``, bfloat16 ``0x7F80``, float32 ``0x7F800000``, float64 ``0x7FF0...``). The four
variants are one module, compiled in one NVRTC call and cached on disk by CuPy.

Launch: ``grid = (blocks, tensors)``; block ``y`` scans tensor ``y`` with a grid-stride loop and
sets ``flags[y]`` if any element is non-finite.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import cupy as cp
import numpy as np

_SOURCE = r"""
#define MLPTRAIN_NONFINITE(NAME, U, EXP)                                                       \
extern "C" __global__ void NAME(const unsigned long long* ptrs, const long long* sizes,       \
                                int* flags) {                                                 \
    const U* a = reinterpret_cast<const U*>(ptrs[blockIdx.y]);                                \
    const long long n = sizes[blockIdx.y];                                                    \
    bool bad = false;                                                                         \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;               \
         i += (long long)gridDim.x * blockDim.x)                                              \
        bad |= (a[i] & (U)(EXP)) == (U)(EXP);                                                 \
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(&flags[blockIdx.y], 1);           \
}
MLPTRAIN_NONFINITE(mlptrain_nonfinite_float16, unsigned short, 0x7C00u)
MLPTRAIN_NONFINITE(mlptrain_nonfinite_bfloat16, unsigned short, 0x7F80u)
MLPTRAIN_NONFINITE(mlptrain_nonfinite_float32, unsigned int, 0x7F800000u)
MLPTRAIN_NONFINITE(mlptrain_nonfinite_float64, unsigned long long, 0x7FF0000000000000ull)
"""

_THREADS = 256


@functools.cache
def _module() -> Any:
    return cp.RawModule(code=_SOURCE)


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
        kernel = _module().get_function(f"mlptrain_nonfinite_{dtype}")
        # the scan reads a.size elements from the first: any one-piece layout (C or F order) will do
        tensors = [a if a.flags.c_contiguous or a.flags.f_contiguous else cp.ascontiguousarray(a)
                   for a in (arrays[i] for i in index)]  # fmt: skip
        ptrs = cp.asarray(np.array([a.data.ptr for a in tensors], dtype=np.uint64))
        sizes = cp.asarray(np.array([a.size for a in tensors], dtype=np.int64))
        out = cp.zeros(len(tensors), dtype=cp.int32)
        blocks = max(1, min(-(-max(a.size for a in tensors) // _THREADS), 1024))
        kernel((blocks, len(tensors)), (_THREADS,), (ptrs, sizes, out))
        for i, f in zip(index, out.get().tolist(), strict=True):
            flags[i] = bool(f)
    return flags
