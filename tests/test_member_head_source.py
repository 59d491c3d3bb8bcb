"""An ensemble's head kernel on the CPU: ``mlptrain_member_head_dgrad`` (mlptrain/nn/cuda/member_head.py) and the
single model's ``mlptrain_head_dgrad`` (mlptrain/nn/cuda/head.py), their CUDA sources compiled as C++ and run block by
block; and which head mode an ensemble takes (:meth:`MemberHead.choose`), where the GPU would run the kernel.

CuPy is stood in for: ``cupy.ElementwiseKernel`` compiles the source it is given with the host's C++ compiler, a
block's threads as OpenMP threads (``__syncthreads`` their barrier, ``__shared__`` arrays static, so shared), and
runs the launch's blocks one after another on the NumPy arrays that :func:`member_input_grad` and
:func:`head_input_grad` hand it. What this checks: both sources compile; member k's result is the single kernel's on
member k's slices bit for bit, for every block width (the slicing, the block index, the flat views, each thread's
lanes and the tree over them); both are the NumPy DRELU(_BGRAD) contract to float32 rounding.
tests/gpu/test_member_head_gpu.py runs the kernels themselves.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mlptrain.nn.cuda as cuda_package
from mlptrain.nn.epilogs import Epilog, matmul, pack_relu_mask
from mlptrain.nn.head import OutputHead
from mlptrain.nn.members import MemberHead

C_TYPES = {"T": None, "int64": "long long", "bool": "bool", "uint8": "unsigned char"}
FLOATS = {"float32": "float", "float64": "double"}


def has_openmp() -> bool:
    if shutil.which("g++") is None:
        return False
    probe = subprocess.run(
        ["g++", "-fopenmp", "-x", "c++", "-E", "-"], input="#include <omp.h>\n", capture_output=True, text=True
    )
    return probe.returncode == 0


needs_openmp = pytest.mark.skipif(not has_openmp(), reason="needs a C++ compiler with OpenMP (g++ -fopenmp)")


class HostBlockKernel:
    """Stands in for ``cupy.ElementwiseKernel``: a call compiles the kernel as C++ (once per dtype of ``T``) and runs
    its ``size / block_size`` blocks in turn, each as ``block_size`` OpenMP threads that run ``loop_prep``, then the
    operation for their index (one each: the head kernels launch exactly a thread per index)."""

    def __init__(self, in_params: str, out_params: str, operation: str, name: str, *, tmp: Path, **kw: Any) -> None:
        self.params = [p.split() for p in f"{in_params}, {out_params}".split(",")]
        self.operation, self.prep, self.name, self.tmp = operation, kw.get("loop_prep", ""), name, tmp
        self.built: dict[str, Any] = {}

    def __call__(self, *args: Any, size: int, block_size: int) -> None:
        arrays = []
        for p, a in zip(self.params, args, strict=True):
            if p[0] == "raw":
                assert isinstance(a, np.ndarray) and a.flags.c_contiguous, (self.name, p)  # flat views: no copies
                arrays.append(a)
            else:
                arrays.append(np.array(a, np.bool_ if p[-2] == "bool" else np.int64))
        dtype = next(str(a.dtype) for p, a in zip(self.params, arrays, strict=True) if p[-2] == "T")
        lib = self.build(dtype)
        pointers = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
        assert lib.run(pointers, ctypes.c_longlong(size), ctypes.c_int(block_size)) == 1, "OpenMP gave fewer threads"

    def build(self, dtype: str) -> Any:
        if dtype not in self.built:
            lines = []
            for i, (*kind, c_name, name) in enumerate(self.params):
                c_type = C_TYPES[c_name] or "T"
                raw = kind == ["raw"]
                lines.append(
                    f"{c_type}* {name} = ({c_type}*)a[{i}];" if raw else f"const {c_type} {name} = *({c_type}*)a[{i}];"
                )
            src = f"""
