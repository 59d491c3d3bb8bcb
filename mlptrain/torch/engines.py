"""The two engines the fused chain (:mod:`mlptrain.torch.chain`) runs on, and which one a tensor gets.

* :class:`NumpyEngine` (CPU tensors): the tensors' own memory as NumPy arrays (``tensor.numpy()``
  views, no copy) through :class:`~mlptrain.nn.execution.NumpyGemm`, the epilog contract that the GPU
  is tested against. float16, float32 and float64 (NumPy has no bfloat16).
* :class:`TorchEngine` (CUDA tensors): torch tensors straight into planned cuBLASLt GEMMs on torch's
  current stream (:class:`~mlptrain.torch.torch_gemm.TorchCublasLtGemm`: raw cuBLASLt calls, a few
  microseconds of Python each); its element-wise fallbacks are torch operations.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from mlptrain.base.errors import DeviceError
from mlptrain.nn.epilogs import gelu_aux_shape, gelu_grad, reduce_sum, relu_aux_shape, unpack_relu_mask

CPU_DTYPES = (torch.float16, torch.float32, torch.float64)
_GELU_C = 0.7978845608028654  # sqrt(2 / pi)


class NumpyEngine:
    """The CPU engine: NumPy arrays through the epilog contract (:func:`mlptrain.nn.epilogs.matmul`)."""

    def __init__(self) -> None:
        from mlptrain.nn.execution import NumpyGemm

        self.gemm = NumpyGemm()

    def zero_bias(self, m: int, like: Any) -> Any:
        return np.zeros(m, dtype=like.dtype)

    def act_grad(self, dy: Any, aux_t: Any, m: int, activation: str) -> Any:
        if activation == "relu":
            return dy * unpack_relu_mask(aux_t.T, m).T  # (B, m): dY where Z >= 0 (relu'(0) = 1)
        return (dy.astype(np.float64) * gelu_grad(aux_t[:, :m].astype(np.float64))).astype(dy.dtype)

    def col_sum(self, x: Any) -> Any:
        return reduce_sum(x, axis=0)


class TorchEngine:
    """The GPU engine: cuBLASLt GEMMs on torch tensors (``gemm``); the element-wise fallbacks as torch operations.

    The fallbacks compute what the contract computes (:mod:`mlptrain.nn.epilogs`): the relu_aux bits
    unpacked, gelu' in float32 (float64 for float64 data), column sums in a float32 accumulator for
    half precision. They run on any device, so the CPU tests check them against the contract.
    """

    def __init__(self, gemm: Any) -> None:
        self.gemm = gemm
        self._zeros: dict[tuple, torch.Tensor] = {}

    def zero_bias(self, m: int, like: torch.Tensor) -> torch.Tensor:
        key = (m, like.dtype, like.device)
        if key not in self._zeros:  # made once: the same zeros for every call (and every CUDA graph)
            self._zeros[key] = torch.zeros(m, dtype=like.dtype, device=like.device)
        return self._zeros[key]

    def act_grad(self, dy: torch.Tensor, aux_t: torch.Tensor, m: int, activation: str) -> torch.Tensor:
        if activation == "relu":
            return dy * relu_mask(aux_t, m)
        wide = torch.float64 if dy.dtype == torch.float64 else torch.float32
        return (dy.to(wide) * gelu_grad_torch(aux_t[:, :m].to(wide))).to(dy.dtype)

    def col_sum(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        return x.sum(dim=0, dtype=wide).to(x.dtype)


def relu_mask(aux_t: torch.Tensor, m: int) -> torch.Tensor:
    """The boolean ``(B, m)`` mask ``Z >= 0`` held in ``aux_t``, the relu_aux transposed: ``(B, Mb)`` uint8,
    element ``(j, i)`` bit ``i % 8`` (LSB first) of byte ``[j, i // 8]``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=aux_t.device)
    bits = (aux_t.unsqueeze(-1) >> shifts) & 1  # (B, Mb, 8)
    return bits.reshape(aux_t.shape[0], -1)[:, :m].bool()


def gelu_grad_torch(z: torch.Tensor) -> torch.Tensor:
    """``d gelu / dz`` of the tanh approximation, as :func:`mlptrain.nn.epilogs.gelu_grad` writes it
    (``s`` the logistic function of ``2u``, no cancellation in the tails), in z's dtype."""
    u = _GELU_C * (z + 0.044715 * z**3)
    s = torch.sigmoid(2.0 * u)
    return s + 2.0 * z * s * (1.0 - s) * _GELU_C * (1.0 + 3 * 0.044715 * z * z)


def aux_shape_t(activation: str, m: int, batch: int) -> tuple[int, int]:
    """Shape of an aux as the chain keeps it, transposed: ``(B, Mb)`` for relu_aux, ``(B, Mp)`` for gelu_aux."""
    rows, _ = relu_aux_shape(m, batch) if activation == "relu" else gelu_aux_shape(m, batch)
    return batch, rows


_NUMPY = NumpyEngine()
_CUDA: dict[int, TorchEngine] = {}  # device index -> its engine and plans
_LOCK = threading.Lock()


def engine_for(x: torch.Tensor) -> NumpyEngine | TorchEngine:
    """The engine of ``x``'s device (one per CUDA device, holding its plans); DeviceError where there is none."""
    if x.device.type == "cpu":
        if x.dtype not in CPU_DTYPES:
            raise DeviceError(
                f"mlptrain.torch on the CPU runs NumPy's float16, float32 and float64; got a {x.dtype} tensor "
                "(run the module on a CUDA device for bfloat16, or under torch.autocast with dtype=torch.float16)"
            )
        return _NUMPY
    if x.device.type != "cuda":
        raise DeviceError(f"mlptrain.torch runs on CPU and CUDA tensors; got a tensor on {x.device}")
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    eng = _CUDA.get(index)
    if eng is not None:
        return eng
    with _LOCK:  # forward (main thread) and backward (autograd's device thread) may both ask first
        if index not in _CUDA:
            from mlptrain.torch.torch_gemm import TorchCublasLtGemm

            _CUDA[index] = TorchEngine(TorchCublasLtGemm(index))
        return _CUDA[index]


def to_arrays(eng: Any, tensors: list[torch.Tensor]) -> list[Any]:
    """What ``eng`` computes on: NumPy views of CPU tensors (no copy), the tensors themselves on a GPU;
    C-contiguous, the layout the chain's free transposes assume (already so, unless a compiler chose other
    strides: then one copy)."""
    tensors = [t.detach().contiguous() for t in tensors]
    return [t.numpy() for t in tensors] if isinstance(eng, NumpyEngine) else tensors


def to_tensors(eng: Any, arrays: list[Any]) -> list[torch.Tensor]:
    """The engine's results as C-contiguous tensors (NumPy's are wrapped, not copied, when they already are)."""
    if isinstance(eng, NumpyEngine):
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    return [a.contiguous() for a in arrays]
