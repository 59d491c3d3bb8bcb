"""Raw cuBLASLt GEMMs on torch tensors: the plans of :class:`mlptrain.torch.torch_gemm.TorchCublasLtGemm` (#33).

nvmath's stateful ``Matmul`` (now the GPU tests' oracle, ``tests/gpu/torch_nvmath_oracle.py``) costs in
per-call Python (``reset_operands_unchecked``, ``execute``'s bookkeeping, ``release_operands``) about five
times a ``torch.matmul``'s host time, and a small MLP's step is host-bound. This engine makes the very
``cublasLtMatmul`` call nvmath makes, through the bindings nvmath ships (``nvmath.bindings.cublasLt``) and
the raw plan FP8 runs on too (:class:`mlptrain.nn.cuda.cublaslt.LtMatmul`): the same descriptor, layouts,
heuristic preferences and algorithm (the first of cuBLASLt's heuristics), so its results are nvmath's bit
for bit. Planned once per signature; per call it allocates D and the epilog's outputs
(``torch.empty_strided``: torch's caching allocator on the current stream, so a ``torch.cuda.graph``
capture puts them in its pool), sets the pointers on the descriptor and enqueues the GEMM on torch's
current stream.

What nvmath 1.0 does (``linalg/advanced/matmulmod.py``, ``linalg/_internal/epilog_protocol.py``), and
:func:`gemm_spec` writes down as plain Python (tested without a GPU):

* operands: an ``(r, c)`` tensor is ORDER_ROW when its last stride is 1, ORDER_COL when its first is
  (the first checked first), ``ld = max(extent, stride)``; no transpose, except BGRADB's ``TRANSB = T``
  on B's transposed layout (cuBLASLt reduces its B operand that way);
* D ``(M, N)``: column-major for every epilog but GELU (none: it follows A's order); C is D's layout,
  null, with ``beta = 0``; ``alpha = 1`` and ``beta`` host scalars in the scale type;
* the epilog's attributes: BIAS_POINTER (BIAS_DATA_TYPE only where the bias's type is not D's); the
  aux's EPILOGUE_AUX_LD (relu_aux in bits, ``8 Mb``; gelu_aux in elements, ``Mp``), its batch stride,
  EPILOGUE_AUX_DATA_TYPE for a written gelu_aux, the aux pointer 0x1 while the heuristics run; a bias
  gradient (``drelu_bgrad``, ``dgelu_bgrad``: ``(M,)``; ``bgradb``: ``(N,)``, in D's type) written at
  BIAS_POINTER;
* heuristics: MAX_WORKSPACE_BYTES the cap, reduction scheme MASK, waves 0, every implementation, the
  A and B alignment of the first call's pointers (at most 256 bytes), the first of 8 algorithms; a
  workspace of the largest of the 8 (plus 16 bytes with an epilog: nvmath's "workaround for library issue").

Epilogs it does not plan (BGRADA: the chain never runs it) and operands of two dtypes are refused
(:class:`~mlptrain.torch.torch_gemm.TorchCublasLtGemm` raises ValueError).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from mlptrain.nn.epilogs import EPILOG_INPUTS, Epilog, gelu_aux_shape, relu_aux_shape

try:  # the layout rules (gemm_spec) are plain Python: the CPU tests read them without nvmath
    from nvmath import CudaDataType
    from nvmath.bindings import cublas
    from nvmath.bindings import cublasLt as lt

    from mlptrain.nn.cuda.cublaslt import DESC, PREF, LtMatmul, handle
except ImportError:  # pragma: no cover - a GPU machine has nvmath
    lt = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BIAS_IN = (Epilog.BIAS, Epilog.RELU_BIAS, Epilog.RELU_AUX_BIAS, Epilog.GELU_BIAS, Epilog.GELU_AUX_BIAS)
AUX_IN = {
    Epilog.DRELU: "relu_aux",
    Epilog.DRELU_BGRAD: "relu_aux",
    Epilog.DGELU: "gelu_aux",
    Epilog.DGELU_BGRAD: "gelu_aux",
}
BGRAD_OUT = {Epilog.DRELU_BGRAD: "drelu_bgrad", Epilog.DGELU_BGRAD: "dgelu_bgrad", Epilog.BGRADB: "bgradb"}
AUX_OUT = {Epilog.RELU_AUX_BIAS: "relu_aux", Epilog.GELU_AUX_BIAS: "gelu_aux", Epilog.GELU_AUX: "gelu_aux"}
PLANNED = (None, *BIAS_IN, *AUX_IN, *BGRAD_OUT, Epilog.GELU, Epilog.GELU_AUX)  # not BGRADA


@dataclass(frozen=True)
class Layout:
    """A matrix as a ``cublasLtMatrixLayout_t`` holds it: ``rows x cols``, leading dimension ``ld``, and
    ``row`` (ORDER_ROW: rows ``ld`` elements apart) or not (ORDER_COL: columns ``ld`` elements apart)."""

    rows: int
    cols: int
    ld: int
    row: bool


@dataclass(frozen=True)
class Output:
    """An epilog output: its aux-dict ``name``, ``shape`` and ``strides`` (elements), ``mask`` (uint8 bits,
    else D's dtype) and where cuBLASLt writes it (``"aux"``: EPILOGUE_AUX_POINTER, ``"bias"``: BIAS_POINTER)."""

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    mask: bool
    pointer: str


@dataclass(frozen=True)
class GemmSpec:
    """Everything a plan of ``D (M, N) = A (M, K) @ B (K, N)`` with ``epilog`` sets once (:func:`gemm_spec`).

    ``aux_ld`` and ``aux_batch_stride``: the EPILOGUE_AUX attributes (None: no aux); ``bias_batch_stride``:
    BIAS_BATCH_STRIDE (None: the epilog has no bias or bias gradient); ``transb``: BGRADB's TRANSB = T.
    """

    m: int
    n: int
    k: int
    a: Layout
    b: Layout
    d: Layout
    d_strides: tuple[int, int]
    transb: bool
    outputs: tuple[Output, ...]
    aux_ld: int | None
    aux_batch_stride: int | None
    bias_batch_stride: int | None


def operand_layout(shape: tuple[int, ...], strides: tuple[int, ...]) -> Layout:
    """The layout nvmath gives a 2-D operand (``get_matrix_layout_traits``): COL when ``strides[0] == 1``
    (checked first, so ``(M, 1)`` with strides ``(1, 1)`` is COL), ROW when ``strides[1] == 1``."""
    rows, cols = shape
    if strides[0] == 1 or (strides[1] != 1 and rows == 1):
        row = False
    elif strides[1] == 1 or cols == 1:
        row = True
    else:
        raise ValueError(f"a GEMM operand of shape {tuple(shape)} and strides {tuple(strides)} has no unit stride")
    return Layout(rows, cols, max(cols, strides[0]) if row else max(rows, strides[1]), row)


def transposed(layout: Layout, strides: tuple[int, ...]) -> Layout:
    """The same memory as the transposed matrix (nvmath's ``get_mm_layout(transpose=True)``): ROW <-> COL."""
    if layout.row:  # (r, c) rows ld apart == (c, r) columns ld apart
        return Layout(layout.cols, layout.rows, max(layout.cols, strides[0]), False)
    return Layout(layout.cols, layout.rows, max(layout.rows, strides[1]), True)


def gemm_spec(
    a_shape: tuple[int, ...],
    a_strides: tuple[int, ...],
    b_shape: tuple[int, ...],
    b_strides: tuple[int, ...],
    epilog: Any,
) -> GemmSpec:
    """What nvmath plans for these operands and epilog (see the module docstring); ValueError where it refuses."""
    (m, k), (k_b, n) = a_shape, b_shape
    if k != k_b:
        raise ValueError(f"GEMM extents do not match: A {tuple(a_shape)} @ B {tuple(b_shape)}")
    if epilog in AUX_IN and k == 1:
        raise ValueError(f"K = 1 is not supported for the {epilog.name} epilog (nvmath and cuBLASLt refuse it)")
    a, b = operand_layout(a_shape, a_strides), operand_layout(b_shape, b_strides)
    transb = epilog is Epilog.BGRADB
    if transb:
        b = transposed(b, b_strides)
    d_row = a.row if epilog in (None, Epilog.GELU) else False  # every other epilog writes D column-major
    d = Layout(m, n, n if d_row else m, d_row)
    outputs: list[Output] = []
    aux_ld: int | None = None
    aux_stride = bias_stride = None
    rows = 0  # the aux's rows: bytes of M bits (relu_aux) or M padded (gelu_aux)
    if epilog in (Epilog.RELU_AUX_BIAS, Epilog.DRELU, Epilog.DRELU_BGRAD):
        rows, _ = relu_aux_shape(m, n)  # (Mb, N) uint8, M bits a column: LD and batch stride in bits
        aux_ld, aux_stride = 8 * rows, (8 * rows * n if epilog in AUX_OUT else 0)
    elif epilog in (Epilog.GELU_AUX_BIAS, Epilog.GELU_AUX, Epilog.DGELU, Epilog.DGELU_BGRAD):
        rows, _ = gelu_aux_shape(m, n)  # (Mp, N) in D's dtype
        aux_ld, aux_stride = rows, (rows * n if epilog in AUX_OUT else 0)
    if epilog in AUX_OUT:
        outputs.append(Output(AUX_OUT[epilog], (rows, n), (1, rows), epilog is Epilog.RELU_AUX_BIAS, "aux"))
    if epilog in BIAS_IN:
        bias_stride = 0  # one bias for the (single) matrix
    if epilog in BGRAD_OUT:
        length = n if epilog is Epilog.BGRADB else m
        bias_stride = length
        outputs.append(Output(BGRAD_OUT[epilog], (length,), (1,), False, "bias"))
    return GemmSpec(
        m, n, k, a, b, d, (n, 1) if d_row else (1, m), transb, tuple(outputs), aux_ld, aux_stride, bias_stride
    )


def alignment(t: torch.Tensor) -> int:
    """The pointer's alignment in bytes, capped at 256 (what the heuristics are told, as nvmath tells them)."""
    ptr = t.data_ptr()
    return 256 if ptr % 256 == 0 else ptr & -ptr


def signature(key: str, a: torch.Tensor, b: torch.Tensor, epilog: Any, inputs: dict, tf32: bool) -> tuple:
    """What a plan is kept for: call site, thread, shapes, strides, dtypes, epilog, alignments, TF32, and each
    epilog input's shape, strides, dtype and alignment (its pointer is on the descriptor while the heuristics run)."""
    sig: tuple = (key, threading.get_ident(), a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, epilog)
    sig += (tf32, alignment(a), alignment(b))
    return sig + tuple((name, t.shape, t.stride(), t.dtype, alignment(t)) for name, t in inputs.items())


def allocate(spec: GemmSpec, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """D and the epilog's outputs, new from torch's caching allocator, in the layouts nvmath returns."""
    d = torch.empty_strided((spec.m, spec.n), spec.d_strides, dtype=dtype, device=device)
    aux = {
        out.name: torch.empty_strided(out.shape, out.strides, dtype=torch.uint8 if out.mask else dtype, device=device)
        for out in spec.outputs
    }
    return d, aux


@functools.cache
def _handle(device_index: int, thread: int) -> int:
    """One cuBLASLt handle per device and thread, as nvmath keeps them (``linalg/_internal/utils.get_handle``)."""
    with torch.cuda.device(device_index):
        return handle(device_index, thread)


def check_inputs(spec: GemmSpec, epilog: Any, inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """ValueError unless ``inputs`` are what ``epilog`` reads, checked as nvmath's handlers check them: once,
    at plan time (the signature holds their shapes, strides and dtypes)."""
    what = epilog.name if epilog is not None else "plain"
    expected = set(EPILOG_INPUTS[epilog]) if epilog is not None else set()
    if set(inputs) != expected:
        raise ValueError(f"the {what} GEMM reads the epilog inputs {sorted(expected)}; got {sorted(inputs)}")
    for name, t in inputs.items():
        if name == "bias":  # (M,) or (M, 1), unit stride along M; any of the four types (BIAS_DATA_TYPE)
            ok = tuple(t.shape) in ((spec.m,), (spec.m, 1)) and t.stride()[0] == 1 and t.dtype in DTYPES
            want = f"({spec.m},) with unit stride"
        else:  # the aux the forward wrote: (Mb, N) uint8 or (Mp, N) in D's type, column-major
            shape = relu_aux_shape(spec.m, spec.n) if name == "relu_aux" else gelu_aux_shape(spec.m, spec.n)
            aux_dtype = torch.uint8 if name == "relu_aux" else dtype
            ok = tuple(t.shape) == shape and t.stride()[0] == 1 and t.dtype == aux_dtype
            want = f"{shape} {aux_dtype} with unit stride along its first dimension"
        if not ok:
            raise ValueError(f"the {what} GEMM's {name} is {tuple(t.shape)} {t.dtype} {t.stride()}; expected {want}")


_TYPE_NAMES = {torch.float16: "CUDA_R_16F", torch.bfloat16: "CUDA_R_16BF", torch.float32: "CUDA_R_32F"}
_TYPE_NAMES[torch.float64] = "CUDA_R_64F"


class LtPlan:
    """One planned GEMM for one :func:`signature`: a :class:`mlptrain.nn.cuda.cublaslt.LtMatmul` given
    nvmath's descriptor attributes, layouts and preferences (the module docstring), on torch memory.

    Made at the first call of the signature (on that call's tensors: the heuristics see their alignment
    and the epilog inputs' pointers, as nvmath's ``plan`` does); calling it runs the GEMM on new tensors
    of the same signature: D and the outputs allocated, the pointers set, ``cublasLtMatmul`` enqueued.
    """

    def __init__(
        self,
        key: str,
        spec: GemmSpec,
        a: torch.Tensor,
        b: torch.Tensor,
        epilog: Any,
        inputs: dict,
        *,
        tf32: bool,
        cap: int,
    ) -> None:
        check_inputs(spec, epilog, inputs, a.dtype)
        self.key, self.spec, self.epilog, self.dtype = key, spec, epilog, a.dtype
        lt_handle = _handle(a.device.index, threading.get_ident())
        dtype = getattr(CudaDataType, _TYPE_NAMES[a.dtype])
        wide = a.dtype == torch.float64  # COMPUTE_64F and float64 scalars; else float32 scalars
        ct = cublas.ComputeType
        compute = ct.COMPUTE_64F if wide else (ct.COMPUTE_32F_FAST_TF32 if tf32 else ct.COMPUTE_32F)
        scale = CudaDataType.CUDA_R_64F if wide else CudaDataType.CUDA_R_32F
        self._attr = {"bias": DESC.BIAS_POINTER, "aux": DESC.EPILOGUE_AUX_POINTER}
        layouts = [(dtype, lay.rows, lay.cols, lay.ld, lay.row) for lay in (spec.a, spec.b, spec.d)]  # C is D's
        self.plan = LtMatmul(lt_handle, compute, scale, self._attributes(epilog, inputs, dtype), layouts)
        P = PREF
        settings: list[tuple[Any, Any]] = [
            (P.MAX_WORKSPACE_BYTES, cap),
            (P.REDUCTION_SCHEME_MASK, int(lt.ReductionScheme.MASK)),
        ]
        settings += [(P.MAX_WAVES_COUNT, 0.0), (P.IMPL_MASK, 2**64 - 1)]
        settings += [(P.MIN_ALIGNMENT_A_BYTES, alignment(a)), (P.MIN_ALIGNMENT_B_BYTES, alignment(b))]

        def workspace(nbytes: int) -> tuple[torch.Tensor, int]:  # torch's caching allocator, held by the plan
            t = torch.empty(nbytes, dtype=torch.uint8, device=a.device)
            return t, t.data_ptr()

        # the first of cuBLASLt's 8 heuristic algorithms under nvmath's default preferences, and its workspace
        self.plan.choose(settings, 8, self._what(), padded=epilog is not None, workspace=workspace)
        log.info("planned %s, workspace %d bytes", self._what(), self.workspace_size)

    def _attributes(self, epilog: Any, inputs: dict, dtype: Any) -> list[tuple[Any, Any]]:
        """The descriptor's epilog attributes, in the order nvmath's epilog handlers set them before the heuristics."""
        spec, attrs = self.spec, []
        if spec.transb:  # BGRADB reduces B over K: cuBLASLt takes B transposed for it
            attrs.append((DESC.TRANSB, cublas.Operation.T))
        if spec.bias_batch_stride is not None:
            attrs.append((DESC.BIAS_BATCH_STRIDE, spec.bias_batch_stride))
        if spec.aux_ld is not None:
            attrs.append((DESC.EPILOGUE_AUX_LD, spec.aux_ld))
            attrs.append((DESC.EPILOGUE_AUX_BATCH_STRIDE, spec.aux_batch_stride or 0))
        if epilog in AUX_OUT:
            attrs.append((DESC.EPILOGUE_AUX_POINTER, 0x1))  # as nvmath: "to bypass the cuBLAS check" (real: per call)
            if epilog is not Epilog.RELU_AUX_BIAS and lt.get_version() >= 120800:
                attrs.append((DESC.EPILOGUE_AUX_DATA_TYPE, dtype))  # gelu_aux in D's type
        for name, t in inputs.items():
            attrs.append((self._attr["bias" if name == "bias" else "aux"], t.data_ptr()))
            if t.dtype != self.dtype and name == "bias":
                attrs.append((DESC.BIAS_DATA_TYPE, getattr(CudaDataType, _TYPE_NAMES[t.dtype])))
        if epilog is not None:
            attrs.append((DESC.EPILOGUE, lt.Epilogue[epilog.name]))
        return attrs

    def __call__(self, a: torch.Tensor, b: torch.Tensor, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(D, aux)`` for new operands of the plan's signature, enqueued on torch's current stream."""
        if a.device.index != torch.cuda.current_device():  # the launch goes to the current device's context
            with torch.cuda.device(a.device):
                return self(a, b, inputs)
        d, aux = allocate(self.spec, self.dtype, a.device)
        plan, attr = self.plan, self._attr
        for out in self.spec.outputs:  # relu_aux / gelu_aux at the aux pointer, a bias gradient at the bias pointer
            plan.set(attr[out.pointer], aux[out.name].data_ptr())
        for name, t in inputs.items():
            plan.set(attr["bias" if name == "bias" else "aux"], t.data_ptr())
        stream = torch.cuda.current_stream(a.device).cuda_stream
        plan.enqueue(a.data_ptr(), b.data_ptr(), d.data_ptr(), stream)
        return d, aux

    @property
    def workspace_size(self) -> int:
        """Bytes of the plan's workspace (what :meth:`TorchCublasLtGemm.workspace_bytes` sums)."""
        return self.plan.workspace_size

    def _what(self) -> str:
        s, epilog = self.spec, self.epilog.name if self.epilog else "none"
        return f"{self.key} ({s.m}, {s.k}) @ ({s.k}, {s.n}) {self.dtype} epilog={epilog}"

    def free(self) -> None:
        """Destroy the descriptor and layouts and let the workspace go (the device must be idle)."""
        self.plan.free()
