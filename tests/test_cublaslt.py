"""The raw cuBLASLt plan (mlptrain/nn/cuda/cublaslt.py) and its two users, FP8's ``Fp8Matmul`` and the torch
front end's ``LtPlan``, without a GPU: every cuBLASLt call they make, recorded through a stand-in for
``nvmath.bindings.cublasLt`` (the values read from the host buffers with each attribute's C type, as
nvmath 1.0 gives them), in a subprocess (the stand-in must be in place before mlptrain imports nvmath).
The expected calls are those the two plan classes made before they shared one plan (#48).
"""

from __future__ import annotations

import ctypes
import enum
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# each attribute's C type, as nvmath 1.0's get_*_attribute_dtype gives it
DESC = dict(TRANSA="int32", TRANSB="int32", EPILOGUE="uint32", FAST_ACCUM="int8", BIAS_DATA_TYPE="int32")
DESC.update(EPILOGUE_AUX_LD="int64", EPILOGUE_AUX_DATA_TYPE="int32", EPILOGUE_AUX_BATCH_STRIDE="int64")
DESC.update(
    {f"{p}_POINTER": "int64" for p in ("A_SCALE", "B_SCALE", "BIAS", "EPILOGUE_AUX")}, BIAS_BATCH_STRIDE="int64"
)
PREF = dict(MAX_WORKSPACE_BYTES="uint64", REDUCTION_SCHEME_MASK="uint32", MAX_WAVES_COUNT="float32")
PREF.update(IMPL_MASK="uint64", MIN_ALIGNMENT_A_BYTES="uint32", MIN_ALIGNMENT_B_BYTES="uint32")
LAYOUT = dict(ORDER="int32", BATCH_COUNT="int32", STRIDED_BATCH_OFFSET="int64")
TYPES = ["CUDA_R_8F_E4M3", "CUDA_R_8F_E5M2", "CUDA_R_16BF", "CUDA_R_16F", "CUDA_R_32F", "CUDA_R_64F"]


def E(name: str, names: list[str]) -> Any:
    return enum.IntEnum(name, names, start=0)


def stand_in_modules() -> tuple[types.ModuleType, ...]:
    """``nvmath``, ``nvmath.bindings.cublas`` and ``nvmath.bindings.cublasLt`` with the enums mlptrain uses."""
    nv, cublas, lt = (types.ModuleType(n) for n in ("nvmath", "nvmath.bindings.cublas", "nvmath.bindings.cublasLt"))
    nv.CudaDataType = E("CudaDataType", TYPES)
    cublas.ComputeType = E("ComputeType", ["COMPUTE_32F", "COMPUTE_32F_FAST_TF32", "COMPUTE_64F"])
    cublas.Operation = E("Operation", ["N", "T"])
    epilogs = ["DEFAULT", "BIAS", "RELU_BIAS", "RELU_AUX_BIAS", "DRELU", "DRELU_BGRAD", "BGRADA", "BGRADB", "GELU"]
    lt.Epilogue = E("Epilogue", [*epilogs, "GELU_AUX", "GELU_BIAS", "GELU_AUX_BIAS", "DGELU", "DGELU_BGRAD"])
    lt.Order, lt.ReductionScheme = E("Order", ["COL", "ROW"]), E("ReductionScheme", ["NONE", "MASK"])
    return nv, cublas, lt


