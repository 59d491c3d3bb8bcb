"""One layer, forward and backward, fused vs naive vs the GEMMs alone (``scripts/bench.py`` sections a, b)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mlptrain.base.backend import get_backend
from mlptrain.tools.bench.medians import graph_ms, median, rel_err

SEED_SHAPE = (65536, 16384, 8192)  # (M = out features, K = in features, N = batch)
GRID = [  # (out, in, batch): small, medium and large batch
    (1024, 784, 256),
    (4096, 4096, 1024),
    (4096, 4096, 8192),
    (8192, 8192, 16384),
]


def bench_layer(m, k, n, dtype, reps, activation="relu", graphed=False):
    """Forward and backward of one ReLU (or GELU) layer: out=m, in=k, batch=n.

    The fused backward is always timed from a CUDA graph (:func:`time_layer_backward`); with
    ``graphed`` every other variant is too (else op by op, host launch work included: the
    small shapes then compare a replay with launches).
    """
    cp = get_backend("gpu").xp

    from mlptrain.base.cuda.timing import cuda_time_ms
    from mlptrain.nn.cuda.gemm import NvmathGemm
    from mlptrain.nn.execution import FusedExecution, NaiveExecution
    from mlptrain.step.cuda.bgrad import time_layer_backward

    rng = cp.random.default_rng(1)
    W = (rng.standard_normal((m, k), dtype=cp.float32) / np.sqrt(k)).astype(dtype)  # (out, in)
    b = rng.standard_normal(m, dtype=cp.float32).astype(dtype)
    x = rng.standard_normal((n, k), dtype=cp.float32).astype(dtype)  # (B, in)
    dz = rng.standard_normal((n, m), dtype=cp.float32).astype(dtype)  # (B, out)
    mask_bool = rng.random((n, k)) > 0.5  # ReLU mask of the layer below, naive layout (B, in)
    z_below = rng.standard_normal((n, k), dtype=cp.float32).astype(dtype)  # GELU: its pre-activation (B, in)
    below = z_below if activation == "gelu" else mask_bool  # what the naive backward keeps
    gemm = NvmathGemm()
    fused, naive = FusedExecution(gemm), NaiveExecution(gemm, cp)
    flop = 2.0 * m * k * n
    r: dict[str, Any] = {"shape": [m, k, n], "dtype": str(np.dtype(dtype)) if dtype != "bfloat16" else "bfloat16"}

    def timed(fn):
        return graph_ms(fn, reps) if graphed else median(cuda_time_ms(fn, reps=reps))

    # forward
    r["gemm_fwd"] = timed(lambda: gemm("gemm.fwd", W, x.T))
    r["fused_fwd"] = timed(lambda: fused.forward("f", W, b, x, activation))
    r["naive_fwd"] = timed(lambda: naive.forward("n", W, b, x, activation))
    yf, aux = fused.forward("f", W, b, x, activation)
    yn, mask_n = naive.forward("n", W, b, x, activation)
    r["fwd_err"] = rel_err(yf, yn)
    del yf, yn, aux, mask_n

    # backward: weight gradient + own bias gradient + input gradient through the ReLU below
    def gemms_bwd():
        return gemm("gemm.wgrad", x.T, dz), gemm("gemm.dgrad", W.T, dz.T)

    def naive_bwd():
        return (
            naive.weight_grad("n", x, dz, bias_grad=True),
            naive.input_grad("n", W, dz, below, bias_grad_below=False, activation_below=activation),
        )

    r["gemm_bwd"] = timed(gemms_bwd)
    r["naive_bwd"] = timed(naive_bwd)
    t = time_layer_backward(fused, k, m, n, dtype, reps=reps, activation=activation)
    r["fused_bwd_drelu_bgrad"], r["fused_bwd_bgradb"] = t["drelu_bgrad"], t["bgradb"]
    r["fused_bwd"] = min(t.values())
    r["fused_bwd_strategy"] = min(t, key=lambda name: t[name])
    # correctness of the backward: fused (bgradb) against naive, same mask
    from mlptrain.nn.epilogs import pack_relu_mask

    if activation == "gelu":  # gelu_aux: Z of the layer below, (round_up(in, 8), B) column-major
        aux_below = cp.zeros((k + (-k) % 8, n), dtype=z_below.dtype, order="F")
        aux_below[:k] = z_below.T
    else:
        aux_below = pack_relu_mask(mask_bool.T)  # relu_aux, (Mb(in), B)
    dWf, dbf = fused.weight_grad("chk", x, dz, bias_grad=True)
    dxf, _ = fused.input_grad("chk", W, dz, aux_below, bias_grad_below=False, activation_below=activation)
    dWn, dbn = naive.weight_grad("chkn", x, dz, bias_grad=True)
    dxn, _ = naive.input_grad("chkn", W, dz, below, bias_grad_below=False, activation_below=activation)
    r["bwd_err"] = max(rel_err(dWf, dWn), rel_err(dbf, dbn), rel_err(dxf, dxn))
    r["tflops_gemm_fwd"] = flop / r["gemm_fwd"] / 1e9
    r["tflops_fused_fwd"] = flop / r["fused_fwd"] / 1e9
    gemm.free()
    cp.get_default_memory_pool().free_all_blocks()
    return r
