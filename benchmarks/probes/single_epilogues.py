"""One model's bf16 step with cuBLASLt's backward epilogues against the plain GEMMs and mlptrain's kernels (#50).

``execution.epilogue_kernels`` decides where a bf16 GEMM's DRELU, DRELU_BGRAD and BGRADB run: in cuBLASLt (false) or
as the plain GEMM followed by mlptrain's mask-and-sum kernels (true, :mod:`mlptrain.nn.cuda.epilogue_kernels`). For
each model below, on random data (:func:`mlptrain.tools.bench.step_trainer.random_dataset`), SGD at a constant rate,
the fused step replayed from its CUDA graph, this prints:

* each setting's steady step time (CUDA events around 20 steps back to back, median of 20; the default, ``null``,
  takes the kernels for a GEMM of at least :data:`mlptrain.nn.cuda.gemm.OWN_EPILOGUE_MIN_MACS` multiply-adds, a
  threshold these figures placed);
* how far apart the two runs' losses are after 10 steps from the same initial weights (the kernels sum a bias
  gradient in another order than cuBLASLt, so bf16 rounding may differ; a wrong mask would not stay within a few
  percent).

Writes ``single_epilogues.json`` into ``$OUT`` (default: the current folder).

Usage: python benchmarks/probes/single_epilogues.py [KEY=VALUE ...]   (extra settings of both runs; a GPU)
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

MODELS = [  # (widths: input, hidden..., classes; batch)
    ([64, 256, 256, 2], 256),
    ([784, 1024, 1024, 10], 256),
    ([784, 1024, 1024, 10], 512),
    ([784, 1024, 1024, 10], 1024),
    ([784, 1024, 1024, 10], 2048),
    ([1024, 2048, 2048, 2048, 10], 1024),
    ([4096] * 5, 1024),
    ([1024, 4096, 4096, 4096, 4096, 10], 8192),
    ([4096] * 5, 8192),
    ([8192] * 5, 16384),
]


def run(widths: list[int], batch: int, own: bool, settings: list[str]) -> tuple[float, list[float]]:
    """The steady step time (ms) and the first 10 steps' losses of one model with ``epilogue_kernels=own``."""
    from mlptrain.base.cuda.timing import cuda_time_ms
    from mlptrain.cli.main import compose_config
    from mlptrain.step.trainer import Trainer
    from mlptrain.tools.bench.medians import CHAIN, median
    from mlptrain.tools.bench.step_trainer import random_dataset, step_overrides

    overrides = [
        *step_overrides(widths, batch, "bf16"),
        f"execution.epilogue_kernels={str(own).lower()}",
        *settings,
    ]
    tr = Trainer(compose_config(overrides), dataset=random_dataset(widths, batch))
    with tr.stream:
        xb, yb = next(iter(tr.train_loader.epoch(0, out=tr.batch_buffers)))
        losses = [float(tr.step(xb, yb)[0]) for _ in range(10)]
        ms = median(cuda_time_ms(lambda: tr.step(xb, yb), warmup=3, reps=20, chain=CHAIN))
    return ms, losses


def main() -> int:
    import cupy as cp

    out: list[dict] = []
    columns = ["model", "batch", "cuBLASLt epilogues (ms)", "mlptrain's kernels (ms)", "kernels / cuBLASLt"]
    print("| " + " | ".join([*columns, "loss 10 apart"]) + " |")
    print("|---|---|---|---|---|---|")
    for widths, batch in MODELS:
        lt_ms, lt_loss = run(widths, batch, False, sys.argv[1:])
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()  # the last trainer's arrays, before the next
        own_ms, own_loss = run(widths, batch, True, sys.argv[1:])
        cp.get_default_memory_pool().free_all_blocks()
        apart = abs(own_loss[-1] - lt_loss[-1]) / max(abs(lt_loss[-1]), 1e-30)
        name = "-".join(map(str, widths))
        print(f"| {name} | {batch} | {lt_ms:.4f} | {own_ms:.4f} | {own_ms / lt_ms:.3f}x | {apart:.1e} |", flush=True)
        out.append(
            {
                "widths": widths,
                "batch": batch,
                "cublaslt_ms": lt_ms,
                "kernels_ms": own_ms,
                "losses": [lt_loss, own_loss],
            }
        )
    (Path(os.environ.get("OUT", ".")) / "single_epilogues.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
