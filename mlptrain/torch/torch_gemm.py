"""The GPU GEMM engines of :mod:`mlptrain.torch`, on torch tensors and torch's current stream.

* :class:`TorchCublasLtGemm` (the default, ``MLPTRAIN_TORCH_GEMM=cublaslt``): raw cuBLASLt calls planned
  once per signature (:mod:`mlptrain.torch.torch_lt`), the very call nvmath makes, with a few
  microseconds of Python per GEMM.
* :class:`TorchNvmathGemm` (``MLPTRAIN_TORCH_GEMM=nvmath``): nvmath-python's stateful ``Matmul``, which
  takes torch tensors as they are (no copy, no DLPack round trip). One ``Matmul`` is planned per call
  site (``"2.dgrad"``), thread and signature (shapes, strides, dtype, epilog, pointer alignment, compute
  type), and reused: a later call with new tensors of the same signature only rebinds the pointers
  (``reset_operands_unchecked``). Each plan forgets its operands right after it ran
  (``release_operands``), so that no activation of the last step stays alive through a plan.

Both return D and the aux outputs from torch's caching allocator, on the stream they run on, so a
``torch.cuda.graph`` capture puts them in its private pool as it does any other op's outputs, and
both give the same bits (the same algorithm on the same descriptor). :func:`choose_bgrad` is their
measured bias-gradient strategy (``bgrad="auto"``).

nvmath is imported where a plan is made, so that the engines' host-side bookkeeping imports (and is
tested) on a machine without it; this module never imports CuPy.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from mlptrain.nn.epilogs import Epilog, gelu_aux_shape, relu_aux_shape
from mlptrain.torch.torch_lt import DTYPES, PLANNED, LtPlan, alignment, gemm_spec, signature

log = logging.getLogger(__name__)


class TorchCublasLtGemm:
    """GEMMs on torch tensors through planned raw cuBLASLt calls, on torch's current stream: nvmath's results.

    Args:
        device_index: the CUDA device whose tensors this engine takes.
        workspace_mib: the cap on each plan's workspace (the heuristics' MAX_WORKSPACE_BYTES), as
            :class:`TorchNvmathGemm`'s; None: nvmath's default, 80% of the memory.

    The same interface and results as :class:`TorchNvmathGemm`: ``(D, aux)`` with D ``(M, N)``
    column-major under an epilog, the aux dict keyed ``relu_aux``, ``gelu_aux``, ``drelu_bgrad``,
    ``dgelu_bgrad``, ``bgradb``. One :class:`~mlptrain.torch.torch_lt.LtPlan` per call site, thread and
    signature (:func:`~mlptrain.torch.torch_lt.signature`: forward and backward run on different threads
    and get plans of their own); float32 follows ``torch.get_float32_matmul_precision()`` (``"high"`` /
    ``"medium"``: COMPUTE_32F_FAST_TF32). No plan holds an operand: nothing to release. Operands of two
    dtypes and the epilogs it does not plan (BGRADA) go to a :class:`TorchNvmathGemm` of its own.
    """

    def __init__(self, device_index: int, workspace_mib: int | None = 64) -> None:
        self.device_index = device_index
        self.workspace_mib = workspace_mib
        self.make_plan: Any = LtPlan  # (the CPU tests put a plan of their own here)
        self._plans: dict[tuple, Any] = {}
        # (widths, batch, dtype, activation, fp32 matmul precision) -> one strategy per hidden layer
        self.bgrad_choices: dict[tuple, list[str]] = {}
        self._lock = threading.Lock()
        self._nvmath: Any = None

    def __call__(
        self, key: str, a: torch.Tensor, b: torch.Tensor, epilog: Epilog | None = None, **epilog_inputs: Any
    ) -> tuple[Any, dict[str, Any]]:
        inputs = {name: v for name, v in epilog_inputs.items() if v is not None}
        tf32 = a.dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest"
        sig = signature(key, a, b, epilog, inputs, tf32)
        plan = self._plans.get(sig)
        if plan is None:
            if a.dtype != b.dtype or a.dtype not in DTYPES or epilog not in PLANNED:
                return self.nvmath(key, a, b, epilog, **inputs)  # what this engine does not plan
            with self._lock:  # the dict is shared by the forward's and the backward's threads
                plan = self._plans.get(sig)
                if plan is None:
                    spec = gemm_spec(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), epilog)
                    plan = self.make_plan(key, spec, a, b, epilog, inputs, tf32=tf32, cap=self._cap())
                    self._plans[sig] = plan
        return plan(a, b, inputs)

    def _cap(self) -> int:
        if self.workspace_mib is not None:
            return int(self.workspace_mib) * 2**20
        return int(0.8 * torch.cuda.get_device_properties(self.device_index).total_memory)

    def nvmath(self, key: str, a: Any, b: Any, epilog: Epilog | None = None, **inputs: Any) -> tuple[Any, dict]:
        """The nvmath engine of the same device and cap, for what this one does not plan (made at first need)."""
        if self._nvmath is None:
            self._nvmath = TorchNvmathGemm(self.device_index, self.workspace_mib)
        return self._nvmath(key, a, b, epilog, **inputs)

    @property
    def num_plans(self) -> int:
        return len(self._plans)

    def workspace_bytes(self) -> int:
        """Bytes of the plans' workspaces."""
        return sum(getattr(plan, "workspace_size", 0) for plan in self._plans.values())

    def release_operands(self, prefix: str | None = None) -> None:
        """Nothing to forget: a plan keeps pointers on its descriptor, never a tensor."""

    def free(self, prefix: str | None = None) -> None:
        """Free the plans (``prefix``: of the call sites whose key starts with it) and their workspaces.

        Synchronises the device first: a plan's workspace may still be in use by enqueued work.
        """
        torch.cuda.synchronize(self.device_index)
        with self._lock:
            for sig in [sig for sig in self._plans if prefix is None or sig[0].startswith(prefix)]:
                self._plans.pop(sig).free()
        if self._nvmath is not None:
            self._nvmath.free(prefix)

    def choose_bgrad(self, eng: Any, widths: list[int], batch: int, dtype: torch.dtype, activation: str) -> list[str]:
        """The measured bias-gradient strategy per hidden layer (``bgrad=auto``), timed on this engine's GEMMs:
        :func:`choose_bgrad`."""
        return choose_bgrad(self, eng, widths, batch, dtype, activation)


