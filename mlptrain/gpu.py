"""The GPU GEMM engine: one planned ``nvmath.linalg.advanced.Matmul`` per call site and signature.

cuBLASLt work is split into *planning* (choose an algorithm for these shapes, dtypes, layouts
and this epilog; it blocks the host) and *execution* (enqueue the kernel; it does not). A
stateful ``Matmul`` is planned once and executed every step: when a layer's forward runs again
with a new batch of the same shape, only the operand pointers change, which
``reset_operands_unchecked`` rewrites on the descriptor in a few microseconds.

A plan is cached per call site (``layer3.wgrad``) and operand signature (shapes, strides,
dtype, epilog). A training run therefore plans each GEMM once for the full batch, once for the
last partial batch, and once for the evaluation batch size, and never again.

Importing this module imports nvmath; :mod:`mlptrain.backend` only does so when a GPU is in use.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np
import nvmath
from nvmath.bindings import cublasLt
from nvmath.linalg.advanced import Algorithm, Matmul, MatmulEpilog

from mlptrain.epilogs import Epilog

log = logging.getLogger(__name__)

_NV_EPILOG = {e: getattr(MatmulEpilog, e.value) for e in Epilog}


def _signature(a: Any, b: Any, epilog: Epilog | None) -> tuple:
    return (a.shape, a.strides, b.shape, b.strides, a.dtype.str, epilog)


class PlanCache:
    """cuBLASLt algorithms chosen per GEMM signature, kept on disk so a second run plans instantly.

    One ``.npz`` per GPU model and cuBLASLt version (an algorithm is only valid there), holding
    each algorithm as the bytes of ``Algorithm.as_numpy()``, keyed by a hash of the signature
    (shapes, strides, dtype, epilog, compute type) and whether it was autotuned. Written
    atomically; an unreadable file is ignored with a warning (it is only a cache).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._algos: dict[str, np.ndarray] = {}
        if path is not None and path.is_file():
            try:
                with np.load(path, allow_pickle=False) as npz:
                    self._algos = {k: npz[k] for k in npz.files}
            except Exception as exc:  # a cache must never stop a run
                log.warning("ignoring unreadable plan cache %s (%s)", path, exc)

    @staticmethod
    def default_path() -> Path:
        from mlptrain.data import default_root

        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        gpu = "".join(c if c.isalnum() else "-" for c in name)
        return default_root() / "plans" / f"{gpu}-cublaslt{cublasLt.get_version()}.npz"

    @staticmethod
    def key(signature: tuple, tf32: bool, tuned: bool) -> str:
        text = repr((signature, tf32))
        return ("tuned-" if tuned else "heur-") + hashlib.sha256(text.encode()).hexdigest()[:32]

    def get(self, signature: tuple, tf32: bool, tuned: bool) -> Algorithm | None:
        """The cached algorithm; with ``tuned=False`` a tuned one is preferred when present."""
        for t in (True, tuned) if not tuned else (True,):
            raw = self._algos.get(self.key(signature, tf32, t))
            if raw is not None:
                return Algorithm.from_numpy(raw.view(cublasLt.matmul_heuristic_result_dtype))
        return None

    def put(self, signature: tuple, tf32: bool, tuned: bool, algorithm: Algorithm) -> None:
        self._algos[self.key(signature, tf32, tuned)] = algorithm.as_numpy().view(np.uint8)
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                np.savez(f, **self._algos)  # type: ignore[arg-type]  # numpy's stub types the kwargs badly
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not write the plan cache %s (%s)", self.path, exc)


