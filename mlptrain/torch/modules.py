"""``FusedLinear`` and ``FusedMLP``: ``torch.nn.Module`` s whose forward and backward are mlptrain's fused GEMMs.

Their parameters are ordinary ``nn.Parameter`` s in ``nn.Linear``'s layout (weight ``(out, in)``, bias
``(out,)``), initialised as ``nn.Linear`` initialises them, so ``torch.optim``, ``GradScaler``,
``DistributedDataParallel`` and checkpoints treat them as they treat any other. A ``FusedMLP`` holds its
layers as children named ``"0"``, ``"1"``, ``"2"``, ... exactly where ``nn.Sequential(Linear, ReLU,
Linear, ...)`` holds them, so that its ``state_dict`` keys are ``0.weight``, ``0.bias``, ``2.weight``, ...
and either model loads the other's.

Under ``torch.autocast`` the layers run in the autocast dtype with the parameters cast, as
``nn.Linear`` does (the casts are ordinary differentiable ops: the gradients reach the float32
parameters in float32).

Where the gradients differ from ``nn.Sequential``'s: at a pre-activation of exactly 0 relu'(0) is 1
here (the relu_aux mask is ``Z >= 0``, cuBLASLt's and the NumPy contract's) and 0 in ``nn.ReLU``. Zero
biases and an all-zero (padding) row ``x = 0`` give ``Z = 0`` on every hidden unit: the row's gradient
reaches the hidden bias (``db0 = W1^T dy``) and the input here, and neither through ``nn.Sequential``
(docs/torch.md). There is no second-order gradient (:class:`mlptrain.torch.ops.SecondOrderError`). A
batch of no rows runs ``nn.functional.linear`` (nothing to fuse): an empty output, zero gradients.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from mlptrain.base.errors import ConfigError
from mlptrain.config.schema import BGRAD_STRATEGIES
from mlptrain.torch.ops import fused_mlp_apply

ACTIVATIONS = ("relu", "gelu", None)


class FusedLinear(nn.Module):
    """``y = act(x @ weight^T + bias)`` as one cuBLASLt GEMM with an epilog; ``nn.Linear`` when ``activation=None``.

    Args:
        in_features, out_features: as ``nn.Linear``.
        bias: learn a bias (as ``nn.Linear``). Without one, GELU runs GELU_AUX; ReLU runs RELU_AUX_BIAS on a
            bias of zeros (the NumPy contract has no RELU_AUX).
        activation: ``"relu"`` (RELU_AUX_BIAS; no_grad: RELU_BIAS), ``"gelu"`` (the tanh approximation,
            ``nn.GELU(approximate="tanh")``: GELU_AUX_BIAS / GELU_BIAS) or None (BIAS).
        device, dtype: of the parameters, as ``nn.Linear``.

    The backward of a layer's own activation has no GEMM above it to fuse into: ``dZ = dY * act'(Z)``
    is one element-wise pass here, then BGRADB gives the weight and bias gradients. Inside a
    :class:`FusedMLP` the layer above's DRELU / DGELU applies it instead.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_widths("FusedLinear", [in_features, out_features])
        _check_activation("FusedLinear", activation, ACTIVATIONS)
        self.in_features, self.out_features, self.activation = int(in_features), int(out_features), activation
        shape = (self.out_features, self.in_features)  # (out, in), nn.Linear's layout
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features, device=device, dtype=dtype))  # (out,)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation: weight Kaiming-uniform (a = sqrt 5), bias uniform in +-1/sqrt(in)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        biases = [self.bias] if self.bias is not None else []
        return run_chain(self, x, [self.weight], biases, [self.activation or "none"], "auto")

    def extra_repr(self) -> str:
        act = f", activation={self.activation!r}" if self.activation else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{act}"


