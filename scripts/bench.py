"""Benchmark mlptrain's fused epilogs against the naive path, the GEMMs alone, and PyTorch.

Needs an NVIDIA GPU (CuPy + nvmath-python); PyTorch is optional (its rows are skipped when it is
not importable). One run prints one table and writes ``bench.json`` and ``bench.md`` to --out.

Sections:
  (a) one layer at the seed shape: fp16 W (65536, 16384) @ X^T (16384, 8192), bias 65536:
      forward and backward, fused vs naive vs the GEMMs alone;
  (b) a grid of layer shapes (small, medium, large batch) in fp16 and bf16;
  (c) whole training steps (forward, loss, backward, optimizer) for 784-1024-1024-10 at batch
      256, 4096 x 4 layers at batch 8192 and 8192 x 4 at batch 16384, fp16 and bf16: mlptrain
      fused, mlptrain naive and PyTorch eager (autocast with fp32 master weights, GradScaler for
      fp16), with peak GPU memory;
  (m) peak GPU memory of 4096 x 4 and 8192 x 4 steps against PyTorch eager, with mlptrain's live
      bytes by category (scripts/bench_memory.py);
  (l) the widest 4-layer MLP that trains at batch 16384 in fp16, mlptrain and PyTorch eager.

Method: random normal data; CUDA events around each call after warm-up; medians. Training steps
are timed two ways: 20 steps back to back (the steady state of a training run) and one step at a
time on an idle GPU (latency, host launch work included). Every fused
result is checked against the naive one (max |difference| / max |value|, in the tables).

Usage: python scripts/bench.py [--out DIR] [--sections abcml] [--reps N] [--quick] [--autotune]
       [--workspace-caps none,64]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import logging
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlptrain.backend import probe_gpu  # noqa: E402

SEED_SHAPE = (65536, 16384, 8192)  # (M = out features, K = in features, N = batch)
GRID = [  # (out, in, batch): small, medium and large batch
    (1024, 784, 256),
    (4096, 4096, 1024),
    (4096, 4096, 8192),
    (8192, 8192, 16384),
]
STEP_MODELS = [  # (name, widths, batch)
    ("784-1024-1024-10", [784, 1024, 1024, 10], 256),
    ("4096 x 4", [4096] * 5, 8192),
    ("8192 x 4", [8192] * 5, 16384),
]


CHAIN = 20  # steps timed back to back for the steady-state figures


def median(times):
    return statistics.median(times)


def rel_err(a, b):
    import cupy as cp

    a, b = cp.asarray(a, dtype=cp.float32), cp.asarray(b, dtype=cp.float32)
    return float(cp.abs(a - b).max() / max(float(cp.abs(b).max()), 1e-30))


def graph_ms(fn, reps):
    """GPU time of ``fn()`` in ms: run once (plans, workspaces, kernels), captured into a CUDA graph on a
    side stream, then replayed 10 at a time (median of ``reps``); host launch work does not count."""
    import cupy as cp

    from mlptrain.gpu.timing import capture_graph, cuda_time_ms

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        graph, outputs = capture_graph(fn, stream)
        t = median(cuda_time_ms(functools.partial(graph.launch, stream), warmup=2, reps=reps, chain=10))
        stream.synchronize()
    del graph, outputs
    return t


def bench_layer(m, k, n, dtype, reps, activation="relu", graphed=False):
    """Forward and backward of one ReLU (or GELU) layer: out=m, in=k, batch=n.

    The fused backward is always timed from a CUDA graph (:func:`time_layer_backward`); with
    ``graphed`` every other variant is too (else op by op, host launch work included: the
    small shapes then compare a replay with launches).
    """
    import cupy as cp

    from mlptrain.execution import FusedExecution, NaiveExecution
    from mlptrain.gpu.gemm import NvmathGemm
    from mlptrain.gpu.probe import time_layer_backward
    from mlptrain.gpu.timing import cuda_time_ms

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
    r = {"shape": [m, k, n], "dtype": str(np.dtype(dtype)) if dtype != "bfloat16" else "bfloat16"}

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
    r["fused_bwd_strategy"] = min(t, key=t.get)
    # correctness of the backward: fused (bgradb) against naive, same mask
    from mlptrain.epilogs import pack_relu_mask

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


def step_trainer(
    widths,
    batch,
    precision,
    mode="fused",
    graph=True,
    autotune=False,
    optimizer="sgd",
    bgrad="auto",
    wgrad_stream=None,
    head_kernel=True,
    workspace_mib="default",
    activation="relu",
    comm=None,
    compute_copy="kept",
):
    """A GPU Trainer for ``widths`` on random data (one batch per epoch), as the step benchmarks use it
    (``comm``: one rank of a data-parallel group; ``batch`` is then the global batch)."""
    from mlptrain.config import TrainConfig
    from mlptrain.data import Dataset
    from mlptrain.trainer import Trainer

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, widths[0]), dtype=np.float32)
    y = rng.integers(0, widths[-1], batch)
    empty_x, empty_y = np.zeros((0, widths[0]), np.float32), np.zeros(0, np.int64)
    ds = Dataset("random", x, y, empty_x, empty_y, empty_x, empty_y, num_classes=widths[-1])
    cfg = TrainConfig()
    cfg.device = type(cfg.device)("gpu")
    cfg.precision.name = type(cfg.precision.name)(precision)
    if precision in ("fp16", "bf16"):
        cfg.precision.compute_copy = type(cfg.precision.compute_copy)(compute_copy)
    cfg.execution.mode = type(cfg.execution.mode)(mode)
    cfg.execution.bgrad = type(cfg.execution.bgrad)(bgrad)
    cfg.execution.autotune = autotune
    cfg.execution.wgrad_stream = wgrad_stream
    cfg.execution.head_kernel = head_kernel
    cfg.model.hidden = widths[1:-1]
    cfg.model.activation = type(cfg.model.activation)(activation)
    cfg.data.batch_size = batch
    cfg.optimizer.name = type(cfg.optimizer.name)(optimizer)
    cfg.optimizer.schedule = type(cfg.optimizer.schedule)("constant")
    cfg.optimizer.lr = 1e-3
    cfg.progress = False
    cfg.graph = graph
    if workspace_mib != "default":  # else the configuration's default cap
        cfg.execution.workspace_mib = workspace_mib
    return Trainer(cfg, dataset=ds, comm=comm)


def bench_step_mlptrain(
    widths, batch, precision, mode, reps, graph=False, autotune=False, wgrad_stream=None, activation="relu"
):
    import gc

    import cupy as cp

    from mlptrain.gpu.timing import cuda_time_ms

    gc.collect()
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    tr = step_trainer(
        widths, batch, precision, mode, graph=graph, autotune=autotune, wgrad_stream=wgrad_stream, activation=activation
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
    import cupy as cp

    from mlptrain.gpu.timing import capture_graph, cuda_time_ms

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
    import cupy as cp

    from mlptrain.gpu.timing import cuda_time_ms

    torch.manual_seed(0)
    layers = []
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
    import cupy as cp

    from mlptrain.gpu.gemm import NvmathGemm
    from mlptrain.gpu.timing import cuda_time_ms

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


def fmt(v, nd=3):
    return "-" if v is None else f"{v:.{nd}f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-out", help="folder for bench.json and bench.md")
    ap.add_argument("--sections", default="abc", help="which sections to run (a, b, c, m, l)")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement (median reported)")
    ap.add_argument("--quick", action="store_true", help="skip the largest shapes (seed layer, 8192 x 4 step)")
    ap.add_argument("--autotune", action="store_true", help="mlptrain steps with execution.autotune=true")
    ap.add_argument("--workspace-caps", default="64,none", help="section m: execution.workspace_mib values")
    ap.add_argument(
        "--compute-copies", default="kept,cast", help="section m: precision.compute_copy values (l: mlptrain's)"
    )
    ap.add_argument(
        "--largest-range", default="32768,81920", help="section l: LO,HI, a width that trains and one that does not"
    )
    ap.add_argument("--largest-range-torch", default=None, help="section l: LO,HI for PyTorch (default: the same)")
    args = ap.parse_args(argv)
    available, reason = probe_gpu()
    if not available:
        print(f"bench.py needs an NVIDIA GPU with CuPy and nvmath-python: {reason}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    import cupy as cp
    import nvmath

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    props = cp.cuda.runtime.getDeviceProperties(0)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    stack = {
        "gpu": gpu,
        "date": datetime.date.today().isoformat(),
        "nvmath": nvmath.__version__,
        "cupy": cp.__version__,
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "driver": cp.cuda.runtime.driverGetVersion(),
        "python": platform.python_version(),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    }
    try:
        import torch

        stack["torch"] = torch.__version__
    except ImportError:
        pass
    result = {"stack": stack, "layers": [], "steps": []}
    md = [
        f"Measured {stack['date']} on {gpu}: nvmath-python {stack['nvmath']}, CuPy {stack['cupy']}, "
        f"CUDA runtime {stack['cuda_runtime']}, driver API {stack['driver']}"
        + (f", PyTorch {stack['torch']}" if "torch" in stack else "")
        + f". Command: `{stack['command']}`.",
        f"Medians of {args.reps} CUDA-event-timed runs after warm-up, random normal data.",
        "",
    ]

    layer_shapes = []
    if "a" in args.sections and not args.quick:
        layer_shapes.append((SEED_SHAPE, "float16"))
    if "b" in args.sections:
        layer_shapes += [(s, dt) for s in GRID for dt in ("float16", "bfloat16")]
    if layer_shapes:
        import ml_dtypes

        md += [
            "## One ReLU layer, forward and backward (ms)",
            "",
            "(out, in, batch): W (out, in) @ X^T (in, batch) + bias (out). Backward = weight gradient, bias "
            "gradient and the input gradient through the ReLU of the layer below. Fused backward: the faster "
            "of DRELU_BGRAD + plain wgrad and DRELU + BGRADB (both shown). err: max |fused - naive| / max |naive|.",
            "",
            "| (out, in, batch) | dtype | GEMM fwd | fused fwd | naive fwd | fused/GEMM | GEMMs bwd | fused bwd "
            "(DRELU_BGRAD / BGRADB) | naive bwd | fused/GEMMs | naive/fused bwd | err fwd, bwd |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        print(md[-3])
        for (m, k, n), dt in layer_shapes:
            dtype = np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)
            r = bench_layer(m, k, n, dtype, args.reps)
            r["dtype"] = dt
            result["layers"].append(r)
            row = (
                f"| ({m}, {k}, {n}) | {dt} | {fmt(r['gemm_fwd'])} | {fmt(r['fused_fwd'])} | {fmt(r['naive_fwd'])} "
                f"| {r['fused_fwd'] / r['gemm_fwd']:.3f}x | {fmt(r['gemm_bwd'])} | {fmt(r['fused_bwd'])} "
                f"({fmt(r['fused_bwd_drelu_bgrad'])} / {fmt(r['fused_bwd_bgradb'])}) | {fmt(r['naive_bwd'])} "
                f"| {r['fused_bwd'] / r['gemm_bwd']:.3f}x | {r['naive_bwd'] / r['fused_bwd']:.2f}x "
                f"| {r['fwd_err']:.1e}, {r['bwd_err']:.1e} |"
            )
            md.append(row)
            print(row, flush=True)
        md.append("")

    if "c" in args.sections:
        md += [
            "## Whole training steps (ms per step, peak GPU memory GiB)",
            "",
            "Forward, softmax cross-entropy, backward, SGD with momentum (fp32 master weights). fp16 with "
            "dynamic loss scaling. mlptrain peak = CuPy pool high-water mark; PyTorch = max_memory_reserved. "
            "GEMM floor: the GPU time of the step's GEMMs alone (nvmath, replayed from a CUDA graph). "
            "own GEMMs: the step's GEMMs with their epilogs, as the fused step runs them, replayed alone. "
            "fused, graph: the whole step replayed from a CUDA graph (the default on the GPU), weight "
            "gradients on a second stream concurrent with the input-gradient chain; 1 stream: the same "
            "graph with the backward on one stream (execution.wgrad_stream=false). The GEMM floor runs its "
            "GEMMs one after another; own GEMMs runs them as the step does (two streams). "
            f"Steady state: {CHAIN} steps back to back, per step (what a training run sees). Isolated: one "
            "step on an idle GPU, host launch work included (latency).",
            "",
            "| model | batch | dtype | timing | GEMM floor | own GEMMs | fused, graph | graph, 1 stream | fused "
            "| naive | PyTorch eager "
            "| graph / floor | graph / own GEMMs | PyTorch / graph | PyTorch / fused | naive / fused "
            "| peak GiB graph / fused / naive / torch | bgrad |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, widths, batch in STEP_MODELS:
            if args.quick and widths[0] == 8192:
                continue
            for precision in ("fp16", "bf16"):
                rec = bench_steps(name, widths, batch, precision, args.reps, autotune=args.autotune)
                result["steps"].append(rec)
                for row in step_rows(rec):
                    md.append(row)
                    print(row, flush=True)
        md.append("")

    if "m" in args.sections or "l" in args.sections:
        import bench_memory

        copies = args.compute_copies.split(",")
        if not set(copies) <= {"kept", "cast"}:
            ap.error(f"--compute-copies {args.compute_copies}: expected kept, cast or both, comma-separated")
        if "l" in args.sections:
            # Before section m: the trials are processes of their own, and this one's pools would hold GPU
            # memory they need (after section m, about 10 GiB); what sections a to c cached goes back first.
            bench_memory.free_device_caches()
            ranges = {"mlptrain": tuple(int(v) for v in args.largest_range.split(","))}
            ranges["torch"] = tuple(int(v) for v in (args.largest_range_torch or args.largest_range).split(","))
            result["largest"], rows = bench_memory.largest_section(ranges=ranges, copies=copies)
            largest_md = rows
        if "m" in args.sections:
            caps = [None if c == "none" else int(c) for c in args.workspace_caps.split(",")]
            result["memory"], rows = bench_memory.memory_section(args.reps, caps, copies)
            md += rows
        if "l" in args.sections:
            md += largest_md

    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
