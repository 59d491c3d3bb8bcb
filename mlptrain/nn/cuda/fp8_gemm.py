"""FP8 GEMMs on Hopper through the raw cuBLASLt bindings nvmath ships, on memory CuPy owns.

Why not ``nvmath.linalg.advanced.Matmul``, which plans FP8 too? Its FP8 operands must be torch
float8 tensors (CuPy has no float8 dtype; nvmath maps dtypes by name), and then nvmath allocates
D and the epilog's outputs (relu_aux, the bias gradient) through *torch's* allocator. The training
step is captured into a CUDA graph by CuPy: memory torch's caching allocator hands out during
CuPy's capture is not the graph's (a block torch frees and reuses would be rewritten under a
replay), and a ``cudaMalloc`` inside the capture fails it. The bindings
(``nvmath.bindings.cublasLt``, what nvmath's ``matmulmod.py`` itself drives) take raw pointers: the
FP8 bytes are ``uint8`` CuPy arrays, D, relu_aux, gelu_aux, the bias gradient and the workspace are
CuPy allocations, the scales are the float32 device arrays of :mod:`mlptrain.nn.cuda.fp8_kernels`. So
every allocation of the step stays in CuPy's pool, as in 16-bit, and torch is not needed at all.

One :class:`Fp8Matmul` per call site and shape: ``D (M, N) = (A8 @ B8) * scale_a_inv * scale_b_inv``
with ``TRANSA = T`` (A row-major (M, K): cuBLASLt's column-major (K, M), transposed), B column-major
(K, N), D bfloat16 column-major; ``COMPUTE_32F``. The descriptor is made and the algorithm chosen
(cuBLASLt's heuristics) once, at the first call; every call after sets the pointers and enqueues. The
plan is :class:`mlptrain.nn.cuda.cublaslt.LtMatmul`, the torch front end's too; this module gives it
FP8's attributes, layouts and scale pointers, a workspace from CuPy's pool and CuPy's stream.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import cupy as cp
import numpy as np
from nvmath import CudaDataType
from nvmath.bindings import cublas
from nvmath.bindings import cublasLt as lt

from mlptrain.nn.cuda import epilogue_kernels
from mlptrain.nn.cuda.cublaslt import DESC, PREF, LayoutArgs, LtMatmul, handle
from mlptrain.nn.cuda.streams import result_array, results_allocator
from mlptrain.nn.epilogs import Epilog, gelu_aux_shape, relu_aux_shape
from mlptrain.nn.fp8 import Fp8Call, Fp8Gemm, Fp8Scaling

log = logging.getLogger(__name__)

_TYPES = {"e4m3": CudaDataType.CUDA_R_8F_E4M3, "e5m2": CudaDataType.CUDA_R_8F_E5M2}
_BF16 = CudaDataType.CUDA_R_16BF
_BIAS_IN = (Epilog.BIAS, Epilog.RELU_BIAS, Epilog.RELU_AUX_BIAS, Epilog.GELU_BIAS, Epilog.GELU_AUX_BIAS)
_BGRAD_OUT = {Epilog.DRELU_BGRAD: "drelu_bgrad", Epilog.DGELU_BGRAD: "dgelu_bgrad"}
_RELU_AUX = (Epilog.RELU_AUX_BIAS, Epilog.DRELU, Epilog.DRELU_BGRAD)
_GELU_AUX = (Epilog.GELU_AUX_BIAS, Epilog.DGELU, Epilog.DGELU_BGRAD)


class Fp8Matmul(LtMatmul):
    """One FP8 GEMM shape and epilog, planned once: ``D (M, N) bf16 = A8 (M, K) @ B8 (K, N)``, scaled.

    Args:
        m, n, k: the GEMM's dimensions (multiples of 16).
        formats: ``(A's, B's)``: ``"e4m3"`` or ``"e5m2"`` (not both e5m2).
        epilog: one of :data:`mlptrain.nn.epilogs_fp8.FP8_EPILOGS`.
        workspace_bytes: the cap on cuBLASLt's workspace.
        fast_accum: cuBLASLt's FP8 fast accumulation (fewer promotions of the partial sums to float32).
    """

    def __init__(
        self,
        m: int,
        n: int,
        k: int,
        formats: tuple[str, str],
        epilog: Epilog | None,
        *,
        workspace_bytes: int,
        fast_accum: bool = False,
    ) -> None:
        self.m, self.n, self.k, self.epilog = m, n, k, epilog
        self.workspace_bytes = workspace_bytes
        attributes: list[tuple[Any, Any]] = [
            (DESC.TRANSA, cublas.Operation.T),  # A (M, K) row-major is (K, M) column-major
            (DESC.TRANSB, cublas.Operation.N),
            (DESC.EPILOGUE, lt.Epilogue[epilog.name] if epilog is not None else lt.Epilogue.DEFAULT),
        ]
        if fast_accum:
            attributes.append((DESC.FAST_ACCUM, 1))
        if epilog in _BIAS_IN or epilog in _BGRAD_OUT:
            attributes.append((DESC.BIAS_DATA_TYPE, _BF16))  # the bias (or its gradient) in D's type
        if epilog in _RELU_AUX:
            attributes.append((DESC.EPILOGUE_AUX_LD, relu_aux_shape(m, n)[0] * 8))  # in bits, as nvmath sets it
        if epilog in _GELU_AUX:
            attributes.append((DESC.EPILOGUE_AUX_LD, gelu_aux_shape(m, n)[0]))
            attributes.append((DESC.EPILOGUE_AUX_DATA_TYPE, _BF16))
        layouts: list[LayoutArgs] = [  # as created: column-major, one matrix
            (_TYPES[formats[0]], k, m, k, None),  # A^T as cuBLASLt sees it: (K, M), ld K
            (_TYPES[formats[1]], k, n, k, None),  # B (K, N) column-major, ld K
            (_BF16, m, n, m, None),  # C and D (M, N) column-major, ld M
        ]
        device = cp.cuda.Device().id
        super().__init__(handle(device), cublas.ComputeType.COMPUTE_32F, CudaDataType.CUDA_R_32F, attributes, layouts)

    def set_pointers(self, a_inv: Any, b_inv: Any, bias: Any = None, aux: Any = None) -> None:
        """The scale, bias (or bias-gradient) and aux pointers of the next :meth:`run` (host calls only)."""
        self.set(DESC.A_SCALE_POINTER, a_inv.data.ptr)
        self.set(DESC.B_SCALE_POINTER, b_inv.data.ptr)
        if bias is not None:
            self.set(DESC.BIAS_POINTER, bias.data.ptr)
        if aux is not None:
            self.set(DESC.EPILOGUE_AUX_POINTER, aux.data.ptr)

    def plan(self, key: str) -> None:
        """cuBLASLt's best algorithm for this GEMM within the workspace cap, and the workspace (outside any capture)."""
        prefs = [(PREF.MAX_WORKSPACE_BYTES, self.workspace_bytes)]
        self.choose(prefs, 1, self._what(key), padded=self.epilog is not None, workspace=_pool_workspace)
        log.info("planned FP8 %s, workspace %d bytes", self._what(key), self.workspace_size)

    def run(self, a8: Any, b8: Any, d: Any) -> None:
        """Enqueue the GEMM on the current stream (the pointers as :meth:`set_pointers` left them)."""
        self.enqueue(a8.data.ptr, b8.data.ptr, d.data.ptr, cp.cuda.get_current_stream().ptr)

    def _what(self, key: str) -> str:
        return f"{key} ({self.m}, {self.k}) @ ({self.k}, {self.n}) epilog={self.epilog.name if self.epilog else 'none'}"


