"""The GPU GEMM engine: one planned ``nvmath.linalg.advanced.Matmul`` per call site and signature.

cuBLASLt work is split into *planning* (choose an algorithm for these shapes, dtypes, layouts
and this epilog; it blocks the host) and *execution* (enqueue the kernel; it does not). A
stateful ``Matmul`` is planned once and executed every step: when a layer's forward runs again
with a new batch of the same shape, only the operand pointers change, which
``reset_operands_unchecked`` rewrites on the descriptor in a few microseconds.

A plan is cached per call site (``layer3.wgrad``) and operand signature (shapes, strides,
dtype, epilog). A training run therefore plans each GEMM once for the full batch, once for the
last partial batch, and once for the evaluation batch size, and never again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

import cupy as cp
import nvmath
from nvmath.linalg.advanced import Algorithm, Matmul, MatmulEpilog
from nvmath.memory import MemoryPointer

from mlptrain.base.cuda.timing import capture_graph, cuda_time_ms
from mlptrain.base.cuda_source import Job
from mlptrain.nn.cuda import epilogue_kernels
from mlptrain.nn.cuda.plan_cache import PlanCache
from mlptrain.nn.cuda.streams import result_array, results_allocator
from mlptrain.nn.epilogs import Epilog

log = logging.getLogger(__name__)

_NV_EPILOG = {e: getattr(MatmulEpilog, e.value) for e in Epilog}
_OWN_EPILOGS = (Epilog.DRELU, Epilog.DRELU_BGRAD, Epilog.BGRADB)  # what epilogue_kernels can finish

# From this many multiply-adds (M N K) a single bf16 GEMM's DRELU, DRELU_BGRAD and BGRADB run as the plain GEMM and
# mlptrain's kernels by default: below it cuBLASLt's epilogue is as fast or faster in the whole step, above it
# slower (docs/benchmarks.md, "Epilogue kernels, one model": benchmarks/probes/single_epilogues.py).
OWN_EPILOGUE_MIN_MACS = 2**31


def signature(a: Any, b: Any, epilog: Epilog | None) -> tuple:
    """What a plan depends on: operand shapes, strides and dtype, and the epilog."""
    return (a.shape, a.strides, b.shape, b.strides, a.dtype.str, epilog)


class NvmathGemm:
    """GEMMs through planned nvmath ``Matmul`` objects, with cuBLASLt epilogs.

    Args:
        tf32: float32 GEMMs with TF32 tensor cores (``COMPUTE_32F_FAST_TF32``) instead of FP32.
        autotune: time the heuristics' candidate algorithms once per plan, in a CUDA graph
            (:func:`graph_autotune`), and keep the fastest.
        plan_cache: algorithms remembered from earlier runs (:class:`PlanCache`), or None.
        workspace_mib: cap on each plan's cuBLASLt workspace (nvmath's ``memory_limit``), or None for
            nvmath's default, 80% of the device memory. Every planned ``Matmul`` holds its own
            workspace, and with no cap the heuristics pick algorithms that want gigabytes (a
            DRELU_BGRAD of 8192 x 16384 in bf16: over 1 GiB), so the cap is a memory setting
            (``scripts/bench.py --sections m`` measures it).
        epilogue_kernels: where bfloat16 GEMMs' DRELU, DRELU_BGRAD and BGRADB run as the plain GEMM and
            mlptrain's kernels (:mod:`mlptrain.nn.cuda.epilogue_kernels`) instead of cuBLASLt's epilogue:
            None (``execution.epilogue_kernels``'s default) for batched GEMMs (an ensemble's, whose epilogues
            cuBLASLt runs as kernels of their own) and a single GEMM of at least :data:`OWN_EPILOGUE_MIN_MACS`
            multiply-adds (where cuBLASLt's epilogued bf16 GEMM is slower than the plain one and the kernels),
            True for every GEMM, False for none.

    Every call enqueues on CuPy's current stream (nvmath's default), so a ``with stream:`` block
    (the training step's stream, the side stream of the weight gradients) decides where a GEMM runs.
    """

    def __init__(
        self,
        *,
        tf32: bool = False,
        autotune: bool = False,
        plan_cache: PlanCache | None = None,
        workspace_mib: int | None = None,
        epilogue_kernels: bool | None = None,
    ) -> None:
        self.tf32 = tf32
        self.epilogue_kernels = epilogue_kernels
        self.workspace_mib = workspace_mib
        self.autotune = autotune
        self.plan_cache = plan_cache
        self._plans: dict[tuple, Matmul] = {}
        self.plans_from_cache = 0
        # nvmath logs every call at INFO; keep it quiet unless asked for.
        self._logger = logging.getLogger("mlptrain.nvmath")
        self._logger.setLevel(logging.WARNING)

    def _options(self, dtype: Any) -> dict[str, Any]:
        options: dict[str, Any] = {"logger": self._logger, "allocator": _WORKSPACES}
        if self.workspace_mib is not None:
            options["memory_limit"] = int(self.workspace_mib) * 2**20
        if self.tf32 and dtype == cp.float32:
            options["compute_type"] = nvmath.linalg.advanced.MatmulComputeType.COMPUTE_32F_FAST_TF32
        return options

    def __call__(
        self, key: str, a: Any, b: Any, epilog: Epilog | None = None, **epilog_inputs: Any
    ) -> tuple[Any, dict[str, Any]]:
        inputs = {name: v for name, v in epilog_inputs.items() if v is not None}
        if self._finishes(a, b, epilog, inputs):
            return self._plain_then_kernel(key, a, b, epilog, inputs)
        return self._execute(key, a, b, epilog, inputs)

    def _execute(
        self, key: str, a: Any, b: Any, epilog: Epilog | None, inputs: dict[str, Any]
    ) -> tuple[Any, dict[str, Any]]:
        """The planned Matmul of this call site and signature (planned at its first call), executed."""
        sig = (key, *signature(a, b, epilog))
        mm = self._plans.get(sig)
        if mm is None:
            mm = self._plan(key, a, b, epilog, inputs)
            self._plans[sig] = mm
        else:
            # Same shapes, strides and dtype by construction of the cache key: only the
            # pointers change, so the unchecked reset is safe and costs no validation.
            mm.reset_operands_unchecked(a=a, b=b, epilog_inputs=inputs or None)
        with _results():
            out = mm.execute()
        return out if isinstance(out, tuple) else (out, {})

    def _finishes(self, a: Any, b: Any, epilog: Epilog | None, inputs: dict[str, Any]) -> bool:
        """Whether this call's epilog runs in :mod:`~mlptrain.nn.cuda.epilogue_kernels` (see ``epilogue_kernels``):
        a DRELU, DRELU_BGRAD or BGRADB of bfloat16 operands whose layouts the kernels take."""
        if self.epilogue_kernels is False or epilog not in _OWN_EPILOGS or a.dtype.name != "bfloat16":
            return False
        if (
            self.epilogue_kernels is None
            and a.ndim != 3
            and a.shape[0] * a.shape[1] * b.shape[1] < OWN_EPILOGUE_MIN_MACS
        ):
            return False  # the default: one small GEMM keeps cuBLASLt's epilogue
        if epilog is Epilog.BGRADB:  # b (..., Kd, N) C-order: the bias gradient is its column sums
            return b.flags.c_contiguous
        aux = inputs.get("relu_aux")
        return aux is not None and a.shape[-2] % 8 == 0 and aux.ndim == a.ndim

    def _plain_then_kernel(
        self, key: str, a: Any, b: Any, epilog: Epilog | None, inputs: dict[str, Any]
    ) -> tuple[Any, dict[str, Any]]:
        """``epilog`` as the plain GEMM (its own plan: DEFAULT) and mlptrain's kernels on its result, which is
        column-major as the epilog's (nvmath lays out a GEMM without epilog as A; A is column-major here).

        DRELU(_BGRAD): ``D`` masked in place with relu_aux (and its row sums, the layer below's bias gradient);
        BGRADB: the column sums of ``b``. Bias gradients come back as nvmath's: ``(M,)``, batched ``(K, M, 1)``."""
        d, _ = self._execute(f"{key}.plain", a, b, None, {})
        # the bias gradient is a result (from the main stream's lists on the side stream); the kernels' scratch is not
        if epilog is Epilog.BGRADB:
            db = epilogue_kernels.bgradb(b, alloc=result_array)  # (N,) or (K, N)
            return d, {"bgradb": db if db.ndim == 1 else db[..., None]}
        if not epilogue_kernels.fits(d):  # not the layout the mask kernel takes: cuBLASLt's epilogue after all
            log.warning("%s: the plain GEMM's result is %s, strides %s; DRELU in cuBLASLt", key, d.shape, d.strides)
            self.epilogue_kernels = False
            return self._execute(key, a, b, epilog, inputs)
        db = epilogue_kernels.drelu(d, inputs["relu_aux"], bgrad=epilog is Epilog.DRELU_BGRAD, alloc=result_array)
        if db is None:
            return d, {}
        return d, {"drelu_bgrad": db if db.ndim == 1 else db[..., None]}

    def own_epilogues(self, dtype: Any, batched: bool, largest_macs: int) -> bool:
        """Whether a step of ``dtype`` GEMMs (``batched``: an ensemble's; the largest of ``largest_macs``
        multiply-adds) finishes some in mlptrain's epilogue kernels (see ``epilogue_kernels``)."""
        if self.epilogue_kernels is False or cp.dtype(dtype).name != "bfloat16":
            return False
        return bool(self.epilogue_kernels) or batched or largest_macs >= OWN_EPILOGUE_MIN_MACS

    def precompile_jobs(self, dtype: Any, batched: bool, largest_macs: int) -> list[Job]:
        """The mask-and-sum kernels compiled ahead (stage ``loss``: before the first backward), where a step of
        ``dtype`` GEMMs runs them (:meth:`own_epilogues`)."""
        if not self.own_epilogues(dtype, batched, largest_macs):
            return []
        return [Job("the epilogue kernels (DRELU, bias gradients)", "loss", epilogue_kernels.compile_ahead)]

    def _plan(self, key: str, a: Any, b: Any, epilog: Epilog | None, inputs: dict[str, Any]) -> Matmul:
        mm = Matmul(a, b, options=self._options(a.dtype))
        nv_epilog = _NV_EPILOG[epilog] if epilog is not None else None
        sig = signature(a, b, epilog)
        if self.workspace_mib is not None:  # the heuristics choose within the cap: another cache entry
            sig = (*sig, ("workspace_mib", int(self.workspace_mib)))
        cached = self.plan_cache.get(sig, self.tf32, self.autotune) if self.plan_cache else None
        source = "heuristics"
        if cached is not None:
            try:
                mm.plan(algorithms=[cached], epilog=nv_epilog, epilog_inputs=inputs or None)
                source = "plan cache"
                self.plans_from_cache += 1
            except Exception as exc:  # a stale entry: plan afresh
                log.warning("cached algorithm for %s was rejected (%s); planning afresh", key, exc)
                cached = None
        if cached is None:
            algorithms = mm.plan(epilog=nv_epilog, epilog_inputs=inputs or None)
            if self.autotune and len(algorithms) > 1:
                best = graph_autotune(mm, algorithms, key)
                mm.plan(algorithms=[best], epilog=nv_epilog, epilog_inputs=inputs or None)
                source = "autotune"
            if self.plan_cache is not None:
                self.plan_cache.put(sig, self.tf32, self.autotune, mm.algorithms[0])
        algo = mm.algorithms[0]
        log.info(  # (an ensemble's GEMMs are batched: (K, M, Kd) @ (K, Kd, N))
            "planned %s (%s): %s @ %s %s epilog=%s algorithm=%s tile=%s",
            key,
            source,
            tuple(a.shape),
            tuple(b.shape),
            a.dtype,
            epilog.name if epilog else "none",
            getattr(algo, "algorithm_id", "?"),
            getattr(algo, "tile", "?"),
        )
        return mm

    @property
    def num_plans(self) -> int:
        return len(self._plans)

    def workspace_bytes(self) -> int:
        """Bytes of the cuBLASLt workspaces the planned GEMMs hold (one per plan, allocated at its first execute)."""
        return sum(int(mm.workspace.allocated_size or 0) for mm in self._plans.values())

    def release_operands(self, prefix: str | None = None) -> None:
        """Let every plan (``prefix``: of the call sites whose key starts with it) forget the arrays of its
        last call (nvmath keeps ``a``, ``b`` and the epilog inputs).

        A plan holds its last operands until its next call replaces them, so without this the
        previous step's activations and masks stay alive while the next step allocates its own:
        two copies at the peak. The next call passes every operand again (``reset_operands_unchecked``
        with ``a``, ``b`` and the epilog inputs), which is what nvmath asks after a release.
        """
        for sig, mm in self._plans.items():
            if prefix is None or sig[0].startswith(prefix):
                mm.release_operands()

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


class DefaultPoolWorkspaces:
    """nvmath's memory manager for cuBLASLt workspaces: CuPy's default pool, whichever allocator is current.

    A plan allocates its workspace at its first execute, from nvmath's allocator (by default CuPy's
    current one), and keeps it until the plan is freed. The first execute of the training step's
    GEMMs is its first warm-up step, which allocates from the CUDA graph's private pool
    (:mod:`mlptrain.step.cuda.graph`): a workspace of tens of MiB carved out of the blocks of the
    step's activations splits them for good. Drawn from the default pool instead, the
    workspaces sit with the rest of the long-lived state, and the graph's pool holds the step's
    arrays only. (The result and the epilog outputs are the step's arrays: nvmath allocates them
    from CuPy's current allocator, as before.)
    """

    def __init__(self, device_id: int = 0, logger: Any = None) -> None:
        self.device_id = device_id

    def memalloc_async(self, size: int, stream: Any) -> MemoryPointer:
        # nvmath calls this inside the execution stream's context: the pool's free lists of that stream
        mem = cp.get_default_memory_pool().malloc(size)

        def finalizer() -> None:
            nonlocal mem
            del mem  # back to the pool

        return MemoryPointer(mem.ptr, size, finalizer=finalizer)


_WORKSPACES = DefaultPoolWorkspaces()


def _results() -> Any:
    """Where a GEMM's result and its epilog's outputs are allocated: on the side stream of the weight gradients,
    from the main stream's free lists (:func:`mlptrain.nn.cuda.streams.results_allocator`), else as usual."""
    results = results_allocator()
    return cp.cuda.using_allocator(results) if results is not None else contextlib.nullcontext()


def graph_autotune(mm: Matmul, algorithms: tuple, key: str, *, calls: int = 5, reps: int = 5) -> Algorithm:
    """The fastest of a planned Matmul's ``algorithms``, timed as the training step runs them.

    nvmath's ``Matmul.autotune()`` times each candidate with a host synchronisation and an L2
    flush around every run. For the microsecond GEMMs of a small MLP that measures launch
    latency, not the kernel: it can replace the heuristics' choice with one that is slower in the
    training step (docs/benchmarks.md, "Figures moved out of the code"). Here each candidate runs
    ``calls`` times back to back in a CUDA graph (GPU time only, L2 warm as in training) and the
    median of ``reps`` replays decides.
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
