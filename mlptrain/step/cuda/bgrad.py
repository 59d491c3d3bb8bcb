"""Measured choices: where each hidden layer's bias gradient is reduced (``execution.bgrad=auto``).

Both strategies are exact; which is faster depends on the shapes and on how the backward is
scheduled, so the probe times the model's own forward-backward both ways, replayed from CUDA
graphs, and remembers the choice per GPU model so that later runs are reproducible.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np

from mlptrain.base.cuda.timing import capture_graph, cuda_time_ms
from mlptrain.base.fs import atomic_write
from mlptrain.config.schema import BGRAD_STRATEGIES
from mlptrain.nn.epilogs import pack_relu_mask

log = logging.getLogger(__name__)


def choose_bgrad(
    model: Any,
    forward_backward: Any,
    key: str,
    *,
    reps: int = 9,
    store: Path | None = None,
    release: Any = lambda: None,
    on_pool: Any = lambda nbytes: None,
) -> list[str]:
    """Per hidden layer, the bias-gradient strategy that makes the model's step faster.

    Hidden layer ``i`` has its bias gradient reduced either by the layer above (DRELU_BGRAD in
    that layer's input-gradient GEMM, or the head kernel's column sums for the top hidden
    layer) or by its own weight-gradient GEMM (BGRADB). Which is faster depends on more than
    the layer: with the weight gradients on a second stream a BGRADB reduction may hide behind
    the input-gradient chain, except for the first layer, whose weight gradient ends the chain;
    and cuBLASLt runs DRELU_BGRAD as one fused kernel at some shapes and as a GEMM plus a
    separate epilogue kernel at others. So the probe times the thing itself:
    ``forward_backward()`` (forward, loss and backward of the training step, no update) captured
    into a CUDA graph with each choice, layer by layer from the top, keeping the faster (median
    of ``reps`` chained replays; one candidate's graph at a time, never two graphs' arrays at once).

    Memory: each candidate's passes allocate from a private pool of their own, as the training
    step's graph does (:mod:`mlptrain.step.cuda.graph`), emptied once the candidate is timed: the
    probe's arrays never sit in the default pool's cache beside the state, and the probe peaks
    where the step does. ``on_pool(nbytes)`` is told that pool's size after each capture (the
    trainer's :class:`~mlptrain.step.cuda.memory.PeakTracker` counts it).

    The two strategies round differently, so a choice that changed from run to run would make
    runs irreproducible: decisions are kept in ``store`` (a JSON file beside the plan cache, per
    GPU model) under ``key`` (model, batch, dtype, streams) and later runs reuse them.

    ``release()`` runs before every uncaptured pass and every capture: it drops the last pass's
    arrays (:meth:`mlptrain.step.trainer.Trainer.release_step`), so that the probe, like the training
    step, never holds two copies of them.
    """
    known = _read(store)
    choices = remembered(store, key, len(model.bgrad), known)
    if choices is not None:
        return choices
    choices = list(model.bgrad)
    stream = cp.cuda.Stream(non_blocking=True)
    timed: dict[tuple[str, ...], list[float]] = {}  # each whole-model choice timed once
    for i in reversed(range(len(choices))):
        times: dict[str, list[float]] = {}
        for option in BGRAD_STRATEGIES:
            choices[i] = option
            # Layer i's first option with the layers above as chosen is often the very model the layer above
            # was last timed as (an L-hidden-layer model: L + 1 captures, not 2L, on a first run).
            if tuple(choices) not in timed:
                model.set_bgrad(choices)
                timed[tuple(choices)] = _time_candidate(forward_backward, stream, reps, release, on_pool)
            times[option] = timed[tuple(choices)]
        med = {option: sorted(t)[reps // 2] for option, t in times.items()}
        choices[i] = min(med, key=lambda option: med[option])
        log.info("bgrad probe, hidden layer %d: %s ms per step -> %s", i, med, choices[i])
    # The caller frees what the probe allocated (mlptrain.step.bgrad.choose: the
    # step's arrays, the plans and their workspaces, the pool's cached blocks).
    model.set_bgrad(choices)
    if store is not None:
        known[key] = choices
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(store, json.dumps(known, indent=1, sort_keys=True) + "\n")
        except OSError as exc:
            log.warning("could not write the bgrad choices %s (%s)", store, exc)
    return choices


def remembered(store: Path | None, key: str, layers: int, known: dict | None = None) -> list[str] | None:
    """The choice ``store`` keeps for ``key`` (one strategy per hidden layer, ``layers`` of them), or None."""
    choices = (_read(store) if known is None else known).get(key)
    if not isinstance(choices, list) or len(choices) != layers:
        return None
    return [str(c) for c in choices] if all(c in BGRAD_STRATEGIES for c in choices) else None


def _read(store: Path | None) -> dict[str, Any]:
    """The choices kept in ``store`` (none: an empty dict; unreadable: a warning, then an empty dict)."""
    if store is None or not store.is_file():
        return {}
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable bgrad choices %s (%s)", store, exc)
        return {}
    if not isinstance(known, dict):
        log.warning("ignoring bgrad choices %s: a JSON object was expected, not %s", store, type(known).__name__)
        return {}
    return known


def _time_candidate(forward_backward: Any, stream: Any, reps: int, release: Any, on_pool: Any) -> list[float]:
    """``reps`` chained replay times (ms) of ``forward_backward`` captured as the model is set now.

    One graph alive at a time: two would hold two copies of the step's arrays, and the probe's
    peak would be the run's (the largest model that trains would shrink by it)."""
    pool = cp.cuda.MemoryPool()  # this candidate's arrays, apart from the long-lived state
    with stream:
        with cp.cuda.using_allocator(pool.malloc):
            release()
            forward_backward()  # plans and workspaces (default pool), outside the capture
            release()
            graph, outputs = capture_graph(forward_backward, stream)
        on_pool(pool.total_bytes())
        launch = functools.partial(graph.launch, stream)
        times = cuda_time_ms(launch, warmup=1, reps=reps, stream=stream, chain=10)
        stream.synchronize()
        del graph, outputs, launch  # the graph wrote into its results: freed only after the last replay
        release()
        gc.collect()  # a captured graph and its outputs may sit in a reference cycle: free them now
        pool.free_all_blocks()  # back to the device: the next candidate starts from nothing
    return times