def _pool_workspace(nbytes: int) -> tuple[Any, int]:
    """A workspace from CuPy's default pool whichever allocator is current, as NvmathGemm's (nn/cuda/gemm.py,
    DefaultPoolWorkspaces): long-lived, it must not split the CUDA graph's pool of step arrays."""
    memory = cp.get_default_memory_pool().malloc(nbytes)
    return memory, memory.ptr


class GpuFp8Gemm(Fp8Gemm):
    """:class:`mlptrain.nn.fp8.Fp8Gemm` on the GPU: the casts of :class:`~mlptrain.nn.cuda.fp8_kernels.GpuFp8Scaling`,
    the GEMMs of :class:`Fp8Matmul`, and the 16-bit :class:`~mlptrain.nn.cuda.gemm.NvmathGemm` where FP8 cannot run."""

    def __init__(
        self,
        base: Any,
        scaling: Fp8Scaling,
        mode: str = "fused",
        *,
        dtype: Any = None,
        workspace_mib: int | None = 64,
        fast_accum: bool = False,
        own_drelu_bgrad: bool = True,
    ) -> None:
        super().__init__(base, scaling, mode, dtype=dtype)
        self.workspace_cap = int(workspace_mib if workspace_mib is not None else 256) * 2**20
        self.fast_accum = fast_accum
        # DRELU_BGRAD as the plain FP8 GEMM and mlptrain's kernel (nn/cuda/epilogue_kernels.py), not cuBLASLt's epilogue
        self.own_drelu_bgrad = own_drelu_bgrad
        self._plans: dict[tuple, Fp8Matmul] = {}

    def matmul(self, call: Fp8Call) -> tuple[Any, dict[str, Any]]:
        a, b, epilog, inputs, out_dtype, key = call.a, call.b, call.epilog, call.inputs, call.out_dtype, call.key
        relu_aux = None
        if epilog is Epilog.DRELU_BGRAD and self.own_drelu_bgrad and np.dtype(out_dtype).name == "bfloat16":
            relu_aux, epilog, inputs = inputs["relu_aux"], None, {}  # D column-major still: call.c_order is False
        (m, k), n = a[0].shape, b[0].shape[1]
        if call.c_order:  # D (M, N) in C order is D^T (N, M) column-major: B^T @ A^T, on the same FP8 bytes
            a, b, m, n = (b[0].T, *b[1:]), (a[0].T, *a[1:]), n, m  # B^T (N, K) row-major, A^T (K, M) column-major
        results = results_allocator()  # the side stream's results come from the main stream's free lists
        with cp.cuda.using_allocator(results) if results is not None else contextlib.nullcontext():
            d = cp.empty((m, n), dtype=out_dtype, order="F")  # (M, N) column-major
            aux = _aux_outputs(epilog, m, n, out_dtype)
        bias = inputs.get("bias")
        if bias is not None and (bias.dtype != out_dtype or not bias.flags.c_contiguous):
            raise ValueError(f"{key}: the FP8 GEMM's bias must be a contiguous {out_dtype} vector; got {bias.dtype}")
        if bias is None and epilog in _BGRAD_OUT:
            bias = aux[_BGRAD_OUT[epilog]]  # DRELU_BGRAD / DGELU_BGRAD write the bias gradient at BIAS_POINTER
        mask = next((v for v in (*aux.values(), *inputs.values()) if v is not bias), None)  # relu_aux or gelu_aux
        mm = self._plans.get((key, m, n, k, (a[2], b[2]), epilog))
        if mm is None:
            mm = self._plan(key, m, n, k, (a[2], b[2]), epilog)
        mm.set_pointers(a[1], b[1], bias=bias, aux=mask)
        if mm.algo is None:  # the first call: the heuristics see the pointers set (nvmath sets them first too)
            mm.plan(key)
        mm.run(a[0], b[0], d)
        if relu_aux is not None:  # DRELU_BGRAD: D masked in place, and its bias gradient (only it a result)
            aux = {"drelu_bgrad": epilogue_kernels.drelu(d, relu_aux, alloc=result_array)}
        return (d.T if call.c_order else d), aux

    def bias_gradient(self, b: Any) -> Any:
        """BGRADB's bias gradient as :func:`mlptrain.nn.cuda.epilogue_kernels.bgradb` where b (K, N) suits it."""
        if b.dtype.name == "bfloat16" and b.flags.c_contiguous:
            return epilogue_kernels.bgradb(b)
        return super().bias_gradient(b)

    def _plan(self, key: str, m: int, n: int, k: int, formats: tuple[str, str], epilog: Epilog | None) -> Fp8Matmul:
        """A new descriptor for this call site, shape, formats and epilog (its algorithm chosen at its first run)."""
        mm = Fp8Matmul(m, n, k, formats, epilog, workspace_bytes=self.workspace_cap, fast_accum=self.fast_accum)
        self._plans[(key, m, n, k, formats, epilog)] = mm
        return mm

    def workspace_bytes(self) -> int:
        """Bytes of the FP8 plans' workspaces and of the 16-bit engine's."""
        own = sum(mm.workspace_size for mm in self._plans.values())
        return own + (self.base.workspace_bytes() if hasattr(self.base, "workspace_bytes") else 0)

    def free(self) -> None:
        """Release every FP8 plan (after the device is idle) and the 16-bit engine's."""
        cp.cuda.Device().synchronize()
        for mm in self._plans.values():
            mm.free()
        self._plans.clear()
        super().free()


def _aux_outputs(epilog: Epilog | None, m: int, n: int, dtype: Any) -> dict[str, Any]:
    """The epilog's outputs, allocated as nvmath allocates them (column-major; padding undefined)."""
    if epilog is Epilog.RELU_AUX_BIAS:
        return {"relu_aux": cp.empty(relu_aux_shape(m, n), dtype=cp.uint8, order="F")}
    if epilog is Epilog.GELU_AUX_BIAS:
        return {"gelu_aux": cp.empty(gelu_aux_shape(m, n), dtype=dtype, order="F")}
    if epilog in _BGRAD_OUT:
        return {_BGRAD_OUT[epilog]: cp.empty(m, dtype=dtype)}
    return {}
