"""One inference layer of 4096 x 4 (#15): every cuBLASLt candidate nvmath plans, against PyTorch.

For (4096 x 4096) @ (4096 x B), B = 8192 and 32768, fp16 and bf16: the candidates of the plan
(``MatmulPlanPreferences(limit=16)``, 4 at the larger batch) with the RELU_BIAS epilog (what
``mlptrain.predict`` runs for a hidden layer), with BIAS (the output layer) and with none, each
timed 10 calls per CUDA graph, median of 7 replays; then PyTorch's ``F.linear`` (cuBLAS with a bias
epilogue), ``relu(F.linear)`` (what ``nn.Sequential(Linear, ReLU)`` runs) and a plain matmul, 10
calls between CUDA events, median of 7. Prints microseconds per GEMM; random normal data; the
RELU_BIAS result is checked against PyTorch in fp32. Needs a GPU and PyTorch.

Usage: python scripts/gemm_candidates.py [--out DIR]

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np

CALLS, REPS = 10, 7


def time_candidates(W, XT, epilog, bias, limit: int) -> list[tuple]:
    """``(index, us per call, tile, algorithm id)`` of each candidate of ``W @ XT`` with ``epilog``."""
    import cupy as cp
    from nvmath.linalg.advanced import Matmul, MatmulPlanPreferences

    from mlptrain.base.cuda.timing import capture_graph, cuda_time_ms

    mm = Matmul(W, XT)
    kw = {} if epilog is None else {"epilog": epilog, "epilog_inputs": {"bias": bias}}
    algorithms = mm.plan(preferences=MatmulPlanPreferences(limit=limit), **kw)
    stream = cp.cuda.Stream(non_blocking=True)
    out = []
    with stream:
        for i, algo in enumerate(algorithms):

            def calls(algo=algo):
                return [mm.execute(algorithm=algo, stream=stream) for _ in range(CALLS)]

            mm.execute(algorithm=algo, stream=stream)  # sizes the workspace outside the capture
            graph, keep = capture_graph(calls, stream)
            t = cuda_time_ms(functools.partial(graph.launch, stream), warmup=2, reps=REPS, stream=stream)
            out.append((i, round(sorted(t)[REPS // 2] / CALLS * 1e3, 1), getattr(algo, "tile", None),
                        getattr(algo, "algorithm_id", None)))  # fmt: skip
            del keep
    stream.synchronize()
    mm.last_compute_event = None  # recorded in a capture: nothing to wait on
    mm.free()
    return out


def time_torch(f) -> float:
    import torch

    with torch.inference_mode():
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        ts = []
        for _ in range(REPS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(CALLS):
                f()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end) / CALLS * 1e3)
    return round(sorted(ts)[REPS // 2], 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for gemm_candidates.json")
    args = ap.parse_args(argv)
    import cupy as cp
    import ml_dtypes
    import torch
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    rng = np.random.default_rng(0)
    results: dict[str, object] = {}
    for name, dtype, tdt in [("float16", np.float16, torch.float16), ("bfloat16", ml_dtypes.bfloat16, torch.bfloat16)]:
        for B in (8192, 32768):
            W = cp.asarray((rng.standard_normal((4096, 4096), dtype=np.float32) * 0.02).astype(dtype))  # (out, in)
            X = cp.asarray(rng.standard_normal((B, 4096), dtype=np.float32).astype(dtype))  # (B, in)
            bias = cp.asarray((rng.standard_normal(4096) * 0.1).astype(dtype))  # (out,)
            key = f"{name} B={B}"
            for label, epilog in [("RELU_BIAS", MatmulEpilog.RELU_BIAS), ("BIAS", MatmulEpilog.BIAS), ("none", None)]:
                results[f"{key} {label}"] = r = time_candidates(W, X.T, epilog, bias, 16 if B == 8192 else 4)
                print(key, label, r, flush=True)
            # PyTorch reads the same bits (it cannot take ml_dtypes' bfloat16 from CuPy directly).
            tW, tX, tb = (torch.as_tensor(a.view(cp.int16), device="cuda").view(tdt) for a in (W, X, bias))
            linear = functools.partial(torch.nn.functional.linear, tX, tW, tb)
            for label, f in [
                ("torch linear", linear),
                ("torch linear+relu", lambda linear=linear: torch.relu(linear())),
                ("torch matmul", functools.partial(torch.matmul, tX, tW.T)),
            ]:
                results[f"{key} {label}"] = us = time_torch(f)
                print(key, label, us, "us", flush=True)
            mm = Matmul(W, X.T)
            mm.plan(epilog=MatmulEpilog.RELU_BIAS, epilog_inputs={"bias": bias})
            z = torch.as_tensor(mm.execute().T.view(cp.int16), device="cuda").view(tdt)  # (B, out)
            ref = torch.relu(torch.nn.functional.linear(tX.float(), tW.float(), tb.float()))
            results[f"{key} max error vs fp32"] = err = float((z.float() - ref).abs().max())
            print(key, "RELU_BIAS max error against PyTorch in fp32:", err, flush=True)
            mm.free()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gemm_candidates.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
