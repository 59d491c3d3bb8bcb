"""Exercise every FP8 kernel, GEMM and epilog of precision=fp8 once on this GPU, against the NumPy contract.

    python scripts/fp8_probe.py                 # PASS/FAIL per check, the error against the contract
    python scripts/fp8_probe.py --json out.json # the same, as JSON

What it checks (each one independent: a failure is printed with its exception and the rest go on):

* the machine: GPU, compute capability (8.9+ for FP8), cuBLASLt, CuPy, nvmath;
* the cast kernels (e4m3, e5m2; straight and transposed) and the delayed-scaling update, bit for bit
  against :class:`mlptrain.nn.fp8.Fp8Scaling`;
* each FP8 GEMM of :class:`mlptrain.nn.cuda.fp8_gemm.GpuFp8Gemm` (plain, C-order, every forward and
  backward epilog, BGRADB's separate bias gradient, fast accumulation) against :class:`mlptrain.nn.fp8.Fp8Gemm`;
* that BGRADB itself is refused in FP8 (as measured on the H200 with nvmath);
* one GEMM captured in a CUDA graph and replayed, bit for bit against the same GEMM run eagerly;
* a few fp8 training steps on digits, with and without a graph;
* GPU times at 4096 and 8192: bf16 GEMM, FP8 GEMM with and without its casts, the casts alone.

Exit status 1 if any check fails. Made to be the first thing run on a new GPU: its output says what breaks.

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from mlptrain.nn.epilogs import Epilog, gelu_aux_shape, pack_relu_mask, unpack_relu_mask
from mlptrain.nn.epilogs_fp8 import FORMATS
from mlptrain.nn.execution import NumpyGemm
from mlptrain.nn.fp8 import Fp8Call, Fp8Gemm, Fp8Scaling

BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = 2 * 2.0**-8  # two bfloat16 roundings, relative to the largest value of the contract
RESULTS: list[dict[str, Any]] = []


def check(name: str, fn: Callable[[], Any]) -> None:
    """Run one check; record PASS with what it returns (an error, a note) or FAIL with the exception."""
    try:
        note = fn()
        RESULTS.append({"check": name, "ok": True, "note": note})
        print(f"PASS {name}" + (f"  {note}" if note is not None else ""), flush=True)
    except Exception as exc:  # a probe reports every failure and goes on
        RESULTS.append({"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        print(f"FAIL {name}  {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc(limit=3)


def bf16(shape: tuple, seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(BF16)


def rel_err(got: Any, want: Any) -> float:
    import cupy as cp

    a = (cp.asnumpy(got) if isinstance(got, cp.ndarray) else np.asarray(got)).astype(np.float64)
    b = np.asarray(want).astype(np.float64)
    err = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
    if not err < TOL:
        raise AssertionError(f"error {err:.3g} relative to the contract's max, above {TOL:.3g}")
    return err


def machine() -> str:
    import cupy as cp
    import nvmath
    from nvmath.bindings import cublasLt

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    cc = cp.cuda.Device().compute_capability
    if int(cc) < 89:
        raise RuntimeError(f"{name} has compute capability {cc[:-1]}.{cc[-1]}: FP8 needs 8.9 or higher")
    return f"{name}, cc {cc}, cuBLASLt {cublasLt.get_version()}, CuPy {cp.__version__}, nvmath {nvmath.__version__}"


def casts(fmt: str, order: str) -> str:
    import cupy as cp

    from mlptrain.nn.cuda.fp8_kernels import GpuFp8Scaling

    x = bf16((96, 160), 1, 40.0)
    x[1, 2], x[3, 4], x[5, 6] = np.inf, np.nan, 1e7
    gpu, cpu = GpuFp8Scaling(), Fp8Scaling(np)
    for step in range(3):
        q, inv = gpu.quantize("t", cp.asarray(x), fmt, order=order)
        want, want_inv = cpu.quantize("t", x, fmt)
        got = cp.asnumpy(q).view(FORMATS[fmt]).astype(np.float64)
        want64 = want.astype(np.float64)
        same = (np.isnan(got) == np.isnan(want64)).all() and (got[~np.isnan(got)] == want64[~np.isnan(want64)]).all()
        if not same or float(inv) != float(want_inv):
            raise AssertionError(f"step {step}: {int((got != want64).sum())} bytes differ from the contract")
    for key, value in cpu.state_dict().items():
        if not np.array_equal(gpu.state_dict()[key], value):
            raise AssertionError(f"{key}: {gpu.state_dict()[key]} on the GPU, {value} in the contract")
    return "bit for bit, 3 steps of delayed scaling"


def gemm(role: str, epilog: Epilog | None, mode: str = "fused", fast_accum: bool = False) -> str:
    """One FP8 GEMM of ``role`` through both engines, twice (scale 1, then the recorded scales)."""
    import cupy as cp

    from mlptrain.nn.cuda.fp8_gemm import GpuFp8Gemm
    from mlptrain.nn.cuda.fp8_kernels import GpuFp8Scaling
    from mlptrain.nn.cuda.gemm import NvmathGemm

    gpu = GpuFp8Gemm(NvmathGemm(), GpuFp8Scaling(), mode, fast_accum=fast_accum)
    cpu = Fp8Gemm(NumpyGemm(), Fp8Scaling(np), mode)
    a, b, inputs = operands(role, epilog, mode)
    errs = []
    for _ in range(2):
        d, aux = gpu(f"p.{role}", _to_gpu(a), _to_gpu(b), epilog, **{k: _to_gpu(v) for k, v in inputs.items()})
        d_ref, aux_ref = cpu(f"p.{role}", a, b, epilog, **inputs)
        if d.flags.c_contiguous != d_ref.flags.c_contiguous:
            raise AssertionError(f"D is {'C' if d.flags.c_contiguous else 'F'}-order, the contract's is not")
        errs.append(rel_err(d, d_ref))
        for name, ref in aux_ref.items():
            if name == "relu_aux":
                m = d_ref.shape[0]
                z = d_ref.astype(np.float64)
                clear = z > 0.05 * np.abs(z).max()
                got = unpack_relu_mask(cp.asnumpy(aux[name]), m)
                if (got[clear] != unpack_relu_mask(ref, m)[clear]).any():
                    raise AssertionError("relu_aux differs from the contract away from 0")
            else:
                errs.append(rel_err(aux[name][: ref.shape[0]], ref))
    return f"max error {max(errs):.2e} (tolerance {TOL:.1e})"


def _to_gpu(a: np.ndarray) -> Any:
    """A CuPy copy of ``a`` in the same layout (a transposed view stays a transposed view)."""
    import cupy as cp

    if not a.flags.c_contiguous and a.T.flags.c_contiguous:
        return cp.asarray(np.ascontiguousarray(a.T)).T
    return cp.asarray(a)


def operands(role: str, epilog: Epilog | None, mode: str) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """The operands the executions pass for ``role`` (out 256, in 128, batch 64), and the epilog's inputs."""
    out, inp, batch = 256, 128, 64
    W, x, dz = bf16((out, inp), 2, 0.1), bf16((batch, inp), 3), bf16((batch, out), 4, 1e-3)
    if role == "fwd":
        return (W, x.T, {"bias": bf16(out, 5, 0.1)} if epilog is not None else {}) if mode == "fused" else (x, W.T, {})
    if role == "wgrad":
        return x.T, dz, {}
    if mode == "naive":
        return dz, W, {}
    m, n = inp, batch  # dX^T (in, B) = W^T @ dZ^T, the mask of the layer below (in, B)
    if epilog in (Epilog.DRELU, Epilog.DRELU_BGRAD):
        return W.T, dz.T, {"relu_aux": pack_relu_mask(np.random.default_rng(6).random((m, n)) > 0.5)}
    if epilog in (Epilog.DGELU, Epilog.DGELU_BGRAD):
        z = np.zeros(gelu_aux_shape(m, n), BF16, order="F")
        z[:m] = bf16((m, n), 7)
        return W.T, dz.T, {"gelu_aux": z}
    return W.T, dz.T, {}