class TorchNvmathGemm:
    """GEMMs through planned nvmath ``Matmul`` objects on torch tensors, enqueued on torch's current stream.

    Args:
        device_index: the CUDA device whose tensors this engine takes.
        workspace_mib: cap on each plan's cuBLASLt workspace (nvmath's ``memory_limit``), mlptrain's default
            (``execution.workspace_mib``): every plan holds a workspace of its own, and uncapped the heuristics
            pick algorithms that want gigabytes at large shapes. None: nvmath's default, 80% of the memory.

    float32 follows ``torch.get_float32_matmul_precision()``: ``"highest"`` (PyTorch's default) is
    ``COMPUTE_32F``; ``"high"`` or ``"medium"`` is TF32 (``COMPUTE_32F_FAST_TF32``), as for ``nn.Linear``.
    """

    def __init__(self, device_index: int, workspace_mib: int | None = 64) -> None:
        self.device_index = device_index
        self.workspace_mib = workspace_mib
        self._plans: dict[tuple, Any] = {}
        # (widths, batch, dtype, activation, fp32 matmul precision) -> one strategy per hidden layer
        self.bgrad_choices: dict[tuple, list[str]] = {}
        self._lock = threading.Lock()
        # nvmath logs every call at INFO; keep it quiet unless asked for.
        self._logger = logging.getLogger("mlptrain.nvmath")
        self._logger.setLevel(logging.WARNING)

    def _options(self, dtype: torch.dtype, tf32: bool) -> dict[str, Any]:
        import nvmath

        options: dict[str, Any] = {"logger": self._logger, "device_id": self.device_index}
        if self.workspace_mib is not None:
            options["memory_limit"] = int(self.workspace_mib) * 2**20
        if tf32 and dtype == torch.float32:
            options["compute_type"] = nvmath.linalg.advanced.MatmulComputeType.COMPUTE_32F_FAST_TF32
        return options

    def __call__(
        self, key: str, a: torch.Tensor, b: torch.Tensor, epilog: Epilog | None = None, **epilog_inputs: Any
    ) -> tuple[Any, dict[str, Any]]:
        inputs = {name: v for name, v in epilog_inputs.items() if v is not None}
        tf32 = a.dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest"
        # nvmath's rule, one thread per Matmul, by construction: the forward runs on the caller's thread,
        # the backward on autograd's thread for the device, and each gets plans of its own.
        sig: tuple = (key, threading.get_ident(), tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), a.dtype)
        sig += (epilog, tf32, *(alignment(t) for t in (a, b, *inputs.values())))
        stream = torch.cuda.current_stream(a.device)
        with self._lock:  # the dict is shared by those threads
            mm = self._plans.get(sig)
            if mm is None:
                mm = self._plans[sig] = self._plan(key, a, b, epilog, inputs, tf32, stream)
            else:
                # Same shapes, strides, dtype and alignment by construction of the key: only the pointers change.
                mm.reset_operands_unchecked(a=a, b=b, epilog_inputs=inputs or None)
        out = mm.execute(stream=stream)
        mm.release_operands()  # the tensors stay alive as long as their callers hold them, not the plan
        return out if isinstance(out, tuple) else (out, {})

    def _plan(
        self, key: str, a: torch.Tensor, b: torch.Tensor, epilog: Epilog | None, inputs: dict, tf32: bool, stream: Any
    ) -> Any:
        from nvmath.linalg.advanced import Matmul, MatmulEpilog

        mm = Matmul(a, b, options=self._options(a.dtype, tf32), stream=stream)
        nv_epilog = getattr(MatmulEpilog, epilog.value) if epilog is not None else None
        mm.plan(epilog=nv_epilog, epilog_inputs=inputs or None, stream=stream)
        log.info("planned %s: %s @ %s %s epilog=%s", key, tuple(a.shape), tuple(b.shape), a.dtype, epilog)
        return mm

    @property
    def num_plans(self) -> int:
        return len(self._plans)

    def release_operands(self, prefix: str | None = None) -> None:
        """Nothing to forget: every plan released its operands when it ran."""

    def free(self, prefix: str | None = None) -> None:
        """Free the plans (``prefix``: of the call sites whose key starts with it) and their workspaces.

        Synchronises the device first: ``free()`` would wait on each plan's last event, and an execute
        recorded into a CUDA graph left one that cannot be waited on.
        """
        torch.cuda.synchronize(self.device_index)
        with self._lock:
            for sig in [sig for sig in self._plans if prefix is None or sig[0].startswith(prefix)]:
                mm = self._plans.pop(sig)
                mm.last_compute_event = None
                mm.free()

    def choose_bgrad(self, eng: Any, widths: list[int], batch: int, dtype: torch.dtype, activation: str) -> list[str]:
        """The measured bias-gradient strategy per hidden layer (``bgrad=auto``): :func:`choose_bgrad`."""
        return choose_bgrad(self, eng, widths, batch, dtype, activation)


