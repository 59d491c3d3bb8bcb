"""Whole training steps: mlptrain fused (graph, one stream, eager), naive, the GEMM floor, the step's own
GEMMs, and PyTorch eager (``scripts/bench.py`` section c)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from mlptrain.base.backend import get_backend
from mlptrain.tools.bench.medians import CHAIN, fmt, median
from mlptrain.tools.bench.step_trainer import step_trainer

STEP_MODELS = [  # (name, widths, batch)
    ("784-1024-1024-10", [784, 1024, 1024, 10], 256),
    ("4096 x 4", [4096] * 5, 8192),
    ("8192 x 4", [8192] * 5, 16384),
]


def bench_step_mlptrain(
    widths,
    batch,
    precision,
    mode,
    reps,
    graph=False,
    autotune=False,
    wgrad_stream=None,
    activation="relu",
    compute_copy=None,
):
    import gc

    cp = get_backend("gpu").xp

    from mlptrain.base.cuda.timing import cuda_time_ms

    gc.collect()
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    tr = step_trainer(
        widths,
        batch,
        precision,
        mode,
        graph=graph,
        autotune=autotune,
        wgrad_stream=wgrad_stream,
        activation=activation,
        compute_copy=compute_copy,
    )
    losses = []
    with tr.stream:  # the stream a training run uses (graph capture needs a non-default one)
        # as the training loop does: gathered straight into the graph's input buffers (no copy in the step)
        xb, yb = next(iter(tr.train_loader.epoch(0, out=tr.batch_buffers)))
        times = cuda_time_ms(lambda: losses.append(tr.step(xb, yb)[0]), warmup=5, reps=reps)
        chained = cuda_time_ms(lambda: tr.step(xb, yb), warmup=1, reps=reps, chain=CHAIN)
        tr.memory_peak.sample("steps")  # the pools' high-water mark, the bgrad probe's included
        peak = tr.memory_peak.peak
        own_gemms = own_gemm_time(tr, xb, yb, reps) if graph else None  # after the peak: it allocates
    first_losses = [float(v) for v in losses[:3]]
    bgrad = tr.model.bgrad
    pool.free_all_blocks()
    return {
        "ms": median(chained),
        "ms_isolated": median(times),
        "own_gemms": own_gemms,
        "peak_gib": peak / 2**30,
        "losses": first_losses,
        "bgrad": bgrad,
    }


def own_gemm_time(tr, xb, yb, reps):
    """GPU time of the step's own GEMMs (with their epilogs), forward and backward, replayed from a graph.

    The same calls as the training step makes (``model.forward``, ``model.backward``), with the
    loss, the overflow check and the optimizer left out: what the step costs beyond its GEMMs is
    the rest. Returns ``{"ms": steady, "ms_isolated": one replay}``.
    """
    cp = get_backend("gpu").xp

    from mlptrain.base.cuda.timing import capture_graph, cuda_time_ms

    stream = cp.cuda.get_current_stream()
    # what the output head computes (the loss, and for small heads the head kernel): not GEMMs of the step
    _, _, dlogits, head = tr.head.grads(tr.model, tr.model.forward(xb), yb, tr.scaler.scale)

    def gemms():
        tr.model.forward(xb)
        tr.model.backward(dlogits, dataclasses.replace(head))  # the backward takes head.input_grad: a copy
        return [p.grad for p in tr.model.params]

    gemms()
    graph, keep = capture_graph(gemms, stream)
    launch = functools.partial(graph.launch, stream)
    result = {
        "ms": median(cuda_time_ms(launch, reps=reps, chain=CHAIN)),
        "ms_isolated": median(cuda_time_ms(launch, reps=reps)),
    }
    del keep
    return result


def bench_step_torch(widths, batch, precision, reps, activation="relu", compile=False):
    """PyTorch's step: autocast with fp32 master weights, SGD momentum, GradScaler for fp16; eager,
    or ``torch.compile`` d (default mode) with ``compile``. GELU as ``nn.GELU(approximate="tanh")``."""
    try:
        import torch
    except ImportError:
        return None
    cp = get_backend("gpu").xp

    from mlptrain.base.cuda.timing import cuda_time_ms

    torch.manual_seed(0)
    layers: list[Any] = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.GELU(approximate="tanh") if activation == "gelu" else torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).cuda()  # fp32 master weights
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    x = torch.randn(batch, widths[0], device="cuda")
    y = torch.randint(0, widths[-1], (batch,), device="cuda")
    loss_fn = torch.nn.CrossEntropyLoss()

    forward = torch.compile(model) if compile else model

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype):
            loss = loss_fn(forward(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    torch.cuda.reset_peak_memory_stats()
    # Time on torch's current stream, with CuPy events on the same stream.
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    times = cuda_time_ms(step, warmup=5, reps=reps, stream=stream)
    chained = cuda_time_ms(step, warmup=1, reps=reps, stream=stream, chain=CHAIN)
    peak = torch.cuda.max_memory_reserved() / 2**30
    torch.cuda.empty_cache()
    return {"ms": median(chained), "ms_isolated": median(times), "peak_gib": peak, "version": torch.__version__}


def step_gemm_floor(widths, batch, dtype, reps):
    """GPU time of the step's GEMMs alone: forward and weight gradient per layer, input gradient
    for all but the first layer."""
    cp = get_backend("gpu").xp

    from mlptrain.base.cuda.timing import cuda_time_ms
    from mlptrain.nn.cuda.gemm import NvmathGemm

    rng = cp.random.default_rng(2)
    gemm = NvmathGemm()
    ops = []
    for i in range(len(widths) - 1):
        k, m = widths[i], widths[i + 1]
        W = rng.standard_normal((m, k), dtype=cp.float32).astype(dtype)
        x = rng.standard_normal((batch, k), dtype=cp.float32).astype(dtype)
        dz = rng.standard_normal((batch, m), dtype=cp.float32).astype(dtype)
        ops.append((f"l{i}.fwd", W, x.T))
        ops.append((f"l{i}.wgrad", x.T, dz))
        if i > 0:
            ops.append((f"l{i}.dgrad", W.T, dz.T))

    def run():
        return [gemm(key, a, b) for key, a, b in ops]

    # Replayed from a CUDA graph, so that host overhead does not count: the GPU time of the GEMMs.
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        run()  # plan and allocate workspaces outside the capture
        stream.begin_capture()
        outputs = run()  # noqa: F841 - the graph writes into these: keep them alive
        graph = stream.end_capture()
        t = median(cuda_time_ms(lambda: graph.launch(stream), reps=reps))
        chained = median(cuda_time_ms(lambda: graph.launch(stream), reps=reps, chain=CHAIN))
    gemm.free()
    return {"ms": chained, "ms_isolated": t}


def bench_steps(name, widths, batch, precision, reps, autotune=False):
    """Every variant of one model's training step (see section (c) of the module docstring)."""
    import ml_dtypes

    dtype = np.float16 if precision == "fp16" else np.dtype(ml_dtypes.bfloat16)
    return {
        "model": name,
        "widths": widths,
        "batch": batch,
        "precision": precision,
        "gemm_floor": step_gemm_floor(widths, batch, dtype, reps),
        "autotune": autotune,
        "fused_graph": bench_step_mlptrain(widths, batch, precision, "fused", reps, graph=True, autotune=autotune),
        "fused_graph_1stream": bench_step_mlptrain(
            widths, batch, precision, "fused", reps, graph=True, autotune=autotune, wgrad_stream=False
        ),
        "fused": bench_step_mlptrain(widths, batch, precision, "fused", reps, autotune=autotune),
        "naive": bench_step_mlptrain(widths, batch, precision, "naive", reps, autotune=autotune),
        "torch": bench_step_torch(widths, batch, precision, reps),
    }