def random_batch(
    rows: int, widths: list[int], dtype: Any, y_dtype: Any, y_tail: tuple = (), out: Any = None
) -> list[Any]:
    """``[x (rows, widths[0]), y]``: random inputs in ``dtype`` and targets as the loader gives them
    (labels ``(rows,)`` for integer ``y_dtype``, else normals ``(rows, *y_tail)``), for the probe.

    Drawn on the host (NumPy, ml_dtypes' bfloat16) and copied: no kernel of CuPy's random module
    or of a cast compiles for them, which on a first run (an empty kernel cache) cost the probe a
    quarter of a second. Written into ``out`` (the CUDA graph's input buffers, which the training
    step holds anyway) where given and of these dtypes and shapes, so that the probe holds no batch
    of its own. Synchronises: the probe runs on a stream of its own.
    """
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, widths[0]), dtype=np.float32).astype(dtype)  # (B, in)
    if np.dtype(y_dtype).kind in "iu":
        y = rng.integers(0, widths[-1], rows).astype(y_dtype)  # (B,) labels
    else:  # a regression's targets, (B, T)
        y = rng.standard_normal((rows, *y_tail), dtype=np.float32).astype(y_dtype)
    fits = out is not None and all(o.dtype == a.dtype and o.shape == a.shape for o, a in zip(out, (x, y), strict=True))
    if fits:
        out[0].set(x)  # host to device into the buffers themselves (contiguous, as the loader makes them)
        out[1].set(y)
        batch = list(out)
    else:
        batch = [cp.asarray(x), cp.asarray(y)]
    cp.cuda.get_current_stream().synchronize()
    return batch


def time_layer_backward(
    ex: Any, k: int, m: int, batch: int, dtype: Any, *, reps: int = 5, activation: str = "relu"
) -> dict[str, float]:
    """Median ms of one layer's fused backward (in=k, out=m) with each bgrad strategy, through the
    ``activation`` (relu or gelu) of the layer below.

    ``drelu_bgrad``: plain weight-gradient GEMM + DRELU_BGRAD (DGELU_BGRAD) input-gradient GEMM.
    ``bgradb``: BGRADB weight-gradient GEMM + DRELU (DGELU) input-gradient GEMM. Both do one reduction.
    (``scripts/bench.py`` section b; the training step chooses with :func:`choose_bgrad`.)
    """
    rng = cp.random.default_rng(0)
    W = rng.standard_normal((m, k), dtype=cp.float32).astype(dtype)  # (out, in)
    x = rng.standard_normal((batch, k), dtype=cp.float32).astype(dtype)  # (B, in)
    dz = rng.standard_normal((batch, m), dtype=cp.float32).astype(dtype)  # (B, out)
    if activation == "gelu":  # gelu_aux of the layer below: its pre-activation, (round_up(in, 8), B) column-major
        mask = cp.asfortranarray(rng.standard_normal((k + (-k) % 8, batch), dtype=cp.float32).astype(dtype))
    else:  # relu_aux of the layer below, (Mb(in), B)
        mask = pack_relu_mask(rng.random((k, batch)) > 0.5)
    key = f"probe{k}x{m}x{batch}{activation}"
    out = {}
    stream = cp.cuda.Stream(non_blocking=True)
    for name, in_wgrad in (("drelu_bgrad", False), ("bgradb", True)):

        def backward(site: str = f"{key}.{name}", in_wgrad: bool = in_wgrad) -> tuple:
            return (
                ex.weight_grad(site, x, dz, bias_grad=in_wgrad),
                ex.input_grad(site, W, dz, mask, bias_grad_below=not in_wgrad, activation_below=activation),
            )

        with stream:
            backward()  # plans and workspaces, outside the capture
            # GPU time only: replayed from a CUDA graph, as the training step runs. Timed op by op,
            # a small layer's host launch work would decide the choice.
            graph, outputs = capture_graph(backward, stream)
            t = cuda_time_ms(functools.partial(graph.launch, stream), warmup=2, reps=reps, chain=10)
            out[name] = sorted(t)[reps // 2]
            del outputs  # the graph wrote into these: freed only after its last replay
    return out