def bgradb_refused() -> str:
    from mlptrain.nn.cuda.fp8_gemm import Fp8Matmul

    mm = Fp8Matmul(128, 256, 64, ("e4m3", "e5m2"), Epilog.BGRADB, workspace_bytes=2**25)
    try:
        mm.plan("probe.bgradb")
    except RuntimeError as exc:
        return f"refused, as documented ({exc})"
    finally:
        mm.free()
    return "cuBLASLt now PLANS BGRADB in FP8: the weight gradient could fuse its bias gradient (update the docs)"


def graph_replay() -> str:
    import cupy as cp

    from mlptrain.base.cuda.timing import capture_graph
    from mlptrain.nn.cuda.fp8_gemm import GpuFp8Gemm
    from mlptrain.nn.cuda.fp8_kernels import GpuFp8Scaling
    from mlptrain.nn.cuda.gemm import NvmathGemm

    a, b, inputs = operands("fwd", Epilog.RELU_AUX_BIAS, "fused")
    args = (_to_gpu(a), _to_gpu(b), Epilog.RELU_AUX_BIAS)
    bias = _to_gpu(inputs["bias"])
    eager, captured = (GpuFp8Gemm(NvmathGemm(), GpuFp8Scaling()) for _ in range(2))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        eager("g.fwd", *args, bias=bias)  # the first call plans (outside the capture), as the warm-up step
        captured("g.fwd", *args, bias=bias)
        want, _ = eager("g.fwd", *args, bias=bias)
        graph, (got, _) = capture_graph(lambda: captured("g.fwd", *args, bias=bias), stream)
        graph.launch()
        stream.synchronize()
    if not bool((got == want).all()):
        raise AssertionError("the replayed GEMM differs from the eager one")
    return "bit for bit (casts, scale update and GEMM in one graph)"


