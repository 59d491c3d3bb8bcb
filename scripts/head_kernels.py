"""The output layer's input gradient: mlptrain_head_dgrad's block shapes against cuBLASLt.

Times, each alone and replayed from a CUDA graph (20 launches back to back, median of 15
replays, and one launch on an idle GPU):

* ``mlptrain_head_dgrad`` (:mod:`mlptrain.nn.cuda.head`) for several (columns per block, threads);
* the GEMM it replaces: ``FusedExecution.input_grad`` with DRELU_BGRAD through nvmath/cuBLASLt;
* an empty kernel of the same launch shape (the launch floor) and the loss kernel.

Every variant's result is compared with the GEMM's (max |difference|). Random normal data.

Usage: python scripts/head_kernels.py [--batch 256] [--classes 10] [--hidden 1024] [--precision fp16]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np

from mlptrain.base.backend import probe_gpu

SHAPES = ((8, 512), (8, 256), (16, 512), (32, 256), (4, 512))  # (columns per block, threads)
EMPTY = "if (threadIdx.x == 0 && B < 0) db[0] = (T)0.0f;"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--precision", default="fp16", choices=["fp32", "fp16", "bf16"])
    args = ap.parse_args(argv)
    available, reason = probe_gpu()
    if not available:
        print(f"head_kernels.py needs an NVIDIA GPU with CuPy and nvmath-python: {reason}", file=sys.stderr)
        return 2
    import cupy as cp
    import ml_dtypes

    from mlptrain.base.cuda.timing import capture_graph, cuda_time_ms
    from mlptrain.nn.cuda import head
    from mlptrain.nn.cuda.gemm import NvmathGemm
    from mlptrain.nn.epilogs import pack_relu_mask
    from mlptrain.nn.execution import FusedExecution
    from mlptrain.nn.losses import softmax_cross_entropy

    B, C, H = args.batch, args.classes, args.hidden
    dtype = {"fp16": np.float16, "bf16": np.dtype(ml_dtypes.bfloat16)}.get(args.precision, np.float32)
    rng = np.random.default_rng(0)
    d = cp.asarray(rng.standard_normal((B, C)).astype(dtype))  # (B, C) dlogits
    W = cp.asarray(rng.standard_normal((C, H)).astype(dtype))  # (C, H) output weight
    aux = cp.asarray(np.ascontiguousarray(pack_relu_mask(rng.random((H, B)) > 0.5).T)).T  # (Mb, B) F-order
    y = cp.asarray(rng.integers(0, C, B))
    mb = aux.shape[0]

    def launcher(kernel, cols, threads):
        dz, db = cp.empty((B, H), d.dtype), cp.empty(H, d.dtype)
        flat = (d.reshape(-1), W.reshape(-1), aux.T.reshape(-1), B, H, mb, True, dz.reshape(-1), db)
        return lambda: (kernel(*flat, size=-(-H // cols) * threads, block_size=threads), dz, db)[1:]

    ex = FusedExecution(NvmathGemm())
    variants = {"cuBLASLt DRELU_BGRAD": lambda: ex.input_grad("head", W, d, aux, bias_grad_below=True)}
    for cols, threads in SHAPES:
        variants[f"head_dgrad {cols} cols x {threads}"] = launcher(head.dgrad_kernel(C, cols, threads), cols, threads)
    empty = cp.ElementwiseKernel(
        "raw T d, raw T W, raw uint8 aux, int64 B, int64 H, int64 Mb, bool want_db",
        "raw T dzb, raw T db",
        EMPTY,
        "empty",
        no_return=True,
    )
    variants["empty kernel, 8 cols x 512"] = launcher(empty, 8, 512)
    variants["loss (xent_small)"] = lambda: softmax_cross_entropy(d, y, 1.0, bias_grad=True)

    print(f"B={B} C={C} H={H} {args.precision}; us per launch (back to back, one launch on an idle GPU)")
    stream = cp.cuda.Stream(non_blocking=True)
    ref = None
    for name, fn in variants.items():
        with stream:
            out = fn()
            stream.synchronize()
            if ref is None:
                ref = out
            err = ""
            if name.startswith("head_dgrad"):
                diff = [
                    float(cp.abs(a.astype(cp.float32) - b.astype(cp.float32)).max())
                    for a, b in zip(out, ref, strict=True)
                ]
                err = f"  max |dz - cuBLASLt| {diff[0]:.3g}, |db - cuBLASLt| {diff[1]:.3g}"
            many, keep = capture_graph(lambda fn=fn: [fn() for _ in range(20)], stream)
            one, keep1 = capture_graph(fn, stream)
            chained = cuda_time_ms(functools.partial(many.launch, stream), warmup=3, reps=15, stream=stream)
            single = cuda_time_ms(functools.partial(one.launch, stream), warmup=3, reps=15, stream=stream)
            stream.synchronize()
            del keep, keep1
        print(f"{name:>28}: {sorted(chained)[7] / 20 * 1e3:6.2f} {sorted(single)[7] * 1e3:6.2f}{err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