class FusedMLP(nn.Module):
    """``Linear, act, Linear, act, ..., Linear`` as one fused chain: every GEMM of forward and backward with its epilog.

    Args:
        widths: ``[in, hidden..., out]``, at least two.
        activation: of the hidden layers, ``"relu"`` or ``"gelu"`` (tanh approximation).
        bias: every layer learns a bias.
        bgrad: where each hidden layer's bias gradient is reduced: ``"auto"`` (the choice mlptrain makes for
            the shape: BGRADB on the CPU and for small steps, measured on a GPU), ``"bgradb"``,
            ``"drelu_bgrad"``, or one of those per hidden layer.
        device, dtype: of the parameters.

    The forward is RELU_AUX_BIAS (GELU_AUX_BIAS) per hidden layer and BIAS for the last; the backward is
    BGRADB on the top layer's weight gradient, then per layer down DRELU (DGELU), or DRELU_BGRAD when the
    layer below takes its bias gradient from above, and a plain or BGRADB weight gradient. Under
    ``torch.no_grad()`` the hidden layers run RELU_BIAS (GELU_BIAS), which write no aux.
    """

    def __init__(
        self,
        widths: Sequence[int],
        activation: str = "relu",
        bias: bool = True,
        bgrad: str | Sequence[str] = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_widths("FusedMLP", widths)
        _check_activation("FusedMLP", activation, ("relu", "gelu"))
        self.widths, self.activation = [int(w) for w in widths], activation
        self.bgrad = _check_bgrad(bgrad, len(self.widths) - 2)
        n = len(self.widths) - 1
        for i in range(n):  # children where nn.Sequential(Linear, ReLU, Linear, ...) has them
            self.add_module(str(2 * i), FusedLinear(self.widths[i], self.widths[i + 1], bias, None, device, dtype))
            if i < n - 1:
                self.add_module(str(2 * i + 1), nn.ReLU() if activation == "relu" else nn.GELU(approximate="tanh"))

    @property
    def linears(self) -> list[FusedLinear]:
        """The layers, bottom to top (children ``"0"``, ``"2"``, ...)."""
        return [self._modules[str(2 * i)] for i in range(len(self.widths) - 1)]  # type: ignore[misc]

    def forward(self, x: Tensor) -> Tensor:
        layers = self.linears
        weights = [layer.weight for layer in layers]
        biases = [layer.bias for layer in layers if layer.bias is not None]
        acts = [self.activation] * (len(layers) - 1) + ["none"]
        return run_chain(self, x, weights, biases, acts, self.bgrad)

    def extra_repr(self) -> str:
        return f"widths={self.widths}, activation={self.activation!r}, bgrad={self.bgrad!r}"


def run_chain(module: nn.Module, x: Tensor, weights: list, biases: list, acts: list[str], bgrad: str) -> Tensor:
    """``x (*, in) -> (*, out)`` through :func:`mlptrain.torch.ops.fused_mlp_apply` (the registered operator
    under ``torch.compile``, its bodies eagerly): leading dimensions flattened into the batch, autocast's
    dtype applied, and the aux kept only when autograd will want a backward."""
    name = type(module).__name__
    if x.dim() == 0 or x.shape[-1] != weights[0].shape[1]:  # a 0-d tensor has no feature dimension
        raise ConfigError(
            f"{name} got an input of shape {tuple(x.shape)}; expected (..., {weights[0].shape[1]}), "
            f"its in_features={weights[0].shape[1]} last"
        )
    if x.device != weights[0].device:
        raise ConfigError(
            f"{name} got an input on {x.device}; expected one on {weights[0].device}, where its parameters are"
        )
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):  # as nn.Linear: everything in the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
        x, weights, biases = x.to(dtype), [W.to(dtype) for W in weights], [b.to(dtype) for b in biases]
    elif x.dtype != weights[0].dtype:
        raise ConfigError(
            f"{name} got an input of dtype {x.dtype}; expected {weights[0].dtype}, its parameters' "
            "(cast the input, or run under torch.autocast)"
        )
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # (B, in) C-order: the layout every epilog chains through
    keep = torch.is_grad_enabled() and (flat.requires_grad or any(p.requires_grad for p in weights + biases))
    if flat.shape[0] == 0:  # no rows: no GEMM to run (cuBLASLt and the contract take none); torch's ops give
        y = _empty_chain(flat, weights, biases, acts)  # the empty output and, backward, zero gradients
    else:
        y = fused_mlp_apply(flat, weights, biases, ",".join(acts), keep, bgrad)
    return y.reshape(*lead, y.shape[-1])


def _empty_chain(x: Tensor, weights: list, biases: list, acts: list[str]) -> Tensor:
    """``x (0, in) -> (0, out)`` through ``nn.Linear``'s functional form: what ``nn.Sequential`` computes on
    no rows (an empty output; backward, weight and bias gradients of zeros)."""
    bs = biases if biases else [None] * len(weights)
    fns = {"relu": torch.relu, "gelu": lambda z: nn.functional.gelu(z, approximate="tanh"), "none": lambda z: z}
    for W, b, act in zip(weights, bs, acts, strict=True):
        x = fns[act](nn.functional.linear(x, W, b))
    return x


def _check_widths(name: str, widths: Sequence[int]) -> None:
    if len(widths) < 2 or any(not isinstance(w, numbers.Integral) or isinstance(w, bool) or w < 1 for w in widths):
        raise ConfigError(f"{name} widths {list(widths)!r} are not valid; expected at least two positive integers")


def _check_activation(name: str, activation: object, allowed: tuple) -> None:
    if activation not in allowed:
        raise ConfigError(f"{name} activation {activation!r} is not known; expected one of {allowed}")


def _check_bgrad(bgrad: str | Sequence[str], hidden: int) -> str:
    """The op's ``bgrad`` string: ``"auto"``, or one strategy per hidden layer, comma-separated."""
    if bgrad == "auto":
        return "auto"
    choices = [bgrad] * hidden if isinstance(bgrad, str) else list(bgrad)
    if len(choices) != hidden or any(c not in BGRAD_STRATEGIES for c in choices):
        raise ConfigError(
            f"FusedMLP bgrad {bgrad!r} is not valid; expected 'auto', one of {BGRAD_STRATEGIES}, "
            f"or a list of those with one entry per hidden layer ({hidden})"
        )
    return ",".join(choices)