def install_stand_ins(calls: list[str]) -> None:
    """The stand-in modules and a mock ``cupy`` in sys.modules: each call that changes cuBLASLt's state
    appended to ``calls`` (a pointer, any value over 2**32, written ``ptr``)."""
    nv, cublas, lt = stand_in_modules()
    enums = {"TRANSA": cublas.Operation, "TRANSB": cublas.Operation, "EPILOGUE": lt.Epilogue, "ORDER": lt.Order}
    enums.update(BIAS_DATA_TYPE=nv.CudaDataType, EPILOGUE_AUX_DATA_TYPE=nv.CudaDataType)
    ids, scales, results = iter(range(1000, 10**6)), {}, {}

    def show(value: object) -> str:
        return "ptr" if isinstance(value, int) and value > 2**32 else str(value)

    def setter(kind: str, table: dict[str, str]):
        cls = E(kind, list(table))

        def set_attribute(obj: int, attr: int, ptr: int, size: int) -> None:
            name = cls(attr).name
            assert size == np.dtype(table[name]).itemsize, (name, size)
            value = np.frombuffer(ctypes.string_at(ptr, size), table[name])[0].item()
            calls.append(f"{kind} {obj} {name}={enums[name](value).name if name in enums else show(value)}")

        return cls, lambda attr: getattr(np, table[cls(attr).name]), set_attribute

    def made(what: str, *args: object) -> int:
        i = next(ids)
        calls.append(" ".join([what, str(i), *(a.name if isinstance(a, enum.Enum) else str(a) for a in args)]))
        return i

    def matmul_desc_create(compute: int, scale: int) -> int:
        d = made("desc", cublas.ComputeType(compute), nv.CudaDataType(scale))
        scales[d] = np.float64 if scale == nv.CudaDataType.CUDA_R_64F else np.float32
        return d

    class MatmulHeuristicResult:
        fields = [("algo", np.uint64, (8,)), ("workspace_size", np.uint64), ("state", np.int32), ("waves", np.float32)]

        def __init__(self, n: int = 1, data: np.ndarray | None = None) -> None:
            self._data = np.zeros(n, self.fields) if data is None else data
            self.ptr = self._data.ctypes.data
            results[self.ptr] = self

        def __getitem__(self, key: object) -> object:
            if isinstance(key, str):
                return self._data[key]
            return MatmulHeuristicResult(data=self._data[key if isinstance(key, slice) else slice(key, key + 1)])

    def heuristic(handle: int, desc: int, a: int, b: int, c: int, d: int, pref: int, n: int, res: int, count: int):
        calls.append(f"heuristic {handle} {desc} {a} {b} {c} {d} {pref} {n}")
        found = results[res]._data[: min(n, 3)]  # three algorithms: workspaces of 4096, 0 and 65536 bytes
        found["algo"], found["workspace_size"] = np.arange(8) + 7, [4096, 0, 65536][: len(found)]
        ctypes.c_int32.from_address(count).value = len(found)

    def matmul(handle: int, desc: int, alpha: int, *args: int) -> None:
        a, la, b, lb, beta, c, lc, d, ld, algo, ws, size, stream = args
        scalar = np.dtype(scales[desc])  # alpha and beta: host scalars of the scale type
        one, zero = (np.frombuffer(ctypes.string_at(p, scalar.itemsize), scalar)[0].item() for p in (alpha, beta))
        algo_ok = np.frombuffer(ctypes.string_at(algo, 64), np.uint64).tolist() == list(range(7, 15))
        calls.append(f"matmul {handle} {desc} {one} {show(a)} {la} {show(b)} {lb} {zero} {c} {lc} {show(d)} {ld}")
        calls[-1] += f" algo={algo_ok} {show(ws)} {size} {stream}"

    lt.MatmulDescAttribute, lt.get_matmul_desc_attribute_dtype, lt.matmul_desc_set_attribute = setter("desc", DESC)
    P = setter("pref", PREF)
    lt.MatmulPreferenceAttribute, lt.get_matmul_preference_attribute_dtype, lt.matmul_preference_set_attribute = P
    L = setter("layout", LAYOUT)
    lt.MatrixLayoutAttribute, lt.get_matrix_layout_attribute_dtype, lt.matrix_layout_set_attribute = L
    lt.__dict__.update(create=lambda: made("handle"), matmul_desc_create=matmul_desc_create, matmul=matmul)
    lt.__dict__.update(matrix_layout_create=lambda t, *shape: made("layout", nv.CudaDataType(t), *shape))
    lt.__dict__.update(matmul_preference_create=lambda: made("pref"), matmul_algo_get_heuristic=heuristic)
    for what in ("matmul_preference", "matrix_layout", "matmul_desc"):
        lt.__dict__[f"{what}_destroy"] = lambda i, what=what: calls.append(f"{what}_destroy {i}")
    lt.__dict__.update(
        MatmulHeuristicResult=MatmulHeuristicResult, cuBLASLtError=RuntimeError, get_version=lambda: 120900
    )
    bindings = types.ModuleType("nvmath.bindings")
    bindings.cublas, bindings.cublasLt = cublas, lt
    cp = mock.MagicMock()
    cp.cuda.Device.return_value.id = 0
    cp.cuda.get_current_stream.return_value.ptr = 77
    cp.get_default_memory_pool.return_value.malloc.side_effect = lambda n: types.SimpleNamespace(ptr=2**40 + n)
    sys.modules.update({"nvmath": nv, "nvmath.bindings": bindings, "nvmath.bindings.cublas": cublas})
    sys.modules.update({"nvmath.bindings.cublasLt": lt, "cupy": cp, "cupyx": mock.MagicMock()})


