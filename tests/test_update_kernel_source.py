"""The GPU's multi-tensor update kernel, its CUDA source compiled as C++ on the CPU and run against the CPU's update.

mlptrain.step.cuda.multitensor writes the source of one CuPy ElementwiseKernel; here CuPy is stood in for (the
kernel object only records its source), the source is compiled by the host's C++ compiler with the dtype
placeholders as ``float``, and its loops run for every thread index in turn on the very arrays of a second
optimizer. What this checks: the source compiles (every name it reads is declared), each element's member comes
from the stacked layout, and the arithmetic is the CPU's (:meth:`Optimizer._update_members` for an ensemble's
per-member settings, one model's update otherwise), bit for bit, with the state in the master dtype or in bfloat16
(``optimizer.state_dtype``: ``S`` stands for CuPy's ``bfloat16``, a 16-bit struct that rounds a float to nearest even
as ``__float2bfloat16`` does and widens exactly). The CUDA-only part (the last block's epilogue: the step count,
the step log's tail) is not run; ``t`` is advanced by hand. tests/gpu/test_members_gpu.py runs the kernel itself.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mlptrain.step.cuda as cuda_package
from mlptrain.base.member_settings import MemberSettings
from mlptrain.config.schema import OptimizerConfig
from mlptrain.nn.layers import Param
from mlptrain.step.build import optimizer as make_optimizer

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler (g++)")

K = 3
SHAPES = [(K, 7, 5), (K, 7), (K, 1, 4), (K, 1)]
C_TYPES = {"float64": "double", "int32": "int", "P": "P", "G": "G", "C": "C", "S": "S"}
# CuPy's bfloat16 as the kernel uses it: made from a float (round to nearest even; a NaN stays a quiet NaN), read as
# a float (exact)
BFLOAT16 = """
struct S {
    unsigned short bits;
    S(float f) {
        unsigned int u; std::memcpy(&u, &f, 4);
        bits = (u & 0x7FFFFFFFu) > 0x7F800000u ? (unsigned short)((u >> 16) | 0x40u)
                                                : (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
    operator float() const { unsigned int u = (unsigned int)bits << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
"""


class SourceOnly:
    """Stands in for ``cupy.ElementwiseKernel``: keeps the parameters and the code it was given."""

    def __init__(self, in_params: str, params: str, operation: str, name: str, **kw: Any) -> None:
        self.name, self.params, self.operation, self.loop_prep = name, params, operation, kw.get("loop_prep", "")


@pytest.fixture
def kernel_class(monkeypatch: pytest.MonkeyPatch):
    """MultiTensorKernel imported against a stand-in CuPy (one SM), and forgotten afterwards."""
    fake = types.ModuleType("cupy")
    fake.ElementwiseKernel = SourceOnly
    fake.zeros, fake.int32 = np.zeros, np.int32
    fake.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(attributes={"MultiProcessorCount": 1}))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.delitem(sys.modules, "mlptrain.step.cuda.multitensor", raising=False)
    monkeypatch.delattr(cuda_package, "multitensor", raising=False)  # (a GPU machine's real one comes back after)
    try:
        yield
    finally:
        sys.modules.pop("mlptrain.step.cuda.multitensor", None)
        if hasattr(cuda_package, "multitensor"):
            delattr(cuda_package, "multitensor")


def compiled(kernel: Any, tmp_path: Path, real: str = "float") -> tuple[Any, list[str]]:
    """The kernel's loops as a C function ``run(void** args)`` over every thread index, with the master weights,
    gradients and compute copies in ``real`` (``float``, ``double``); and its parameter names."""
    src_kernel = kernel._kernel  # (the stand-in's record of the source)
    params = [p.split() for p in src_kernel.params.split(",")]
    declared = [f"{C_TYPES[t]}* {n} = ({C_TYPES[t]}*)a[{i}];" for i, (_, t, n) in enumerate(params)]
    src = (
        "#include <cmath>\n#include <cstddef>\n#include <cstring>\nusing std::sqrt; using std::pow;\n"
        f"typedef {real} P; typedef {real} G; typedef {real} C;\n"
        + BFLOAT16
        + 'extern "C" void run(void** a) {\n'
        + "\n".join(declared)
        + "\n"
        f"for (ptrdiff_t i = 0; i < {kernel.threads}; ++i) {{\n{src_kernel.loop_prep}\n{src_kernel.operation}\n}}\n}}\n"
    )
    cpp, so = tmp_path / "kernel.cpp", tmp_path / "kernel.so"
    cpp.write_text(src)
    # (-ffp-contract=off: one rounding per operation, as NumPy's; no a * b + c fused where the CPU has an FMA)
    cmd = ["g++", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(so), str(cpp)]
    subprocess.run(cmd, check=True, capture_output=True)
    return ctypes.CDLL(str(so)), [n for _, _, n in params]


@pytest.mark.parametrize(
    ("name", "per_member", "state_dtype", "master"),
    [
        ("sgd", True, None, np.float32),
        ("nesterov", True, None, np.float32),
        ("adam", True, None, np.float32),
        ("adamw", True, None, np.float32),
        ("nesterov", False, None, np.float32),
        ("adamw", False, None, np.float32),
        ("sgd", False, "bfloat16", np.float32),
        ("nesterov", True, "bfloat16", np.float32),
        ("adam", False, "bfloat16", np.float32),
        ("adamw", True, "bfloat16", np.float32),
        ("adam", False, None, np.float64),
        ("nesterov", False, "bfloat16", np.float64),  # (the state rounded through float32, as CuPy's bfloat16 does)
        ("adamw", False, "bfloat16", np.float64),
    ],
)
def test_the_kernels_source_updates_as_the_cpu_does(
    name: str, per_member: bool, state_dtype: str | None, master: Any, kernel_class, tmp_path: Path
) -> None:
    cfg = OptimizerConfig(name="sgd" if name == "nesterov" else name, lr=0.01, momentum=0.9, weight_decay=0.5)
    cfg.nesterov, cfg.state_dtype = name == "nesterov", state_dtype
    rng = np.random.default_rng(2)
    start = [rng.standard_normal(s).astype(master) for s in SHAPES]
    cpu, ker = ([Param(f"w{i}", w.copy(), master) for i, w in enumerate(start)] for _ in range(2))
    oc, ok = make_optimizer(cfg, cpu), make_optimizer(cfg, ker)
    if per_member:
        oc.members, ok.members = (MemberSettings(np, 0.01, [0.05, 0.01, 0.2], [0.0, 1e-3, 3e-2]) for _ in range(2))
    lib, names = compiled(ok._multi_tensor_kernel(None), tmp_path, "double" if master is np.float64 else "float")
    lr, inv, skip = np.array(0.0), np.array(0.125), np.array(0, dtype=np.int32)
    for step, rate in enumerate([0.01, 0.008, 0.003]):
        if per_member and step == 2:
            oc.members.freeze(1)
            ok.members.freeze(1)
        for p, q in zip(cpu, ker, strict=True):
            p.grad = q.grad = rng.standard_normal(p.value.shape).astype(master)
        if oc.members is not None:
            oc.members.lr = [rate * b / 0.01 for b in oc.members.base_lr]  # as the trainer sets them
        oc.step(np.asarray(rate), inv_scale=inv)
        lr[...] = rate
        by_role = {"g": [q.grad for q in ker], "p": [q.value for q in ker]}
        by_role.update({s: [ok.state[q.name][s] for q in ker] for s in ok.state_names})
        extras = {"lr": lr, "inv_scale": inv, "skip": skip, "t": ok.t, "blocks_done": np.zeros(1, np.int32)}
        if ok.members is not None:
            extras.update(zip(("member_lr", "member_wd", "member_frozen"), ok.members.device_arrays(), strict=True))
        args = []
        for n in names:
            role = re.fullmatch(r"([a-z_]+?)(\d+)", n)
            args.append(by_role[role[1]][int(role[2])] if role and role[1] in by_role else extras[n])
        lib.run((ctypes.c_void_p * len(args))(*[a.ctypes.data for a in args]))
        ok.t += 1.0  # (the epilogue's)
    for p, q, w in zip(cpu, ker, start, strict=True):
        np.testing.assert_array_equal(q.value, p.value, err_msg=p.name)  # bit for bit: the same float operations
        for s in ok.state_names:
            kernel_state, cpu_state = ok.state[q.name][s], oc.state[p.name][s]
            want = master if s == "exp_avg_sq" else state_dtype or master  # (Adam's second moment: the master's)
            assert kernel_state.dtype == cpu_state.dtype == np.dtype(want)
            bits = f"uint{8 * kernel_state.dtype.itemsize}"  # (the bits compared: a NaN equals itself)
            np.testing.assert_array_equal(kernel_state.view(bits), cpu_state.view(bits), err_msg=f"{p.name}/{s}")
        assert not np.array_equal(q.value[0], w[0])  # (it trained)
