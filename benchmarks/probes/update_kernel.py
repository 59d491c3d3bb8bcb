"""The optimizer's multi-tensor update alone, at 1, 2, 4 and 8 elements in flight a thread (#50).

The SGD update of a bf16 run (``optimizer=sgd``, momentum 0.9: fp32 master weights and momentum, bf16 gradients and
compute copies) reads and writes 20 bytes a parameter and is memory-bound: for #50's 8-member ensemble it was 64 us
of a 158 us step, at 89% of a device copy's rate, and for the 32-member one 22 us at about two thirds of it. Each
figure here is the update of one model's parameters (each layer's weight and bias, every member stacked, as
:class:`mlptrain.nn.batched.BatchedMLP` holds them) by :meth:`mlptrain.step.optim.Optimizer.step` with
``mlptrain.step.cuda.multitensor.UPDATE_ILP`` set to each value (:func:`~mlptrain.step.cuda.multitensor.staged_loop`),
against a device-to-device copy of the same bytes (half read, half written).

Each figure is the median of CUDA-event times of 20 calls back to back, in microseconds, with the rate in TB/s of
the 20 bytes a parameter. Every variant starts from the same random state; after one step its master weights,
momentum and compute copy must equal the plain loop's (ILP 1) bit for bit. Writes ``update_kernel.json`` into
``$OUT`` (default: the current folder).

Usage: python benchmarks/probes/update_kernel.py   (a GPU with CuPy)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

# name -> (members, widths)
CASES = {
    "8 x 256-1024-1024-10": (8, [256, 1024, 1024, 10]),
    "32 x 64-256-256-2": (32, [64, 256, 256, 2]),
    "1 x 256-1024-1024-10": (1, [256, 1024, 1024, 10]),
    "1 x 64-256-256-2": (1, [64, 256, 256, 2]),
}
ILPS = (1, 2, 4, 8)
BYTES_PER_PARAM = 20  # gradient 2 (read), master 4 + 4, momentum 4 + 4, compute copy 2 (written)


def shapes(members: int, widths: list[int]) -> list[tuple[int, ...]]:
    """Each layer's weight ``(K, out, in)`` and bias ``(K, out)``, as the members' stacked parameters."""
    out: list[tuple[int, ...]] = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:], strict=True):
        out += [(members, fan_out, fan_in), (members, fan_out)]
    return out


def optimizer(layout: list[tuple[int, ...]]) -> Any:
    """SGD (momentum 0.9) over fp32 parameters of ``layout`` with bf16 compute copies and bf16 gradients, all random
    from seed 0 (the same state every call)."""
    import cupy as cp
    import ml_dtypes

    from mlptrain.config.schema import OptimizerConfig
    from mlptrain.nn.layers import Param
    from mlptrain.step.build import optimizer as make_optimizer

    rng, bf16 = cp.random.default_rng(0), ml_dtypes.bfloat16
    params = []
    for i, shape in enumerate(layout):
        p = Param(f"p{i}", rng.standard_normal(shape, dtype=cp.float32), bf16)
        p.grad = rng.standard_normal(shape, dtype=cp.float32).astype(bf16)
        params.append(p)
    opt = make_optimizer(OptimizerConfig(name="sgd", lr=0.05, momentum=0.9), params)
    for p in params:
        opt.state[p.name]["momentum"][...] = rng.standard_normal(p.value.shape, dtype=cp.float32)
    return opt


def time_us(fn: Any) -> float:
    from mlptrain.base.cuda.timing import cuda_time_ms
    from mlptrain.tools.bench.medians import CHAIN, median

    return 1000.0 * median(cuda_time_ms(fn, warmup=3, reps=20, chain=CHAIN))


def snapshot(opt: Any) -> list[Any]:
    """The update's results on the host: master weights, momentum and compute copies."""
    out = []
    for p in opt.params:
        out += [p.value.get(), opt.state[p.name]["momentum"].get(), p.compute.view("uint16").get()]
    return out


def measure(members: int, widths: list[int]) -> dict[str, Any]:
    import cupy as cp
    import numpy as np

    from mlptrain.step.cuda import multitensor

    layout = shapes(members, widths)
    n = sum(int(np.prod(s)) for s in layout)
    args = (cp.asarray(0.05), cp.asarray(1.0), cp.zeros((), dtype=cp.int32))
    row: dict[str, Any] = {"params": n, "us": {}, "tb_s": {}}
    reference = None
    for ilp in ILPS:
        multitensor.UPDATE_ILP = ilp
        opt = optimizer(layout)
        opt.step(*args)
        got = snapshot(opt)
        if reference is None:
            reference = got
        elif not all(np.array_equal(a, b) for a, b in zip(got, reference, strict=True)):
            raise AssertionError(f"ILP {ilp} differs from ILP 1 after one step ({members} x {widths})")
        us = time_us(lambda opt=opt: opt.step(*args))
        row["us"][ilp], row["tb_s"][ilp] = us, n * BYTES_PER_PARAM / us / 1e6
    src = cp.empty(n * BYTES_PER_PARAM // 8, dtype=cp.float32)  # half the bytes read, half written
    dst = cp.empty_like(src)
    us = time_us(lambda: cp.copyto(dst, src))
    row["us"]["copy"], row["tb_s"]["copy"] = us, 2 * src.nbytes / us / 1e6
    return row


def main() -> None:
    import cupy as cp

    from mlptrain.step.cuda import multitensor

    default = multitensor.UPDATE_ILP
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"# {name}; the SGD update (bf16 gradients and copies, fp32 master and momentum); default ILP {default}")
    print("| model | params | " + " | ".join(f"ILP {k} (us, TB/s)" for k in ILPS) + " | copy of the bytes |")
    print("|---|---|" + "---|" * (len(ILPS) + 1))
    rows = {}
    for case, (members, widths) in CASES.items():
        row = rows[case] = measure(members, widths)
        cells = [f"{row['us'][k]:.1f} ({row['tb_s'][k]:.2f})" for k in (*ILPS, "copy")]
        print(f"| {case} | {row['params']:,} | " + " | ".join(cells) + " |", flush=True)
    multitensor.UPDATE_ILP = default
    out = Path(os.environ.get("OUT", ".")) / "update_kernel.json"
    out.write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
