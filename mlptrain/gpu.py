"""The GPU GEMM engine: one planned ``nvmath.linalg.advanced.Matmul`` per call site and signature.

cuBLASLt work is split into *planning* (choose an algorithm for these shapes, dtypes, layouts
and this epilog; it blocks the host) and *execution* (enqueue the kernel; it does not). A
stateful ``Matmul`` is planned once and executed every step: when a layer's forward runs again
with a new batch of the same shape, only the operand pointers change, which
``reset_operands_unchecked`` rewrites on the descriptor in a few microseconds.

A plan is cached per call site (``layer3.wgrad``) and operand signature (shapes, strides,
dtype, epilog). A training run therefore plans each GEMM once for the full batch, once for the
last partial batch, and once for the evaluation batch size, and never again.

Importing this module imports nvmath; :mod:`mlptrain.backend` only does so when a GPU is in use.
"""

from __future__ import annotations

import logging
from typing import Any

import cupy as cp
import nvmath
from nvmath.linalg.advanced import Matmul, MatmulEpilog

from mlptrain.epilogs import Epilog

log = logging.getLogger(__name__)

_NV_EPILOG = {e: getattr(MatmulEpilog, e.value) for e in Epilog}


def _signature(a: Any, b: Any, epilog: Epilog | None) -> tuple:
    return (a.shape, a.strides, b.shape, b.strides, a.dtype.str, epilog)


class NvmathGemm:
    """GEMMs through planned nvmath ``Matmul`` objects, with cuBLASLt epilogs.

    Args:
        tf32: float32 GEMMs with TF32 tensor cores (``COMPUTE_32F_FAST_TF32``) instead of FP32.
        autotune: time the heuristics' candidate algorithms once per plan and keep the fastest.
        stream: the CuPy stream to enqueue on (None: the current stream at each call).
    """

    def __init__(self, *, tf32: bool = False, autotune: bool = False, stream: Any = None) -> None:
        self.tf32 = tf32
        self.autotune = autotune
        self.stream = stream
        self._plans: dict[tuple, Matmul] = {}
        # nvmath logs every call at INFO; keep it quiet unless asked for.
        self._logger = logging.getLogger("mlptrain.nvmath")
        self._logger.setLevel(logging.WARNING)

    def _options(self, dtype: Any) -> dict[str, Any]:
        options: dict[str, Any] = {"logger": self._logger}
        if self.tf32 and dtype == cp.float32:
            options["compute_type"] = nvmath.linalg.advanced.MatmulComputeType.COMPUTE_32F_FAST_TF32
        return options

    def __call__(
        self, key: str, a: Any, b: Any, epilog: Epilog | None = None, *, bias: Any = None, relu_aux: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        inputs = {name: v for name, v in (("bias", bias), ("relu_aux", relu_aux)) if v is not None}
        sig = (key, *_signature(a, b, epilog))
        mm = self._plans.get(sig)
        if mm is None:
            mm = self._plan(key, a, b, epilog, inputs)
            self._plans[sig] = mm
        else:
            # Same shapes, strides and dtype by construction of the cache key: only the
            # pointers change, so the unchecked reset is safe and costs no validation.
            mm.reset_operands_unchecked(a=a, b=b, epilog_inputs=inputs or None)
        out = mm.execute(stream=self.stream)
        return out if isinstance(out, tuple) else (out, {})

    def _plan(self, key: str, a: Any, b: Any, epilog: Epilog | None, inputs: dict[str, Any]) -> Matmul:
        mm = Matmul(a, b, options=self._options(a.dtype), stream=self.stream)
        nv_epilog = _NV_EPILOG[epilog] if epilog is not None else None
        algorithms = mm.plan(epilog=nv_epilog, epilog_inputs=inputs or None, stream=self.stream)
        if self.autotune and len(algorithms) > 1:
            mm.autotune(iterations=5, stream=self.stream)
        algo = mm.algorithms[0]
        log.info(
            "planned %s: (%d, %d) @ (%d, %d) %s epilog=%s algorithm=%s tile=%s",
            key,
            *a.shape,
            *b.shape,
            a.dtype,
            epilog.name if epilog else "none",
            getattr(algo, "algorithm_id", "?"),
            getattr(algo, "tile", "?"),
        )
        return mm

    @property
    def num_plans(self) -> int:
        return len(self._plans)

    def free(self) -> None:
        """Release every plan's workspace and cuBLASLt descriptors."""
        for mm in self._plans.values():
            mm.free()
        self._plans.clear()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.free()
        except Exception:
            pass
