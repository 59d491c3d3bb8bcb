"""An ensemble's step tally on the GPU (``mlptrain_member_tally``, mlptrain/nn/cuda/members.py), its CUDA source
compiled as C++ on the CPU and run against the CPU's :meth:`EnsembleTrainer.step_metrics`.

CuPy is stood in for: ``cupy.ElementwiseKernel`` compiles the source it is given with the host's C++ compiler (the
dtype placeholder ``L`` as the loss's type) and runs it, one thread, on the NumPy arrays :func:`tally_members` hands
it. What this checks: the source compiles, and its arithmetic is the CPU's bit for bit (``loss * rows`` rounded to
the loss's dtype, then added in float64), step after step. tests/gpu/test_member_sums_gpu.py runs the kernel itself.
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

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler (g++)")

C_TYPES = {"float32": "float", "float64": "double", "int64": "long long"}


class HostKernel:
    """Stands in for ``cupy.ElementwiseKernel``: a call compiles its source as C++ (once per dtype of ``L``) and runs
    it on the arrays given, in place, its ``size`` threads one after another (the tally's threads share no memory
    they write: member ``i``'s sums are thread ``i``'s, the means read only the inputs)."""

    def __init__(self, in_params: str, out_params: str, operation: str, name: str, *, tmp: Path, **kw: Any) -> None:
        self.params = [p.split() for p in f"{in_params}, {out_params}".split(",")]
        self.operation, self.preamble, self.tmp = operation, kw.get("preamble", ""), tmp
        self.built: dict[str, Any] = {}

    def __call__(self, *args: Any, size: int, block_size: int) -> None:
        arrays = [np.asarray(a) if isinstance(a, np.ndarray) else np.array(a, np.int64) for a in args]
        lib = self.build(str(arrays[0].dtype))
        lib.run((ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays]), ctypes.c_longlong(size))

    def build(self, loss_dtype: str) -> Any:
        if loss_dtype not in self.built:
            lines = []
            for i, p in enumerate(self.params):
                c_type = C_TYPES.get(p[-2], "L")
                pointer = p[0] == "raw"  # a raw array, else a scalar argument (handed over as a 0-d array)
                lines.append(
                    f"{c_type}* {p[-1]} = ({c_type}*)a[{i}];" if pointer else f"{c_type} {p[-1]} = *({c_type}*)a[{i}];"
                )
            src = (
                "#include <cstddef>\n#define __device__\n"
                "static float __fmul_rn(float a, float b) { return a * b; }\n"
                "static double __dmul_rn(double a, double b) { return a * b; }\n"
                f"typedef {C_TYPES[loss_dtype]} L;\n{self.preamble}\n"
                'extern "C" void run(void** a, long long n) {\n' + "\n".join(lines) + "\n"
                f"for (ptrdiff_t i = 0; i < n; ++i) {{\n{self.operation}\n}}\n}}\n"
            )
            cpp, so = self.tmp / f"tally_{loss_dtype}.cpp", self.tmp / f"tally_{loss_dtype}.so"
            cpp.write_text(src)
            # -ffp-contract=off: no fused multiply-add (the GPU's __fmul_rn / __dmul_rn round the product alone)
            cmd = ["g++", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(so), str(cpp)]
            subprocess.run(cmd, check=True, capture_output=True)
            self.built[loss_dtype] = ctypes.CDLL(str(so))
        return self.built[loss_dtype]


@pytest.fixture
def members_module(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    """mlptrain.nn.cuda.members imported against a stand-in CuPy whose kernels run as C++, forgotten afterwards."""
    fake: Any = types.ModuleType("cupy")
    fake.ElementwiseKernel = functools.partial(HostKernel, tmp=tmp_path)
    fake.empty, fake.zeros, fake.float32, fake.float64, fake.int64 = (
        np.empty,
        np.zeros,
        np.float32,
        np.float64,
        np.int64,
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.delitem(sys.modules, "mlptrain.nn.cuda.members", raising=False)
    monkeypatch.delattr(cuda_package, "members", raising=False)
    try:
        import mlptrain.nn.cuda.members as members

        yield members
    finally:
        sys.modules.pop("mlptrain.nn.cuda.members", None)
        if hasattr(cuda_package, "members"):
            delattr(cuda_package, "members")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", [1, 3, 32])
def test_the_tally_source_is_the_cpus_step_metrics_bit_for_bit(members_module: Any, k: int, dtype: Any) -> None:
    rng = np.random.default_rng(k)
    member_loss, member_correct = rng.uniform(0, 1e3, k), rng.integers(0, 10_000, k)
    ours = member_loss.copy(), member_correct.copy()
    for rows in (37, 1000, 37):  # three steps: the sums grow; the short batch again
        loss, correct = rng.uniform(0.01, 3.0, k).astype(dtype), rng.integers(0, rows + 1, k)
        mean_loss, mean_correct = members_module.tally_members(loss, correct, rows, *ours)
        member_loss += loss * rows  # the CPU's step_metrics, as mlptrain/run/ensemble.py writes it
        member_correct += correct
        np.testing.assert_array_equal(ours[0], member_loss)
        np.testing.assert_array_equal(ours[1], member_correct)
        assert mean_loss.dtype == dtype and int(mean_correct) == (correct.sum() + k // 2) // k
        total = 0.0
        for value in loss:  # the kernel's order: member by member, in float64
            total += float(value)
        assert mean_loss == dtype(total / k)