def training(graph: bool) -> str:
    import cupy as cp

    from mlptrain.tools.bench.step_trainer import graph_run

    tr, losses = graph_run(graph, 84, **{"precision.name": "fp8"})
    cp.cuda.Device().synchronize()
    if not (np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0]):
        raise AssertionError(f"losses {losses[0]:.3f} -> {losses[-1]:.3f}: fp8 did not train")
    return f"84 steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, {len(tr.gemm.scaling.tensors)} FP8 tensors"


def timing(size: int) -> str:
    """GPU times at M = N = K = ``size``: the bf16 RELU_AUX_BIAS GEMM, the FP8 one with its two casts, the
    casts alone (straight, transposed), and the bare FP8 GEMM: where the FP8 step's time goes."""
    import cupy as cp

    from mlptrain.base.cuda.timing import cuda_time_ms
    from mlptrain.nn.cuda.fp8_gemm import GpuFp8Gemm
    from mlptrain.nn.cuda.fp8_kernels import GpuFp8Scaling
    from mlptrain.nn.cuda.gemm import NvmathGemm

    W, x, bias = (cp.asarray(bf16(shape, i, 0.05)) for i, shape in enumerate([(size, size), (size, size), (size,)]))
    bf, f8, cast = NvmathGemm(), GpuFp8Gemm(NvmathGemm(), GpuFp8Scaling()), GpuFp8Scaling()
    relu = Epilog.RELU_AUX_BIAS
    a8, a_inv = cast.quantize("w", W, "e4m3", order="C")
    b8, b_inv = cast.quantize("x", x.T, "e4m3", order="F")
    bare = GpuFp8Gemm(NvmathGemm(), GpuFp8Scaling())
    call = Fp8Call("t.fwd", (a8, a_inv, "e4m3"), (b8, b_inv, "e4m3"), relu, {"bias": bias}, BF16, False)
    runs = {
        "bf16 GEMM": lambda: bf("t.fwd", W, x.T, relu, bias=bias),
        "FP8 GEMM + 2 casts": lambda: f8("t.fwd", W, x.T, relu, bias=bias),
        "FP8 GEMM alone": lambda: bare.matmul(call),
        "cast straight": lambda: cast.quantize("w", W, "e4m3", order="C"),
        "cast transposed": lambda: cast.quantize("w", W.T, "e4m3", order="C"),
    }
    ms = {name: float(np.median(cuda_time_ms(fn, warmup=3, reps=10))) for name, fn in runs.items()}
    return ", ".join(f"{name} {t:.3f} ms" for name, t in ms.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    check("machine", machine)
    for fmt in ("e4m3", "e5m2"):
        for order in ("C", "F"):
            check(f"cast {fmt} order {order} (+ amax, scale update)", lambda f=fmt, o=order: casts(f, o))
    for epilog in (None, Epilog.BIAS, Epilog.RELU_BIAS, Epilog.RELU_AUX_BIAS, Epilog.GELU_BIAS, Epilog.GELU_AUX_BIAS):
        check(f"fwd {epilog.name if epilog else 'plain'} e4m3 x e4m3", lambda e=epilog: gemm("fwd", e))
    for epilog in (None, Epilog.DRELU, Epilog.DRELU_BGRAD, Epilog.DGELU, Epilog.DGELU_BGRAD):
        check(f"dgrad {epilog.name if epilog else 'plain'} e4m3 x e5m2", lambda e=epilog: gemm("dgrad", e))
    check("wgrad plain + bias gradient of the 16-bit dZ (BGRADB)", lambda: gemm("wgrad", Epilog.BGRADB))
    check("naive fwd (C-order D: B^T A^T)", lambda: gemm("fwd", None, "naive"))
    check("naive dgrad (C-order D, e5m2 x e4m3)", lambda: gemm("dgrad", None, "naive"))
    check("fwd RELU_AUX_BIAS with fast accumulation", lambda: gemm("fwd", Epilog.RELU_AUX_BIAS, fast_accum=True))
    check("BGRADB in FP8", bgradb_refused)
    check("graph capture and replay of an FP8 GEMM", graph_replay)
    check("fp8 training, uncaptured", lambda: training(False))
    check("fp8 training, CUDA graph", lambda: training(True))
    for size in (4096, 8192):
        check(f"times at M = N = K = {size} (RELU_AUX_BIAS)", lambda n=size: timing(n))
    failed = [r["check"] for r in RESULTS if not r["ok"]]
    print(f"\n{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed" + (f"; failed: {failed}" if failed else ""))
    if args.json:
        args.json.write_text(json.dumps(RESULTS, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