#include <cmath>
#include <omp.h>
#define __shared__ static
#define __syncthreads() _Pragma("omp barrier")
struct mlptrain_dim3 {{ long long x; }};
typedef {FLOATS[dtype]} T;
extern "C" int run(void** a, long long size, int block_size) {{
{chr(10).join(lines)}
const long long grid = size / block_size;
int ok = 1;
for (long long bx = 0; bx < grid; ++bx) {{
#pragma omp parallel num_threads(block_size)
{{
if (omp_get_num_threads() != block_size) ok = 0;
const mlptrain_dim3 threadIdx = {{omp_get_thread_num()}}, blockIdx = {{bx}};
const mlptrain_dim3 blockDim = {{block_size}}, gridDim = {{grid}};
{self.prep}
for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < size; i += blockDim.x * gridDim.x) {{
{self.operation}
}}
}}
}}
return ok;
}}
"""
            cpp, so = self.tmp / f"{self.name}_{dtype}.cpp", self.tmp / f"{self.name}_{dtype}.so"
            cpp.write_text(src)
            # -ffp-contract=off: no fused multiply-add but the source's own fmaf (as NVRTC compiles it)
            cmd = ["g++", "-O1", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(so), str(cpp)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-3000:]
            self.built[dtype] = ctypes.CDLL(str(so))
        return self.built[dtype]


@pytest.fixture
def stand_in_cupy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    """A CuPy whose kernels run as C++ on NumPy arrays; mlptrain.nn.cuda's modules imported against it are forgotten
    afterwards (a GPU machine's real ones come back)."""
    fake: Any = types.ModuleType("cupy")
    fake.ElementwiseKernel = functools.partial(HostBlockKernel, tmp=tmp_path)
    fake.empty, fake.zeros, fake.uint8 = np.empty, np.zeros, np.uint8
    fake.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(attributes={"MultiProcessorCount": 132}))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    for name in [m for m in sys.modules if m.startswith("mlptrain.nn.cuda.")]:
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.delattr(cuda_package, name.rsplit(".", 1)[1], raising=False)
    try:
        yield fake
    finally:
        for name in [m for m in sys.modules if m.startswith("mlptrain.nn.cuda.")]:
            sys.modules.pop(name)
            if hasattr(cuda_package, name.rsplit(".", 1)[1]):
                delattr(cuda_package, name.rsplit(".", 1)[1])