def step_rows(rec):
    """Two table rows of one model and dtype: steady state, then isolated steps."""
    g, f, nv, t, floor = (rec[k] for k in ("fused_graph", "fused", "naive", "torch", "gemm_floor"))
    g1 = rec.get("fused_graph_1stream")  # absent in records from before the two-stream backward
    rows = []
    for label, key in (("steady", "ms"), ("isolated", "ms_isolated")):
        tt = t[key] if t else None
        peak = (
            f"{g['peak_gib']:.2f} / {f['peak_gib']:.2f} / {nv['peak_gib']:.2f} / {fmt(t['peak_gib'] if t else None, 2)}"
        )
        own = g["own_gemms"][key]
        rows.append(
            f"| {rec['model']} | {rec['batch']} | {rec['precision']} | {label} | {fmt(floor[key])} | {fmt(own)} "
            f"| {fmt(g[key])} | {fmt(g1[key] if g1 else None)} | {fmt(f[key])} | {fmt(nv[key])} | {fmt(tt)} "
            f"| {g[key] / floor[key]:.2f}x "
            f"| {g[key] / own:.2f}x "
            f"| {f'{tt / g[key]:.2f}x' if tt else '-'} | {f'{tt / f[key]:.2f}x' if tt else '-'} "
            f"| {nv[key] / f[key]:.2f}x | {peak} | {','.join(f['bgrad'])} |"
        )
    return rows
