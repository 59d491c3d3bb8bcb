"""One raw cuBLASLt GEMM, planned once: the plan that FP8 and the torch front end share.

:class:`LtMatmul` drives ``cublasLtMatmul`` through the bindings nvmath ships (``nvmath.bindings.cublasLt``,
what nvmath's ``linalg/advanced/matmulmod.py`` drives) on raw pointers: the descriptor and its attributes,
the A, B and D layouts (C is D's, null, with ``beta = 0``), the heuristics and the workspace, once; per
call the pointers and the launch. Its users pass in what differs: the attributes, layouts, preferences,
the workspace's allocator and the stream. :class:`mlptrain.nn.cuda.fp8_gemm.Fp8Matmul` (``precision=fp8``)
on CuPy memory; :class:`mlptrain.torch.torch_lt.LtPlan` (the torch front end, nvmath's plans) on torch
memory. Neither CuPy nor torch is imported here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from nvmath import CudaDataType
from nvmath.bindings import cublasLt as lt

DESC = lt.MatmulDescAttribute
PREF = lt.MatmulPreferenceAttribute
_SCALARS = {CudaDataType.CUDA_R_32F: np.float32, CudaDataType.CUDA_R_64F: np.float64}

# A matrix layout: (data type, rows, cols, ld, row). row None: as created (cuBLASLt's defaults:
# column-major, one matrix); True / False: ORDER_ROW / ORDER_COL, BATCH_COUNT 1 and
# STRIDED_BATCH_OFFSET 0 set on it, as nvmath sets them.
LayoutArgs = tuple[Any, int, int, int, bool | None]


@functools.cache
def handle(device: int, thread: int = 0) -> int:
    """One cuBLASLt handle per device (and per thread where the caller keeps one a thread, as nvmath does:
    ``linalg/_internal/utils.get_handle``), made on the current device: call it with ``device`` current.
    A handle only holds the library's context."""
    return int(lt.create())


