"""The GPU GEMM engine of :mod:`mlptrain.torch`, on torch tensors and torch's current stream.

:class:`TorchCublasLtGemm`: raw cuBLASLt calls planned once per signature (:mod:`mlptrain.torch.torch_lt`),
the very call nvmath's stateful ``Matmul`` makes, with a few microseconds of Python per GEMM (an nvmath
``Matmul`` call costs about five times a ``torch.matmul``'s host time: docs/benchmarks.md). It returns D
and the aux outputs from torch's caching allocator, on the stream it runs on, so a ``torch.cuda.graph``
capture puts them in its private pool as it does any other op's outputs. :func:`choose_bgrad` is its
measured bias-gradient strategy (``bgrad="auto"``).

The GPU tests hold it bit for bit to nvmath's ``Matmul`` on the same tensors (the oracle,
``tests/gpu/torch_nvmath_oracle.py``). This module imports neither CuPy nor nvmath (the cuBLASLt
bindings are :mod:`~mlptrain.torch.torch_lt`'s, imported where it is).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from mlptrain.nn.epilogs import Epilog, gelu_aux_shape, relu_aux_shape
from mlptrain.torch.torch_lt import DTYPES, PLANNED, LtPlan, gemm_spec, signature

log = logging.getLogger(__name__)


class TorchCublasLtGemm:
    """GEMMs on torch tensors through planned raw cuBLASLt calls, on torch's current stream: nvmath's results.

    Args:
        device_index: the CUDA device whose tensors this engine takes.
        workspace_mib: the cap on each plan's workspace (the heuristics' MAX_WORKSPACE_BYTES), mlptrain's
            default (``execution.workspace_mib``): uncapped, the heuristics pick algorithms that want
            gigabytes at large shapes. None: nvmath's default, 80% of the memory.

    The interface and results of nvmath's ``Matmul``: ``(D, aux)`` with D ``(M, N)``
    column-major under an epilog, the aux dict keyed ``relu_aux``, ``gelu_aux``, ``drelu_bgrad``,
    ``dgelu_bgrad``, ``bgradb``. One :class:`~mlptrain.torch.torch_lt.LtPlan` per call site, thread and
    signature (:func:`~mlptrain.torch.torch_lt.signature`: forward and backward run on different threads
    and get plans of their own); float32 follows ``torch.get_float32_matmul_precision()`` (``"high"`` /
    ``"medium"``: COMPUTE_32F_FAST_TF32). No plan holds an operand: nothing to release. Operands of two
    dtypes and the epilogs it does not plan (BGRADA), which the chain never runs, raise ValueError.
    """

    def __init__(self, device_index: int, workspace_mib: int | None = 64) -> None:
        self.device_index = device_index
        self.workspace_mib = workspace_mib
        self.make_plan: Any = LtPlan  # (the CPU tests put a plan of their own here)
        self._plans: dict[tuple, Any] = {}
        # (widths, batch, dtype, activation, fp32 matmul precision) -> one strategy per hidden layer
        self.bgrad_choices: dict[tuple, list[str]] = {}
        self._lock = threading.Lock()

    def __call__(
        self, key: str, a: torch.Tensor, b: torch.Tensor, epilog: Epilog | None = None, **epilog_inputs: Any
    ) -> tuple[Any, dict[str, Any]]:
        inputs = {name: v for name, v in epilog_inputs.items() if v is not None}
        tf32 = a.dtype is torch.float32 and torch.get_float32_matmul_precision() != "highest"
        sig = signature(key, a, b, epilog, inputs, tf32)
        plan = self._plans.get(sig)
        if plan is None:
            if a.dtype != b.dtype or a.dtype not in DTYPES or epilog not in PLANNED:
                raise ValueError(
                    f"TorchCublasLtGemm plans A and B of one dtype among {DTYPES} with an epilog among {PLANNED}; "
                    f"got {a.dtype} @ {b.dtype} with epilog {epilog} at call site {key!r}"
                )
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

    def choose_bgrad(self, eng: Any, widths: list[int], batch: int, dtype: torch.dtype, activation: str) -> list[str]:
        """The measured bias-gradient strategy per hidden layer (``bgrad=auto``), timed on this engine's GEMMs:
        :func:`choose_bgrad`."""
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