def aligned(*shape: int, dtype: object) -> object:
    """A zero tensor whose data starts on a 256-byte boundary (the alignment the heuristics are told)."""
    import torch

    size = int(np.prod(shape)) * dtype.itemsize
    raw = torch.zeros(size + 256, dtype=torch.uint8)
    skip = -raw.data_ptr() % 256
    return raw[skip : skip + size].view(dtype).view(*shape)


def record(which: str) -> list[str]:
    """The cuBLASLt calls of one FP8 plan (``fp8``) or two torch plans (``torch``): made, run, freed."""
    calls: list[str] = []
    install_stand_ins(calls)
    from mlptrain.nn.epilogs import Epilog

    if which == "fp8":
        from mlptrain.nn.cuda.fp8_gemm import Fp8Matmul

        ptr = lambda i: types.SimpleNamespace(data=types.SimpleNamespace(ptr=2**41 + i))  # noqa: E731
        mm = Fp8Matmul(32, 48, 64, ("e4m3", "e5m2"), Epilog.RELU_AUX_BIAS, workspace_bytes=2**25, fast_accum=True)
        mm.set_pointers(ptr(1), ptr(2), bias=ptr(3), aux=ptr(4))
        mm.plan("k")
        mm.run(ptr(5), ptr(6), ptr(7))
        mm.free()
        return calls
    import contextlib

    import torch

    from mlptrain.torch.torch_lt import LtPlan, gemm_spec

    torch.cuda.current_device = lambda: None  # a CPU tensor's device index
    torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=77)
    torch.cuda.device = lambda index: contextlib.nullcontext()
    bf16, f64 = torch.bfloat16, torch.float64
    cases = [  # forward W (30, 20) @ h^T (20, 11) with its bias; weight gradient h^T @ dZ (11, 30); h @ W^T
        (
            aligned(30, 20, dtype=bf16),
            aligned(11, 20, dtype=bf16).T,
            Epilog.RELU_AUX_BIAS,
            {"bias": aligned(30, dtype=bf16)},
        ),
        (aligned(11, 20, dtype=f64).T, aligned(11, 30, dtype=f64), Epilog.BGRADB, {}),
        (aligned(11, 20, dtype=torch.float32), aligned(30, 20, dtype=torch.float32).T, None, {}),  # TF32
    ]
    for a, b, epilog, inputs in cases:
        spec = gemm_spec(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), epilog)
        plan = LtPlan("k", spec, a, b, epilog, inputs, tf32=a.dtype == torch.float32, cap=2**25)
        plan(a, b, inputs)
        plan.free()
    return calls