def member_operands(k: int, b: int, c: int, h: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """``dlogits (K, B, C)``, ``W (K, C, H)`` float32, the members' masks as a batched RELU_AUX_BIAS leaves them
    (``(K, Mb, B)``, each member's column-major, one after the other), and each member's ``(Mb, B)`` mask."""
    rng = np.random.default_rng(1000 * k + 10 * b + c + h)
    d = (rng.standard_normal((k, b, c)) / b).astype(np.float32)
    w = rng.standard_normal((k, c, h)).astype(np.float32)
    masks = [pack_relu_mask(rng.random((h, b)) > 0.2 + 0.2 * m / k) for m in range(k)]  # member m's own density
    return d, w, np.stack([a.T for a in masks]).swapaxes(1, 2), masks


# (B, C, H): odd sizes and a partial column block; two row passes; three; past 8 passes (the mask bytes reloaded)
SHAPES = [(7, 3, 33), (70, 10, 16), (130, 2, 64), (600, 2, 16)]


@needs_openmp
@pytest.mark.parametrize("lanes", [None, 1, 2, 4, 8])  # None: as member_lanes picks for 132 SMs (here: 1)
@pytest.mark.parametrize("want_db", [True, False])
@pytest.mark.parametrize(("b", "c", "h"), SHAPES)
@pytest.mark.parametrize("k", [1, 3])
def test_the_members_kernel_is_the_single_kernel_on_each_members_slices(
    stand_in_cupy: Any, k: int, b: int, c: int, h: int, want_db: bool, lanes: int | None
) -> None:
    from mlptrain.nn.cuda.head import head_input_grad
    from mlptrain.nn.cuda.member_head import member_input_grad

    d, w, aux, masks = member_operands(k, b, c, h)
    dz, db = member_input_grad(d, w, aux, bias_grad_below=want_db, lanes=lanes)
    assert dz.shape == (k, b, h) and (db is None) != want_db
    for m in range(k):
        one_dz, one_db = head_input_grad(d[m], w[m], aux[m], bias_grad_below=want_db)
        np.testing.assert_array_equal(dz[m].view(np.uint32), one_dz.view(np.uint32), err_msg=f"member {m}")
        # the contract: dZ_below^T (H, B) = W^T (H, C) @ dlogits^T (C, B), DRELU_BGRAD with member m's relu_aux
        ref, sums = matmul(w[m].T, d[m].T, epilog=Epilog.DRELU_BGRAD, epilog_inputs={"relu_aux": masks[m]})
        np.testing.assert_allclose(dz[m], ref.T, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
        assert (dz[m][ref.T == 0] == 0).all()  # dReLU: exactly zero where the layer below's ReLU was off
        if want_db:
            np.testing.assert_array_equal(db[m].view(np.uint32), one_db.view(np.uint32), err_msg=f"member {m}")
            scale = np.abs(dz[m]).sum(axis=0).max()
            np.testing.assert_allclose(db[m], sums["drelu_bgrad"], rtol=1e-5, atol=1e-6 * scale)


def test_the_members_kernel_refuses_a_mask_laid_out_otherwise(stand_in_cupy: Any) -> None:
    from mlptrain.nn.cuda.member_head import member_input_grad

    d, w, aux, _ = member_operands(3, 64, 10, 100)
    with pytest.raises(ValueError, match=r"relu_aux must be uint8 \(3, 16, 64\) with each member column-major"):
        member_input_grad(d, w, np.ascontiguousarray(aux))  # each member C-order: its bits in the wrong places
    with pytest.raises(ValueError, match=r"output weights must be C-contiguous \(3, 10, hidden\) float32"):
        member_input_grad(d, w.astype(np.float64), aux)


def test_the_block_is_the_widest_that_leaves_a_block_for_every_two_sms(stand_in_cupy: Any) -> None:
    """#50's two ensembles on an H100's 132 SMs: 8 x (1024 hidden) and 32 x (256) in 128 blocks of 64 columns, the
    single kernel's count for one model of 1024; a small ensemble keeps the single kernel's 8 columns."""
    from mlptrain.nn.cuda.member_head import member_lanes

    assert member_lanes(8, 1024, 132) == 8 and member_lanes(32, 256, 132) == 8
    assert member_lanes(8, 256, 132) == 2  # 128 blocks of 16 columns
    assert member_lanes(4, 64, 132) == 1 and member_lanes(1, 1024, 132) == 1  # 32 and 128 blocks of 8


SETTINGS = {"gpu": True, "fused": True, "relu": True, "widths": [64, 32, 10], "batch_size": 64, "head_kernel": True}


@pytest.mark.parametrize(
    ("change", "mode"),
    [
        ({}, "kernel"),  # the GPU, fused, a small cross-entropy head: where one model takes the kernel
        ({"head_kernel": False}, "gemm"),  # execution.head_kernel=false
        ({"gpu": False}, "gemm"),  # the CPU: the oracle's batched GEMM
        ({"fused": False}, "gemm"),
        ({"relu": False}, "gemm"),  # GELU below: no relu_aux
        ({"widths": [64, 10]}, "gemm"),  # no hidden layer below
        ({"batch_size": 2048}, "gemm"),  # not a small head
        ({"widths": [64, 32, 40]}, "gemm"),  # more classes than the kernel holds in registers
        ({"loss": "mse"}, "gemm"),
    ],
)
def test_an_ensemble_takes_the_head_kernel_where_one_member_would(
    stand_in_cupy: Any, change: dict[str, Any], mode: str
) -> None:
    """MemberHead.choose: ``kernel`` exactly where OutputHead.choose gives one model ``kernel``; else ``gemm`` (never
    ``loss_bias``: the members' loss sums no bias gradient)."""
    settings = {"loss": "cross_entropy", **SETTINGS, **change}
    single = OutputHead.choose(**settings)
    members = MemberHead.choose(**settings)
    assert isinstance(members, MemberHead) and members.mode == mode
    assert (single.mode == "kernel") == (mode == "kernel"), single.mode


def test_the_trainer_builds_an_ensembles_head_as_the_gpu_would_choose_it(stand_in_cupy: Any) -> None:
    """mlptrain.step.build.head: a 4-member ensemble of 64-32-16-10 at batch 64 is MemberHead in mode ``kernel`` on
    a GPU (a backend that says so) and ``gemm`` on the CPU or with ``execution.head_kernel=false``."""
    from mlptrain.config.schema import TrainConfig
    from mlptrain.step import build

    cfg = TrainConfig()
    cfg.data.batch_size = 64
    sizes = [64, 32, 16, 10]
    gpu: Any = types.SimpleNamespace(is_gpu=True)  # a backend as build.head reads it
    cpu: Any = types.SimpleNamespace(is_gpu=False)
    ensemble, single = build.head(cfg, gpu, sizes, 4), build.head(cfg, gpu, sizes)
    assert isinstance(ensemble, MemberHead) and ensemble.mode == "kernel"
    assert type(single) is OutputHead and single.mode == "kernel"  # one model: the single head, as before
    assert build.head(cfg, cpu, sizes, 4).mode == "gemm"
    cfg.execution.head_kernel = False
    assert build.head(cfg, gpu, sizes, 4).mode == "gemm"
