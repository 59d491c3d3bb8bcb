"""The oracle of mlptrain.torch's GEMM engine on a GPU: nvmath's stateful ``Matmul`` on torch tensors.

:class:`TorchNvmathGemm` was the library's second torch GEMM engine (``MLPTRAIN_TORCH_GEMM=nvmath``, gone):
:class:`mlptrain.torch.torch_gemm.TorchCublasLtGemm` makes the very ``cublasLtMatmul`` call nvmath makes,
with a fraction of its host time (docs/benchmarks.md), and ``tests/gpu/test_torch_gpu.py`` holds the two
equal bit for bit, GEMM by GEMM and through whole FusedMLP steps. The Epilog -> nvmath ``MatmulEpilog`` map
is the trainer's engine's (:mod:`mlptrain.nn.cuda.gemm`, which needs CuPy: the cu12 extra), not a second one.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from mlptrain.nn.epilogs import Epilog
from mlptrain.torch.torch_lt import alignment


class TorchNvmathGemm:
    """GEMMs through planned nvmath ``Matmul`` objects on torch tensors, enqueued on torch's current stream.

    Args:
        device_index: the CUDA device whose tensors this engine takes.
        workspace_mib: cap on each plan's cuBLASLt workspace (nvmath's ``memory_limit``), as the library
            engine's. None: nvmath's default, 80% of the memory.

    One ``Matmul`` is planned per call site, thread and signature (shapes, strides, dtype, epilog, pointer
    alignment, compute type) and rebound to new tensors of that signature (``reset_operands_unchecked``);
    each forgets its operands right after it ran (``release_operands``). float32 follows
    ``torch.get_float32_matmul_precision()``: ``"highest"`` is ``COMPUTE_32F``; ``"high"`` or ``"medium"``
    is TF32 (``COMPUTE_32F_FAST_TF32``), as for ``nn.Linear``. No ``choose_bgrad``: ``bgrad="auto"`` on it
    is BGRADB (:func:`mlptrain.torch.ops.resolve_bgrad`).
    """

    def __init__(self, device_index: int, workspace_mib: int | None = 64) -> None:
        self.device_index = device_index
        self.workspace_mib = workspace_mib
        self._plans: dict[tuple, Any] = {}
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
        # nvmath's rule, one thread per Matmul: the forward runs on the caller's thread, the backward on
        # autograd's thread for the device, and each gets plans of its own.
        sig: tuple = (key, threading.get_ident(), tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), a.dtype)
        sig += (epilog, tf32, *(alignment(t) for t in (a, b, *inputs.values())))
        stream = torch.cuda.current_stream(a.device)
        with self._lock:
            mm = self._plans.get(sig)
            if mm is None:
                mm = self._plans[sig] = self._plan(a, b, epilog, inputs, tf32, stream)
            else:  # same shapes, strides, dtype and alignment by construction of the key: only the pointers change
                mm.reset_operands_unchecked(a=a, b=b, epilog_inputs=inputs or None)
        out = mm.execute(stream=stream)
        mm.release_operands()  # the tensors stay alive as long as their callers hold them, not the plan
        return out if isinstance(out, tuple) else (out, {})

    def _plan(
        self, a: torch.Tensor, b: torch.Tensor, epilog: Epilog | None, inputs: dict, tf32: bool, stream: Any
    ) -> Any:
        from nvmath.linalg.advanced import Matmul

        from mlptrain.nn.cuda.gemm import _NV_EPILOG  # the one Epilog -> MatmulEpilog map

        mm = Matmul(a, b, options=self._options(a.dtype, tf32), stream=stream)
        nv_epilog = _NV_EPILOG[epilog] if epilog is not None else None
        mm.plan(epilog=nv_epilog, epilog_inputs=inputs or None, stream=stream)
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
