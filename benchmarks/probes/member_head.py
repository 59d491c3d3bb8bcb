"""The output layer's input gradient of an ensemble, alone: the members' head kernel at each block width against the
batched GEMM it replaces (#50).

For #50's two ensembles (8 members of 256-1024-1024-10 and 32 of 64-256-256-2, batch 256, bf16) it times, on random
operands, ``dZ_below (K, B, H) = (dlogits @ W) * relu'(Z_below)`` with its bias gradient (DRELU_BGRAD) and without
(DRELU, the ``bgradb`` strategy):

* ``mlptrain_member_head_dgrad`` (:func:`mlptrain.nn.cuda.member_head.member_input_grad`) with 1, 2, 4 and 8 lanes a
  thread (blocks of 8 to 64 columns; which one :func:`~mlptrain.nn.cuda.member_head.member_lanes` picks is marked);
* the batched GEMM and mlptrain's mask-and-sum kernels (``FusedExecution.input_grad``, what head mode ``gemm`` runs;
  ``execution.epilogue_kernels`` default) and with cuBLASLt's own epilogue (``epilogue_kernels=False``);
* the single model's head kernel once per member (K launches), for scale.

Each figure is the median of CUDA-event times of 20 calls back to back (the steady state of a replayed step), in
microseconds. Writes ``member_head.json`` into ``$OUT`` (default: the current folder). The whole step's view, with and
without the kernel: ``benchmarks/probes/member_kernels.py`` and ``... execution.head_kernel=false``.

Usage: python benchmarks/probes/member_head.py   (a GPU with CuPy and nvmath-python)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

CASES = {"big": (8, 256, 10, 1024), "small": (32, 256, 2, 256)}  # (K, B, C, H)


def operands(k: int, b: int, c: int, h: int) -> tuple[Any, Any, Any]:
    """bf16 ``dlogits (K, B, C)``, ``W (K, C, H)`` and the members' ``relu_aux (K, Mb, B)`` (each column-major)."""
    import cupy as cp
    import ml_dtypes
    import numpy as np

    from mlptrain.nn.epilogs import pack_relu_mask

    rng = np.random.default_rng(0)
    d = cp.asarray((rng.standard_normal((k, b, c)) / b).astype(ml_dtypes.bfloat16))
    w = cp.asarray(rng.standard_normal((k, c, h)).astype(ml_dtypes.bfloat16))
    masks = [pack_relu_mask(rng.random((h, b)) > 0.5) for _ in range(k)]  # (Mb, B) column-major
    return d, w, cp.asarray(np.stack([a.T for a in masks])).swapaxes(1, 2)


def time_us(fn: Any) -> float:
    from mlptrain.base.cuda.timing import cuda_time_ms
    from mlptrain.tools.bench.medians import CHAIN, median

    return 1000.0 * median(cuda_time_ms(fn, warmup=3, reps=20, chain=CHAIN))


def measure(k: int, b: int, c: int, h: int, db: bool) -> dict[str, float]:
    import cupy as cp

    from mlptrain.nn.cuda.gemm import NvmathGemm
    from mlptrain.nn.cuda.head import head_input_grad
    from mlptrain.nn.cuda.member_head import member_input_grad, member_lanes
    from mlptrain.nn.execution import FusedExecution

    d, w, aux = operands(k, b, c, h)
    out: dict[str, float] = {}
    picked = member_lanes(k, h, int(cp.cuda.Device().attributes["MultiProcessorCount"]))
    for lanes in (1, 2, 4, 8):
        key = f"kernel {8 * lanes} columns{' (picked)' if lanes == picked else ''}"
        out[key] = time_us(lambda lanes=lanes: member_input_grad(d, w, aux, bias_grad_below=db, lanes=lanes))
    for own, name in ((None, "batched GEMM + mask-and-sum kernels"), (False, "batched GEMM, cuBLASLt's epilogue")):
        ex = FusedExecution(NvmathGemm(epilogue_kernels=own))
        out[name] = time_us(lambda ex=ex: ex.input_grad("probe", w, d, aux, bias_grad_below=db))
    singles = [(d[m], w[m], aux[m]) for m in range(k)]
    out["single kernel x K"] = time_us(lambda: [head_input_grad(*s, bias_grad_below=db) for s in singles])
    return out


def main() -> int:
    import cupy as cp

    results = {}
    for case, (k, b, c, h) in CASES.items():
        for db in (True, False):
            key = f"{case} K={k} B={b} C={c} H={h} {'DRELU_BGRAD' if db else 'DRELU'}"
            results[key] = measure(k, b, c, h, db)
            print(f"== {key}")
            for name, us in results[key].items():
                print(f"   {us:8.2f} us  {name}")
            cp.get_default_memory_pool().free_all_blocks()
    (Path(os.environ.get("OUT", ".")) / "member_head.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