def run_recorded(which: str) -> list[str]:
    """``record(which)`` in a new interpreter (the stand-ins must be in place before mlptrain imports nvmath)."""
    code = "import sys, json; sys.path.insert(0, 'tests'); import test_cublaslt as t; "
    code += f"print(json.dumps(t.record({which!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(out.stdout.splitlines()[-1])


# D (32, 48) bf16 = A8 (32, 64) e4m3 @ B8 (64, 48) e5m2, RELU_AUX_BIAS, fast accumulation: TRANSA = T, layouts
# as created (column-major), the scale, bias and aux pointers, one algorithm under the cap, 4096 + 16 bytes
FP8_CALLS = """\
handle 1000
desc 1001 COMPUTE_32F CUDA_R_32F
desc 1001 TRANSA=T
desc 1001 TRANSB=N
desc 1001 EPILOGUE=RELU_AUX_BIAS
desc 1001 FAST_ACCUM=1
desc 1001 BIAS_DATA_TYPE=CUDA_R_16BF
desc 1001 EPILOGUE_AUX_LD=128
layout 1002 CUDA_R_8F_E4M3 64 32 64
layout 1003 CUDA_R_8F_E5M2 64 48 64
layout 1004 CUDA_R_16BF 32 48 32
desc 1001 A_SCALE_POINTER=ptr
desc 1001 B_SCALE_POINTER=ptr
desc 1001 BIAS_POINTER=ptr
desc 1001 EPILOGUE_AUX_POINTER=ptr
pref 1005
pref 1005 MAX_WORKSPACE_BYTES=33554432
heuristic 1000 1001 1002 1003 1004 1004 1005 1
matmul_preference_destroy 1005
matmul 1000 1001 1.0 ptr 1002 ptr 1003 0.0 0 1004 ptr 1004 algo=True ptr 4112 77
matrix_layout_destroy 1002
matrix_layout_destroy 1003
matrix_layout_destroy 1004
matmul_desc_destroy 1001
"""