def choose_bgrad(gemm: Any, eng: Any, widths: list[int], batch: int, dtype: torch.dtype, activation: str) -> list[str]:
    """Per hidden layer, the bias-gradient strategy that makes this shape's backward faster (``bgrad=auto``).

    Below :data:`mlptrain.step.bgrad.PROBE_MIN_FLOPS` GEMM FLOPs per step BGRADB, untimed (the trainer's
    rule). Otherwise each hidden layer ``i``'s two GEMMs are timed both ways on random tensors, once
    per shape (kept for the life of the engine): the layer above's input gradient with DRELU_BGRAD
    (DGELU_BGRAD) and a plain weight gradient, against DRELU (DGELU) and BGRADB, the median of 5
    runs of 10 calls back to back on CUDA events. While a CUDA graph is being captured nothing can
    be timed: BGRADB, with a warning.
    """
    key = (tuple(widths), batch, dtype, activation, torch.get_float32_matmul_precision())
    hidden = len(widths) - 2
    if key in gemm.bgrad_choices:
        return gemm.bgrad_choices[key]
    from mlptrain.step.bgrad import PROBE_MIN_FLOPS  # the trainer's rule: a step of microseconds is launch-bound
    from mlptrain.step.build import step_flops

    if step_flops(widths, batch) < PROBE_MIN_FLOPS:
        return ["bgradb"] * hidden
    if torch.cuda.is_current_stream_capturing():
        log.warning("bgrad=auto for %s batch %d: no timing during a capture; using bgradb", widths, batch)
        return ["bgradb"] * hidden
    choices = [_faster_strategy(eng, widths[i : i + 3], batch, dtype, activation) for i in range(hidden)]
    log.info("bgrad=auto for %s batch %d %s: %s", widths, batch, dtype, choices)
    gemm.bgrad_choices[key] = choices
    return choices


def _faster_strategy(eng: Any, widths: list[int], batch: int, dtype: torch.dtype, activation: str) -> str:
    """``"drelu_bgrad"`` or ``"bgradb"`` for the hidden layer of ``widths = [in, out, out_above]``."""
    from mlptrain.nn.execution import FusedExecution

    k, m, above = widths
    if above == 1:  # K = 1 above: the chain's element-wise fallback, no DRELU_BGRAD to time against
        return "bgradb"
    device = torch.device("cuda", eng.gemm.device_index)
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape: torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)
    W, h, dz, dz_above = rand(above, m), rand(batch, k), rand(batch, m), rand(batch, above)
    if activation == "relu":
        mb, _ = relu_aux_shape(m, batch)  # (Mb, B) column-major, as the forward writes it
        mask = torch.randint(0, 256, (batch, mb), generator=g, device=device, dtype=torch.uint8).T
    else:
        mp, _ = gelu_aux_shape(m, batch)  # (Mp, B) column-major
        mask = rand(batch, mp).T
    ex = FusedExecution(eng.gemm)
    times = {}
    for name, in_wgrad in (("drelu_bgrad", False), ("bgradb", True)):

        def backward(in_wgrad: bool = in_wgrad) -> None:
            ex.input_grad("probe.dgrad", W, dz_above, mask, bias_grad_below=not in_wgrad, activation_below=activation)
            ex.weight_grad("probe.wgrad", h, dz, bias_grad=in_wgrad)

        for _ in range(3):  # plans and workspaces
            backward()
        runs = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                backward()
            end.record()
            end.synchronize()  # syncs the host: the probe runs once per shape, before training
            runs.append(start.elapsed_time(end) / 10)
        times[name] = sorted(runs)[2]
    eng.gemm.free("probe.")  # the strategy not chosen has plans (and workspaces) of its own
    return min(times, key=times.__getitem__)
