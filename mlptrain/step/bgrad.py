"""Where each hidden layer's bias gradient is reduced in the fused backward (``execution.bgrad``).

``drelu_bgrad``: in the input-gradient GEMM of the layer above (the DRELU_BGRAD epilog); ``bgradb``: in
the layer's own weight-gradient GEMM (DRELU above, BGRADB here). Both are exact; which is faster depends
on the shapes and on how the backward is scheduled, so ``auto`` times this model's step both ways on the
GPU (:mod:`mlptrain.step.cuda.bgrad`), and takes ``bgradb`` untimed where the choice cannot matter
(``drelu_bgrad`` under ``precision=fp8``, where it is the one without a pass of its own).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import numpy as np

from mlptrain.distributed.dp import shard_rows
from mlptrain.step import build

log = logging.getLogger(__name__)

# Below this many GEMM FLOPs per training step (6 x batch x sum of in x out), execution.bgrad=auto
# takes bgradb without timing both strategies: the step is launch-bound, so they time the same.
PROBE_MIN_FLOPS = 1e9


def choose(tr: Any) -> None:
    """Set where each hidden layer of the trainer ``tr``'s model reduces its bias gradient (``execution.bgrad``).

    Called by :class:`mlptrain.step.trainer.Trainer` once everything the step uses is built (the probe times it)."""
    choice = tr.cfg.execution.bgrad.value
    if choice != "auto":
        tr.model.set_bgrad(choice)
        return
    # a step of microseconds (an ensemble's: every member's GEMMs)
    small = build.step_flops(tr.widths, tr.cfg.data.batch_size) * tr.members < PROBE_MIN_FLOPS
    if small or not (tr.backend.is_gpu and tr.cfg.execution.mode.value == "fused" and len(tr.widths) > 2):
        # on the CPU (and in naive mode) the two do the same work; in a small step the choice cannot
        tr.model.set_bgrad("bgradb")  # matter and the probe would cost more than the run (default digits)
        return
    if tr.precision.fp8:
        # FP8 on the GPU: DRELU_BGRAD is the plain FP8 GEMM and mlptrain's mask kernel, which sums the bias gradient
        # as it masks (nn/cuda/epilogue_kernels.py); BGRADB has no FP8 form and costs a pass of its own over dZ.
        # drelu_bgrad, untimed (docs/benchmarks.md, #30: 3.71 against 4.19 ms a step at 4096 x 4, batch 8192).
        # Timed, the probe's key would also be the bf16 step's (the same compute dtype) and share its entry.
        tr.model.set_bgrad("drelu_bgrad")
        return
    from mlptrain.nn.cuda.plan_cache import PlanCache
    from mlptrain.step.cuda.bgrad import choose_bgrad, random_batch, remembered

    # Both strategies are exact; which is faster depends on the shapes and on how the
    # backward is scheduled: time this model's step both ways, on random data.
    ex = tr.cfg.execution
    cdt, B = tr.precision.compute_dtype, min(tr.cfg.data.batch_size, len(tr.train_loader.x))  # a full batch
    if tr.grad_sync is not None:  # data parallel: this rank's step runs on its shard of the batch
        B = len(range(B)[shard_rows(B, tr.grad_sync.comm.rank, tr.grad_sync.comm.world)])
    key = (
        f"step {'-'.join(map(str, tr.widths))} batch {B} {np.dtype(cdt).name}"
        f"{'' if tr.cfg.model.activation == 'relu' else ' ' + tr.cfg.model.activation}"
        f"{' tf32' if tr.precision.tf32 else ''}{' 2 streams' if tr.model.uses_wgrad_stream else ''}"
        f"{' head kernel' if tr.head.mode == 'kernel' else ''}"
        f"{f' workspace {ex.workspace_mib} MiB' if ex.workspace_mib is not None else ''}"
        f"{f' {tr.members} members' if tr.members > 1 else ''}"
        f"{' own epilogues' if own_epilogues(tr, B) else ''}"
    )
    store = PlanCache.default_path().with_suffix(".bgrad.json") if ex.plan_cache else None
    known = remembered(store, key, len(tr.model.bgrad))
    if known is not None:  # an earlier run's choice: the same rounding as that run's, nothing timed or planned
        tr.model.set_bgrad(known)
        return
    t0 = time.perf_counter()
    tr.runtime.wait()  # every thread idle: the probe captures CUDA graphs (a run without it goes on)
    waited = time.perf_counter() - t0
    tr.model.set_bgrad("drelu_bgrad")
    with tr.runtime.stream:  # the batch in a list, so that it can go before the pool is emptied
        y = tr.train_loader.y
        batch = random_batch(B, tr.widths, cdt, y.dtype, y.shape[1:], out=tr.batch_buffers(B))
        if tr.members > 1:  # an ensemble's step takes (K, B, ...) batches: every member on the same random rows
            batch = [tr.xp.stack([a] * tr.members) for a in batch]
        chosen = choose_bgrad(
            tr.model,
            lambda: tr.forward_backward(*batch),
            key,
            store=store,
            release=tr.release_step,
            on_pool=lambda n: tr.runtime.memory_peak.sample("bgrad probe", extra=n),
        )
    tr.model.set_bgrad(chosen)
    # Nothing of the probe stays: its plans (the strategy not chosen has its own GEMMs, and a
    # DRELU_BGRAD plan can hold a workspace of gigabytes) and the arrays they still reference
    # go, and so do the blocks its graphs allocated. The step plans again (from the plan cache).
    tr.runtime.memory_peak.sample("bgrad probe")
    batch.clear()
    tr.release_step()
    tr.gemm.free()
    gc.collect()  # the probe's graphs and their outputs, if a reference cycle still holds them
    took = time.perf_counter() - t0
    log.info("bgrad probe: %.2f s, %.2f s of it waiting for the kernels compiling ahead", took, waited)


def own_epilogues(tr: Any, batch: int) -> bool:
    """Whether ``tr``'s step at ``batch`` rows ends some GEMMs in mlptrain's epilogue kernels instead of cuBLASLt's
    (:meth:`mlptrain.nn.cuda.gemm.NvmathGemm.own_epilogues`): a remembered choice is only the same step's if so."""
    own = getattr(tr.gemm, "own_epilogues", None)
    return own is not None and own(tr.precision.compute_dtype, tr.members > 1, largest_macs(tr.widths, batch))


def largest_macs(widths: list[int], batch: int) -> int:
    """The multiply-adds (M N K) of a step's largest GEMM: ``batch`` rows through its widest layer."""
    return batch * max(a * b for a, b in zip(widths, widths[1:], strict=False))
