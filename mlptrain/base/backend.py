"""Array module and device selection: where the CPU side of mlptrain meets CuPy.

One code path serves NumPy and CuPy through ``xp``, the array module of a :class:`Backend`
(Chainer's ``get_array_module`` pattern). ``import mlptrain`` never needs a GPU, CuPy or a
driver: this module imports CuPy and nvmath lazily, the first time a GPU is asked for or probed,
and it is the only module outside the ``cuda/`` folders (and :mod:`mlptrain.torch`) that imports them at all.

``device=auto`` takes the GPU when CuPy can see one, else NumPy on the CPU. ``device=gpu`` on a
machine without a usable GPU raises :class:`~mlptrain.base.errors.DeviceError` saying how to get one.

On the CPU a run's BLAS threads are sized to its step (:meth:`Backend.blas_threads`, threadpoolctl):
one thread for small GEMMs, whose threads cost more than they share, the library's default for large.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from mlptrain.base.errors import ConfigError, DeviceError

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "gpu")

# A CPU training step of fewer GEMM FLOPs than this runs on one BLAS thread: on a busy machine
# OpenBLAS's second thread makes small steps many times slower (docs/benchmarks.md, "BLAS threads on
# a busy CPU"); above it the library's default is kept: GEMMs of gigaflops are what threads are for
# on free cores (a user's OPENBLAS_NUM_THREADS still applies).
BLAS_ONE_THREAD_BELOW = 1e10

GPU_INSTALL_HINT = (
    "install the GPU extra on a machine with an NVIDIA GPU "
    "(pip install -e '.[cu12]', or '.[cu13]' for CUDA 13 drivers), or run with device=cpu"
)


@functools.lru_cache(maxsize=1)
def probe_gpu() -> tuple[bool, str]:
    """Return ``(available, reason)``: whether CuPy and nvmath can drive a CUDA device here.

    The result is cached for the life of the process. ``reason`` says what is missing when
    ``available`` is False (no CuPy, no driver, no device, no nvmath).
    """
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        return False, f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError when there is no driver
        return False, f"CuPy found no CUDA driver ({type(exc).__name__}: {exc})"
    if count < 1:
        return False, "CuPy sees no CUDA device"
    try:
        import nvmath.linalg.advanced  # noqa: F401
    except Exception as exc:
        return False, f"nvmath-python is not importable ({type(exc).__name__}: {exc})"
    return True, f"{count} CUDA device(s)"


@dataclass(frozen=True)
class Backend:
    """Where arrays live and which module computes on them.

    Attributes:
        device: ``"cpu"`` or ``"gpu"``.
        xp: ``numpy`` or ``cupy``.
    """

    device: str
    xp: ModuleType

    @property
    def is_gpu(self) -> bool:
        return self.device == "gpu"

    def to_host(self, a: Any) -> np.ndarray:
        """Copy ``a`` to a NumPy array. On the GPU this synchronises the device."""
        if self.is_gpu:
            return self.xp.asnumpy(a)
        return np.asarray(a)

    @contextlib.contextmanager
    def blas_threads(self, step_flops: float) -> Iterator[int | None]:
        """While training: the host BLAS on one thread for a step of fewer than :data:`BLAS_ONE_THREAD_BELOW`
        GEMM FLOPs (yields 1), else as it is (yields None; the GPU's steps use no host BLAS)."""
        if self.is_gpu or step_flops >= BLAS_ONE_THREAD_BELOW:
            yield None
            return
        from threadpoolctl import threadpool_limits

        log.info("cpu: one BLAS thread (a step of %.2g GEMM FLOPs, below %.0e)", step_flops, BLAS_ONE_THREAD_BELOW)
        with threadpool_limits(limits=1, user_api="blas"):  # restored when the run ends, or fails
            yield 1

    def free_cached_memory(self) -> None:
        """GPU: return the memory CuPy's pools cache to the device (after running out of memory)."""
        if self.is_gpu:
            self.xp.get_default_memory_pool().free_all_blocks()
            self.xp.get_default_pinned_memory_pool().free_all_blocks()

    def versions(self) -> dict[str, str]:
        """The versions of the array stack, for run records: NumPy, and CuPy and nvmath on the GPU."""
        out = {"numpy": np.__version__}
        if self.is_gpu:
            import nvmath

            out.update(
                cupy=self.xp.__version__,
                nvmath=nvmath.__version__,
                cuda_runtime=str(self.xp.cuda.runtime.runtimeGetVersion()),
            )
        return out

    def describe(self) -> str:
        """A short line for logs: the device name, or the CPU."""
        if not self.is_gpu:
            return "cpu (NumPy)"
        props = self.xp.cuda.runtime.getDeviceProperties(self.xp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return f"gpu {name} (CuPy {self.xp.__version__})"


def get_backend(device: str = "auto") -> Backend:
    """Return the backend for ``device`` (``auto``, ``cpu`` or ``gpu``).

    Raises:
        ConfigError: ``device`` is not one of :data:`DEVICES`.
        DeviceError: ``device="gpu"`` and no usable GPU was found.
    """
    if device not in DEVICES:
        raise ConfigError(f"device={device!r} is not a device; expected one of {', '.join(DEVICES)}")
    if device == "cpu":
        return Backend("cpu", np)
    available, reason = probe_gpu()
    if available:
        import cupy

        return Backend("gpu", cupy)
    if device == "gpu":
        raise DeviceError(f"device=gpu was requested but no usable CUDA GPU was found: {reason}; {GPU_INSTALL_HINT}")
    log.info("device=auto: no GPU (%s); using the CPU", reason)
    return Backend("cpu", np)


def get_array_module(a: Any) -> ModuleType:
    """``cupy`` for CuPy arrays, else ``numpy``; never imports CuPy itself."""
    module = type(a).__module__
    if module.startswith("cupy"):
        import cupy

        return cupy
    return np


def scalar(xp: ModuleType, value: Any, dtype: Any) -> Any:
    """A 0-d array of ``dtype`` holding ``value`` in ``xp``'s memory (a step count, a rate, a loss scale).

    Made on the host and copied over: ``cupy.full`` and ``cupy.ones`` launch CuPy's fill or copy
    kernel, which a fresh machine must first compile (NVRTC, a kernel at a time, issue #14); a
    host-to-device copy needs no kernel. One element, then a view without the axis: CuPy copies a
    0-d host array with its fill kernel too.
    """
    return xp.asarray(np.array([value], dtype=dtype)).reshape(())