class LtMatmul:
    """``D = op(A) @ op(B)`` with the descriptor's epilog, as one ``cublasLtMatmul`` planned once.

    Args:
        handle: a cuBLASLt handle (:func:`handle`).
        compute: the descriptor's compute type (``cublas.ComputeType``).
        scale: its scale type (``CUDA_R_32F`` or ``CUDA_R_64F``): ``alpha = 1`` and ``beta = 0`` are host
            scalars of that type (the default pointer mode).
        attributes: ``(MatmulDescAttribute, value)`` pairs, set in this order on the new descriptor:
            transposes, the epilog, its data types, leading dimensions and batch strides, the pointers
            the heuristics see.
        layouts: A's, B's and D's :data:`LayoutArgs`, made in this order after the attributes.

    :meth:`choose` runs the heuristics and allocates the workspace (outside any graph capture);
    :meth:`set` changes an attribute (the pointers before each call); :meth:`enqueue` runs the GEMM.
    """

    _tail: tuple[int, int, int]  # (algorithm, workspace, its size): set by choose, before the first enqueue

    def __init__(
        self,
        handle: int,
        compute: Any,
        scale: Any,
        attributes: Sequence[tuple[Any, Any]],
        layouts: Sequence[LayoutArgs],
    ) -> None:
        self.handle = handle
        self.desc = lt.matmul_desc_create(compute, scale)
        self._buffers: dict[Any, tuple[np.ndarray, int]] = {}
        for attr, value in attributes:
            self.set(attr, value)
        self.layouts: tuple[int, ...] = tuple(_layout(*lay) for lay in layouts)
        self.alpha = np.ones(1, _SCALARS[scale])  # host scalars: the default pointer mode
        self.beta = np.zeros(1, _SCALARS[scale])
        self._head, self._beta = (self.handle, self.desc, self.alpha.ctypes.data), self.beta.ctypes.data
        self.algo: Any = None
        self.workspace: Any = None
        self.workspace_size = 0

    def set(self, attr: Any, value: Any) -> None:
        """``cublasLtMatmulDescSetAttribute`` with the attribute's own C type (as nvmath's MatmulDescInterface),
        from one host buffer per attribute (the pointers set before each call allocate nothing)."""
        entry = self._buffers.get(attr)
        if entry is None:
            buf = np.zeros(1, dtype=lt.get_matmul_desc_attribute_dtype(attr))
            entry = self._buffers[attr] = (buf, buf.ctypes.data)
        buf, addr = entry
        buf[0] = value
        lt.matmul_desc_set_attribute(self.desc, attr, addr, buf.itemsize)

    def choose(
        self,
        preferences: Sequence[tuple[Any, Any]],
        count: int,
        what: str,
        *,
        padded: bool,
        workspace: Callable[[int], tuple[Any, int]],
    ) -> None:
        """The first of ``count`` heuristic algorithms under ``preferences`` (``(MatmulPreferenceAttribute,
        value)`` pairs, set in this order), and a workspace for the largest of them from ``workspace``
        (bytes -> (the allocation, its pointer)), 16 bytes more where ``padded`` (an epilog: nvmath's
        "workaround for library issue"). RuntimeError naming ``what`` where cuBLASLt has no algorithm."""
        pref = lt.matmul_preference_create()
        results = lt.MatmulHeuristicResult(count)
        found = np.zeros(1, dtype=np.int32)
        la, lb, ld = self.layouts
        try:
            for attr, value in preferences:
                buf = np.array([value], dtype=lt.get_matmul_preference_attribute_dtype(attr))
                lt.matmul_preference_set_attribute(pref, attr, buf.ctypes.data, buf.itemsize)
            lt.matmul_algo_get_heuristic(
                self.handle, self.desc, la, lb, ld, ld, pref, count, results.ptr, found.ctypes.data
            )
        except lt.cuBLASLtError as exc:
            raise RuntimeError(f"{what}: cuBLASLt has no algorithm ({exc})") from exc
        finally:
            lt.matmul_preference_destroy(pref)
        if found[0] == 0:
            raise RuntimeError(f"{what}: cuBLASLt has no algorithm (NOT_SUPPORTED)")
        self._results = results[: int(found[0])]  # keeps the algorithm struct alive
        self.algo = self._results[0]["algo"]
        size = int(np.max(self._results["workspace_size"]))
        self.workspace_size = size + 16 if size > 0 and padded else size
        # held by the plan: its address is what a captured graph replays
        self.workspace, pointer = workspace(max(self.workspace_size, 1))
        self._tail = (self.algo.ctypes.data, pointer, self.workspace_size)

    def enqueue(self, a: int, b: int, d: int, stream: int) -> None:
        """Enqueue the GEMM on ``stream`` (a raw ``cudaStream_t``) with the pointers as :meth:`set` left them."""
        la, lb, ld = self.layouts
        # (handle, desc, alpha), A, B, beta, C null (beta = 0; C's layout is D's, as nvmath), D, (algo, workspace)
        lt.matmul(*self._head, a, la, b, lb, self._beta, 0, ld, d, ld, *self._tail, stream)

    def free(self) -> None:
        """Destroy the descriptor and layouts and let the workspace go (the device must be idle)."""
        for layout in self.layouts:
            lt.matrix_layout_destroy(layout)
        lt.matmul_desc_destroy(self.desc)
        self.layouts = ()
        self.workspace = None


def _layout(dtype: Any, rows: int, cols: int, ld: int, row: bool | None) -> int:
    """A ``cublasLtMatrixLayout_t``; with ``row`` given, nvmath's attributes: its ORDER, one matrix, no batch offset."""
    ptr = lt.matrix_layout_create(dtype, rows, cols, ld)
    if row is None:
        return ptr
    A = lt.MatrixLayoutAttribute
    order = lt.Order.ROW if row else lt.Order.COL
    for attr, value in ((A.ORDER, int(order)), (A.BATCH_COUNT, 1), (A.STRIDED_BATCH_OFFSET, 0)):
        buf = np.array([value], dtype=lt.get_matrix_layout_attribute_dtype(attr))
        lt.matrix_layout_set_attribute(ptr, attr, buf.ctypes.data, buf.itemsize)
    return ptr