# bf16 forward RELU_AUX_BIAS (W row-major, h^T column-major), float64 BGRADB (TRANSB = T), a plain float32 GEMM
# under TF32 (D row-major as A, no +16): nvmath's plans, its epilog attributes in its handlers' order, the aux
# pointer 0x1 while the heuristics run, its six preferences, the first of 8 algorithms
TORCH_CALLS = """\
handle 1000
desc 1001 COMPUTE_32F CUDA_R_32F
desc 1001 BIAS_BATCH_STRIDE=0
desc 1001 EPILOGUE_AUX_LD=128
desc 1001 EPILOGUE_AUX_BATCH_STRIDE=1408
desc 1001 EPILOGUE_AUX_POINTER=1
desc 1001 BIAS_POINTER=ptr
desc 1001 EPILOGUE=RELU_AUX_BIAS
layout 1002 CUDA_R_16BF 30 20 20
layout 1002 ORDER=ROW
layout 1002 BATCH_COUNT=1
layout 1002 STRIDED_BATCH_OFFSET=0
layout 1003 CUDA_R_16BF 20 11 20
layout 1003 ORDER=COL
layout 1003 BATCH_COUNT=1
layout 1003 STRIDED_BATCH_OFFSET=0
layout 1004 CUDA_R_16BF 30 11 30
layout 1004 ORDER=COL
layout 1004 BATCH_COUNT=1
layout 1004 STRIDED_BATCH_OFFSET=0
pref 1005
pref 1005 MAX_WORKSPACE_BYTES=33554432
pref 1005 REDUCTION_SCHEME_MASK=1
pref 1005 MAX_WAVES_COUNT=0.0
pref 1005 IMPL_MASK=ptr
pref 1005 MIN_ALIGNMENT_A_BYTES=256
pref 1005 MIN_ALIGNMENT_B_BYTES=256
heuristic 1000 1001 1002 1003 1004 1004 1005 8
matmul_preference_destroy 1005
desc 1001 EPILOGUE_AUX_POINTER=ptr
desc 1001 BIAS_POINTER=ptr
matmul 1000 1001 1.0 ptr 1002 ptr 1003 0.0 0 1004 ptr 1004 algo=True ptr 65552 77
matrix_layout_destroy 1002
matrix_layout_destroy 1003
matrix_layout_destroy 1004
matmul_desc_destroy 1001
desc 1006 COMPUTE_64F CUDA_R_64F
desc 1006 TRANSB=T
desc 1006 BIAS_BATCH_STRIDE=30
desc 1006 EPILOGUE=BGRADB
layout 1007 CUDA_R_64F 20 11 20
layout 1007 ORDER=COL
layout 1007 BATCH_COUNT=1
layout 1007 STRIDED_BATCH_OFFSET=0
layout 1008 CUDA_R_64F 30 11 30
layout 1008 ORDER=COL
layout 1008 BATCH_COUNT=1
layout 1008 STRIDED_BATCH_OFFSET=0
layout 1009 CUDA_R_64F 20 30 20
layout 1009 ORDER=COL
layout 1009 BATCH_COUNT=1
layout 1009 STRIDED_BATCH_OFFSET=0
pref 1010
pref 1010 MAX_WORKSPACE_BYTES=33554432
pref 1010 REDUCTION_SCHEME_MASK=1
pref 1010 MAX_WAVES_COUNT=0.0
pref 1010 IMPL_MASK=ptr
pref 1010 MIN_ALIGNMENT_A_BYTES=256
pref 1010 MIN_ALIGNMENT_B_BYTES=256
heuristic 1000 1006 1007 1008 1009 1009 1010 8
matmul_preference_destroy 1010
desc 1006 BIAS_POINTER=ptr
matmul 1000 1006 1.0 ptr 1007 ptr 1008 0.0 0 1009 ptr 1009 algo=True ptr 65552 77
matrix_layout_destroy 1007
matrix_layout_destroy 1008
matrix_layout_destroy 1009
matmul_desc_destroy 1006
desc 1011 COMPUTE_32F_FAST_TF32 CUDA_R_32F
layout 1012 CUDA_R_32F 11 20 20
layout 1012 ORDER=ROW
layout 1012 BATCH_COUNT=1
layout 1012 STRIDED_BATCH_OFFSET=0
layout 1013 CUDA_R_32F 20 30 20
layout 1013 ORDER=COL
layout 1013 BATCH_COUNT=1
layout 1013 STRIDED_BATCH_OFFSET=0
layout 1014 CUDA_R_32F 11 30 30
layout 1014 ORDER=ROW
layout 1014 BATCH_COUNT=1
layout 1014 STRIDED_BATCH_OFFSET=0
pref 1015
pref 1015 MAX_WORKSPACE_BYTES=33554432
pref 1015 REDUCTION_SCHEME_MASK=1
pref 1015 MAX_WAVES_COUNT=0.0
pref 1015 IMPL_MASK=ptr
pref 1015 MIN_ALIGNMENT_A_BYTES=256
pref 1015 MIN_ALIGNMENT_B_BYTES=256
heuristic 1000 1011 1012 1013 1014 1014 1015 8
matmul_preference_destroy 1015
matmul 1000 1011 1.0 ptr 1012 ptr 1013 0.0 0 1014 ptr 1014 algo=True ptr 65536 77
matrix_layout_destroy 1012
matrix_layout_destroy 1013
matrix_layout_destroy 1014
matmul_desc_destroy 1011
"""


def test_an_fp8_plan_makes_the_cublaslt_calls_it_made_before_the_plan_was_shared() -> None:
    assert run_recorded("fp8") == FP8_CALLS.splitlines()


def test_the_torch_plans_make_the_cublaslt_calls_they_made_before_the_plan_was_shared() -> None:
    pytest.importorskip("torch")
    assert run_recorded("torch") == TORCH_CALLS.splitlines()


if __name__ == "__main__":
    for line in run_recorded(sys.argv[1]):
        print(line)
