"""Peak GPU memory of the training step against PyTorch eager (``scripts/bench.py`` section m).

For 4096 x 4 at batch 8192 and 8192 x 4 at batch 16384, fp16 and bf16: mlptrain's graph step
(the default configuration: execution.bgrad=auto, so the bgrad probe runs and its memory counts)
with each cuBLASLt workspace cap asked for, and PyTorch eager (autocast, fp32 master weights,
SGD with momentum, GradScaler for fp16), each with its steady step time and peak memory. The
mlptrain peak is the pools' high-water mark (:mod:`mlptrain.step.cuda.memory`), PyTorch's is
``torch.cuda.max_memory_reserved()``. The live bytes by category come with it. mlptrain runs once
per ``--compute-copies`` value (``kept``, ``cast``: precision.compute_copy).
"""

from __future__ import annotations

from collections.abc import Sequence

from mlptrain.base.backend import get_backend
from mlptrain.tools.bench.medians import CHAIN, fmt, median
from mlptrain.tools.bench.step_timing import bench_step_torch
from mlptrain.tools.bench.step_trainer import step_trainer

GIB = 2**30
MEMORY_MODELS = [("4096 x 4", [4096] * 5, 8192), ("8192 x 4", [8192] * 5, 16384)]


def mlptrain_memory(widths, batch, precision, reps, workspace_mib, compute_copy="kept"):
    import gc

    cp = get_backend("gpu").xp

    from mlptrain.base.cuda.timing import cuda_time_ms
    from mlptrain.step.cuda.memory import account, expected_step_peak

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    tr = step_trainer(widths, batch, precision, workspace_mib=workspace_mib, compute_copy=compute_copy)
    with tr.stream:
        xb, yb = next(iter(tr.train_loader.epoch(0, out=tr.batch_buffers)))
        chained = cuda_time_ms(lambda: tr.step(xb, yb), warmup=5, reps=reps, chain=CHAIN)
        loss = float(tr.step(xb, yb)[0])
    acc = account(tr)
    step_peak = expected_step_peak(
        tr.widths, batch, tr.precision.compute_dtype, tr.model.uses_wgrad_stream, tr.head.mode == "kernel"
    )
    out = {
        "ms": median(chained),
        "peak_gib": acc["peak_bytes"] / GIB,
        "peak_at": acc["peak_at"],
        "loss": loss,
        "bgrad": tr.model.bgrad,
        "account": acc,
        "step_peak_formula_gib": step_peak / GIB,
    }
    tr.gemm.free()  # the caller's gc.collect() and free_all_blocks() release the rest
    return out


def free_device_caches() -> None:
    """Return what this process's CuPy and PyTorch pools cache to the device (before the trials of section l)."""
    _free_all()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _free_all() -> None:
    import gc

    cp = get_backend("gpu").xp

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()


def memory_section(
    reps: int, caps: list[int | None], copies: Sequence[str] = ("kept",)
) -> tuple[list[dict], list[str]]:

    records, md = (
        [],
        [
            "## Peak GPU memory of a training step against PyTorch eager (GiB)",
            "",
            "mlptrain: the graph step in its default configuration (bgrad probe included), peak of CuPy's pools; "
            "workspace cap: execution.workspace_mib (none: nvmath's default); copy: precision.compute_copy "
            "(kept: a half-precision copy of each parameter; cast: each layer's cast into one buffer before its "
            "GEMMs). PyTorch eager: autocast, max_memory_reserved. Step times: steady state, ms.",
            "",
            "| model | batch | dtype | workspace cap MiB | copy | mlptrain GiB | PyTorch GiB | ratio | mlptrain ms "
            "| PyTorch ms | live GiB: weights, copies, grads, optim, batch, saved, relu_aux, data, workspaces "
            "| graph pool GiB | step arrays at their peak, formula GiB | bgrad |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ],
    )
    for name, widths, batch in MEMORY_MODELS:
        for precision in ("fp16", "bf16"):
            torch_rec = bench_step_torch(widths, batch, precision, reps)
            for cap, copy in [(cap, copy) for cap in caps for copy in copies]:
                rec = mlptrain_memory(widths, batch, precision, reps, cap, copy)
                _free_all()
                rec.update(
                    model=name, batch=batch, precision=precision, workspace_mib=cap, compute_copy=copy, torch=torch_rec
                )
                records.append(rec)
                live = ", ".join(f"{v / GIB:.2f}" for v in rec["account"]["live_bytes"].values())
                tp = torch_rec["peak_gib"] if torch_rec else None
                ratio = f"{rec['peak_gib'] / tp:.2f}x" if tp else "-"
                row = (
                    f"| {name} | {batch} | {precision} | {cap or 'none'} | {copy} | {rec['peak_gib']:.2f} "
                    f"| {fmt(tp, 2)} | {ratio} | {rec['ms']:.3f} "
                    f"| {fmt(torch_rec['ms'] if torch_rec else None)} | {live} "
                    f"| {rec['account']['pools']['graph_total'] / GIB:.2f} | {rec['step_peak_formula_gib']:.2f} "
                    f"| {','.join(rec['bgrad'])} |"
                )
                md.append(row)
                print(row, flush=True)
    md.append("")
    return records, md
