"""mlptrain's header-free kernels, compiled together: one NVRTC call for the set (issue #14).

NVRTC compiles overlap little on threads (docs/benchmarks.md, "Figures moved out of the code"), so
a fresh machine waits for how many programs it compiles more than for their size. The kernels whose
source needs no headers and no shapes share
one module, compiled (or loaded from CuPy's disk cache) at the start of a run: the data loader's
batch gather (:mod:`mlptrain.data.cuda.gather`) and the inf/NaN flags (:mod:`mlptrain.step.cuda.nonfinite`).
Their sources are here; what each computes, and why so, is documented in its module.
"""

from __future__ import annotations

import functools
from typing import Any

from mlptrain.base.cuda_source import Job

# out[i] = src[idx[r] * units + c] for i = r * units + c: whole rows in units of U (mlptrain.data.cuda.gather)
GATHER = r"""
struct __align__(16) mlptrain_u16 { unsigned long long lo, hi; };
#define MLPTRAIN_GATHER(NAME, U)                                                                 \
extern "C" __global__ void NAME(const U* src, const long long* idx, U* out, long long units,     \
                                long long n) {                                                  \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;                 \
         i += (long long)gridDim.x * blockDim.x) {                                              \
        const long long r = i / units, c = i - r * units;                                       \
        out[i] = src[idx[r] * units + c];                                                       \
    }                                                                                           \
}
MLPTRAIN_GATHER(mlptrain_gather_16, mlptrain_u16)
MLPTRAIN_GATHER(mlptrain_gather_8, unsigned long long)
MLPTRAIN_GATHER(mlptrain_gather_4, unsigned int)
MLPTRAIN_GATHER(mlptrain_gather_2, unsigned short)
MLPTRAIN_GATHER(mlptrain_gather_1, unsigned char)

// The same, for the batch of the current step, read on the device: rows order[first + r], first =
// (step - base) * batch + offset. A step captured into a CUDA graph gathers its own batch with it
// (mlptrain.data.loader.DataLoader.gather_in_step): the step count advances on the device every replay.
// Positions past the order's `len` entries wrap around (a replay past the epoch's end reads rows, never
// past the buffer).
#define MLPTRAIN_GATHER_AT(NAME, U)                                                              \
extern "C" __global__ void NAME(const U* src, const long long* order, long long len, U* out,     \
                                long long units, long long n, const long long* step,            \
                                const long long* base, long long batch, long long offset) {     \
    const long long first = (step[0] - base[0]) * batch + offset;                              \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;                 \
         i += (long long)gridDim.x * blockDim.x) {                                              \
        const long long r = i / units, c = i - r * units;                                       \
        long long k = (first + r) % len;                                                        \
        if (k < 0) k += len;                                                                    \
        out[i] = src[order[k] * units + c];                                                     \
    }                                                                                           \
}
MLPTRAIN_GATHER_AT(mlptrain_gather_at_16, mlptrain_u16)
MLPTRAIN_GATHER_AT(mlptrain_gather_at_8, unsigned long long)
MLPTRAIN_GATHER_AT(mlptrain_gather_at_4, unsigned int)
MLPTRAIN_GATHER_AT(mlptrain_gather_at_2, unsigned short)
MLPTRAIN_GATHER_AT(mlptrain_gather_at_1, unsigned char)
"""

# flags[y] |= any element of tensor y has all exponent bits set (mlptrain.step.cuda.nonfinite)
NONFINITE = r"""
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


@functools.cache
def module() -> Any:
    """The one ``RawModule`` of the sources above (compiled at its first ``get_function``)."""
    import cupy as cp  # here, not above: the sources and the jobs plan without a GPU (mlptrain.step.cuda.precompile)

    return cp.RawModule(code=GATHER + NONFINITE)


def function(name: str) -> Any:
    """The kernel ``name`` of :func:`module`."""
    return module().get_function(name)


def precompile_jobs() -> list[Job]:
    """The module, compiled ahead (:mod:`mlptrain.step.cuda.precompile`): no shapes or dtypes in its source, so one job
    whatever the run, started before the data is loaded."""
    return [Job("mlptrain's header-free kernels: the batch gather, the inf/NaN flags (one module)", "batch", _compile)]


def _compile() -> None:
    function("mlptrain_gather_1")  # the first function compiles the whole module