class NvmathGemm:
    """GEMMs through planned nvmath ``Matmul`` objects, with cuBLASLt epilogs.

    Args:
        tf32: float32 GEMMs with TF32 tensor cores (``COMPUTE_32F_FAST_TF32``) instead of FP32.
        autotune: time the heuristics' candidate algorithms once per plan, in a CUDA graph
            (:func:`graph_autotune`), and keep the fastest.
        stream: the CuPy stream to enqueue on (None: the current stream at each call).
        plan_cache: algorithms remembered from earlier runs (:class:`PlanCache`), or None.
    """

    def __init__(
        self, *, tf32: bool = False, autotune: bool = False, stream: Any = None, plan_cache: PlanCache | None = None
    ) -> None:
        self.tf32 = tf32
        self.autotune = autotune
        self.stream = stream
        self.plan_cache = plan_cache
        self._plans: dict[tuple, Matmul] = {}
        self.plans_from_cache = 0
        # nvmath logs every call at INFO; keep it quiet unless asked for.
        self._logger = logging.getLogger("mlptrain.nvmath")
        self._logger.setLevel(logging.WARNING)

    def _options(self, dtype: Any) -> dict[str, Any]:
        options: dict[str, Any] = {"logger": self._logger}
        if self.tf32 and dtype == cp.float32:
            options["compute_type"] = nvmath.linalg.advanced.MatmulComputeType.COMPUTE_32F_FAST_TF32
        return options

    def __call__(
        self, key: str, a: Any, b: Any, epilog: Epilog | None = None, *, bias: Any = None, relu_aux: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        inputs = {name: v for name, v in (("bias", bias), ("relu_aux", relu_aux)) if v is not None}
        sig = (key, *_signature(a, b, epilog))
        mm = self._plans.get(sig)
        if mm is None:
            mm = self._plan(key, a, b, epilog, inputs)
            self._plans[sig] = mm
        else:
            # Same shapes, strides and dtype by construction of the cache key: only the
            # pointers change, so the unchecked reset is safe and costs no validation.
            mm.reset_operands_unchecked(a=a, b=b, epilog_inputs=inputs or None)
        out = mm.execute(stream=self.stream)
        return out if isinstance(out, tuple) else (out, {})

    def _plan(self, key: str, a: Any, b: Any, epilog: Epilog | None, inputs: dict[str, Any]) -> Matmul:
        mm = Matmul(a, b, options=self._options(a.dtype), stream=self.stream)
        nv_epilog = _NV_EPILOG[epilog] if epilog is not None else None
        sig = _signature(a, b, epilog)
        cached = self.plan_cache.get(sig, self.tf32, self.autotune) if self.plan_cache else None
        source = "heuristics"
        if cached is not None:
            try:
                mm.plan(algorithms=[cached], epilog=nv_epilog, epilog_inputs=inputs or None, stream=self.stream)
                source = "plan cache"
                self.plans_from_cache += 1
            except Exception as exc:  # a stale entry: plan afresh
                log.warning("cached algorithm for %s was rejected (%s); planning afresh", key, exc)
                cached = None
        if cached is None:
            algorithms = mm.plan(epilog=nv_epilog, epilog_inputs=inputs or None, stream=self.stream)
            if self.autotune and len(algorithms) > 1:
                best = graph_autotune(mm, algorithms, key)
                mm.plan(algorithms=[best], epilog=nv_epilog, epilog_inputs=inputs or None, stream=self.stream)
                source = "autotune"
            if self.plan_cache is not None:
                self.plan_cache.put(sig, self.tf32, self.autotune, mm.algorithms[0])
        algo = mm.algorithms[0]
        log.info(
            "planned %s (%s): (%d, %d) @ (%d, %d) %s epilog=%s algorithm=%s tile=%s",
            key,
            source,
            *a.shape,
            *b.shape,
            a.dtype,
            epilog.name if epilog else "none",
            getattr(algo, "algorithm_id", "?"),
            getattr(algo, "tile", "?"),
        )
        return mm

    @property
    def num_plans(self) -> int:
        return len(self._plans)

    def free(self) -> None:
        """Release every plan's workspace and cuBLASLt descriptors (synchronises the device)."""
        # free() waits on the event of the last execute; an execute recorded into a CUDA graph
        # left an event that cannot be waited on. Wait for the whole device instead.
        cp.cuda.Device().synchronize()
        for mm in self._plans.values():
            mm.last_compute_event = None
            mm.free()
        self._plans.clear()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.free()
        except Exception:
            pass


# --- timing and measured choices -------------------------------------------------------------


def graph_autotune(mm: Matmul, algorithms: tuple, key: str, *, calls: int = 5, reps: int = 5) -> Algorithm:
    """The fastest of a planned Matmul's ``algorithms``, timed as the training step runs them.

    nvmath's ``Matmul.autotune()`` times each candidate with a host synchronisation and an L2
    flush around every run. For the microsecond GEMMs of a small MLP that measures launch
    latency, not the kernel: on the H200 it replaced the heuristics' 10.6 us choice for the
    output layer's BGRADB weight gradient of 784-1024-1024-10 (batch 256, fp16) with one that
    runs 17.7 us in the training step. Here each candidate runs ``calls`` times back to back in a CUDA
    graph (GPU time only, L2 warm as in training) and the median of ``reps`` replays decides.
    Candidates that fail to run are skipped.
    """
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.get_current_stream().synchronize()  # one stream at a time per Matmul
    times: list[float] = []
    with stream:
        for algo in algorithms:

            def run(algo: Any = algo) -> list[Any]:
                return [mm.execute(algorithm=algo, stream=stream) for _ in range(calls)]

            try:
                mm.execute(algorithm=algo, stream=stream)  # sizes the workspace, outside the capture
                graph, outputs = capture_graph(run, stream)
                t = cuda_time_ms(functools.partial(graph.launch, stream), warmup=1, reps=reps, stream=stream)
                times.append(sorted(t)[reps // 2] / calls)
                del outputs
            except Exception as exc:  # a candidate the library cannot run here: not a choice
                log.debug("autotune %s: algorithm %s failed (%s)", key, getattr(algo, "algorithm_id", "?"), exc)
                times.append(float("inf"))
        stream.synchronize()
    mm.last_compute_event = None  # recorded during capture: not an event anyone can wait on
    best = min(range(len(algorithms)), key=times.__getitem__)
    log.info("autotune %s: %s us per candidate, chose #%d", key, [round(t * 1e3, 2) for t in times], best)
    return algorithms[best]


def cuda_time_ms(fn: Any, *, warmup: int = 3, reps: int = 10, stream: Any = None, chain: int = 1) -> list[float]:
    """Times of ``fn()`` in milliseconds per call, ``reps`` of them, each between two CUDA events.

    Runs ``warmup`` calls first (planning, workspace allocation, kernel compilation) and
    synchronises once before timing starts. Take the median of the result.

    ``chain=1`` times one call on an idle GPU: its latency, host launch work included. ``chain=N``
    times N calls back to back and divides by N: the steady state of a training loop, where the
    host queues the next step while the GPU runs this one.
    """
    stream = stream or cp.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    stream.synchronize()
    times = []
    for _ in range(reps):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(chain):
            fn()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / chain)
    return times


def time_layer_backward(ex: Any, k: int, m: int, batch: int, dtype: Any, *, reps: int = 5) -> dict[str, float]:
    """Median ms of one ReLU layer's fused backward (in=k, out=m) with each bgrad strategy.

    ``drelu_bgrad``: plain weight-gradient GEMM + DRELU_BGRAD input-gradient GEMM.
    ``bgradb``: BGRADB weight-gradient GEMM + DRELU input-gradient GEMM. Both do one reduction.
    (``scripts/bench.py`` section b; the training step chooses with :func:`choose_bgrad`.)
    """
    from mlptrain.epilogs import pack_relu_mask

    rng = cp.random.default_rng(0)
    W = rng.standard_normal((m, k), dtype=cp.float32).astype(dtype)  # (out, in)
    x = rng.standard_normal((batch, k), dtype=cp.float32).astype(dtype)  # (B, in)
    dz = rng.standard_normal((batch, m), dtype=cp.float32).astype(dtype)  # (B, out)
    mask = pack_relu_mask(rng.random((k, batch)) > 0.5)  # relu_aux of the layer below, (Mb(in), B)
    key = f"probe{k}x{m}x{batch}"
    out = {}
    stream = cp.cuda.Stream(non_blocking=True)
    for name, in_wgrad in (("drelu_bgrad", False), ("bgradb", True)):

        def backward(site: str = f"{key}.{name}", in_wgrad: bool = in_wgrad) -> tuple:
            return (
                ex.weight_grad(site, x, dz, bias_grad=in_wgrad),
                ex.input_grad(site, W, dz, mask, bias_grad_below=not in_wgrad),
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


def capture_graph(fn: Any, stream: Any) -> tuple[Any, Any]:
    """``(graph, fn's result)``: the kernels of ``fn()`` recorded, not run, on a non-default ``stream``.

    ``fn`` must have run once before (nvmath plans and allocates workspaces on its first
    execute, which must not happen during capture). Keep the result referenced while the graph
    is replayed: replays write into the arrays it holds. Cyclic garbage collection is paused
    during capture, so that no finaliser (an old nvmath plan's ``free()``) synchronises the device,
    which would invalidate the capture.
    """
    import gc

    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        stream.begin_capture()
        try:
            result = fn()
        finally:
            graph = stream.end_capture()
    finally:
        if gc_was_enabled:
            gc.enable()
    return graph, result


def choose_bgrad(
    model: Any,
    forward_backward: Any,
    key: str,
    *,
    reps: int = 9,
    store: Path | None = None,
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
    of ``reps`` chained replays, the two candidates timed in turn).

    The two strategies round differently, so a choice that changed from run to run would make
    runs irreproducible: decisions are kept in ``store`` (a JSON file beside the plan cache, per
    GPU model) under ``key`` (model, batch, dtype, streams) and later runs reuse them.
    """
    import json

    known: dict[str, list[str]] = {}
    if store is not None and store.is_file():
        try:
            known = json.loads(store.read_text())
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable bgrad choices %s (%s)", store, exc)
    choices = known.get(key)
    if isinstance(choices, list) and len(choices) == len(model.bgrad):
        return choices
    choices = list(model.bgrad)
    stream = cp.cuda.Stream(non_blocking=True)
    for i in reversed(range(len(choices))):
        graphs = {}
        with stream:
            for option in ("drelu_bgrad", "bgradb"):
                choices[i] = option
                model.set_bgrad(choices)
                forward_backward()  # plans and workspaces, outside the capture
                graphs[option] = capture_graph(forward_backward, stream)
            times: dict[str, list[float]] = {option: [] for option in graphs}
            for _ in range(reps):  # in turn, so that drifting clocks affect both alike
                for option, (graph, _) in graphs.items():
                    launch = functools.partial(graph.launch, stream)
                    times[option] += cuda_time_ms(launch, warmup=1, reps=1, stream=stream, chain=10)
        med = {option: sorted(t)[reps // 2] for option, t in times.items()}
        choices[i] = min(med, key=lambda option: med[option])
        log.info("bgrad probe, hidden layer %d: %s ms per step -> %s", i, med, choices[i])
        stream.synchronize()
        del graphs  # the graphs wrote into their results: freed only after the last replay
    # the probe's arrays go back to the device, not to the pool's cache: the training step's
    # graph allocates from its own pool, so cached blocks here would only raise the peak
    model.release_step_arrays()
    cp.get_default_memory_pool().free_all_blocks()
    model.set_bgrad(choices)
    if store is not None:
        known[key] = choices
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            tmp = store.with_name(f"{store.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, store)
        except OSError as exc:
            log.warning("could not write the bgrad choices %s (%s)", store, exc)
    return choices
