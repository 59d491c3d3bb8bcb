"""mlptrain's fused layers inside PyTorch: ``FusedLinear`` and ``FusedMLP`` for a model of your own.

``FusedMLP([784, 1024, 1024, 10])`` is a drop-in for ``nn.Sequential(nn.Linear(784, 1024), nn.ReLU(),
nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))``: the same parameters, initialisation and
``state_dict`` keys, trained with ``torch.optim``, autocast and ``GradScaler``, ``torch.compile`` and
DDP, and every GEMM of its forward and backward one cuBLASLt call with its epilog (raw cuBLASLt calls
planned as nvmath-python plans them, on the tensors themselves and torch's current stream; on the CPU
the NumPy epilog contract). docs/torch.md.

=============== ===============================================================================
module          what it owns
=============== ===============================================================================
``modules``     the ``nn.Module`` s: parameters, initialisation, autocast, the state_dict layout
``ops``         the registered operators (``mlptrain::fused_mlp`` and its backward), fake-tensor rules,
                and the eager ``autograd.Function`` that calls the same bodies without their dispatch
``chain``       the fused forward and backward of a chain of layers, over either engine
``engines``     the NumPy engine (CPU) and the torch engine (CUDA, over mlptrain.torch.torch_gemm)
=============== ===============================================================================

Needs PyTorch (``pip install -e '.[torch]'``); ``import mlptrain`` does not.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - the CPU suite runs with torch installed
    raise ImportError(
        f"mlptrain.torch needs PyTorch, which is not importable ({exc}); install it with pip install -e '.[torch]'"
    ) from exc

from mlptrain.torch.modules import FusedLinear, FusedMLP

__all__ = ["FusedLinear", "FusedMLP"]
