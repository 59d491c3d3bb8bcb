"""The multilayer perceptron: a chain of :class:`~mlptrain.layers.Linear` layers.

``in -> hidden[0] -> ... -> hidden[-1] -> out``: every hidden layer is one GEMM with bias and
ReLU (fused: RELU_AUX_BIAS), the output layer one GEMM with bias (fused: BIAS). Activations flow
between layers as C-contiguous ``(B, features)`` arrays with no copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mlptrain.execution import FusedExecution, NaiveExecution
from mlptrain.layers import Linear, Param

BGRAD_STRATEGIES = ("drelu_bgrad", "bgradb")


class MLP:
    """A multilayer perceptron over an execution object.

    Args:
        widths: ``[in, hidden..., out]``, at least two entries.
        execution: fused or naive execution (decides how each GEMM is done).
        xp: the array module the parameters live in.
        rng: host Generator for the initial weights.
        param_dtype, compute_dtype: master and GEMM dtypes (equal except for fp16/bf16).
        relu: ReLU on hidden layers (False gives a deep linear model).
        init: ``"he"`` or ``"lecun"``.
        bgrad: per hidden layer, where its bias gradient is reduced (``drelu_bgrad``: by the
            input-gradient GEMM of the layer above; ``bgradb``: by its own weight-gradient GEMM);
            one string for all.
    """

    def __init__(
        self,
        widths: Sequence[int],
        *,
        execution: FusedExecution | NaiveExecution,
        xp: Any,
        rng: np.random.Generator,
        param_dtype: Any,
        compute_dtype: Any,
        relu: bool = True,
        init: str = "he",
        bgrad: str | Sequence[str] = "bgradb",
    ) -> None:
        if len(widths) < 2:
            raise ValueError(f"an MLP needs at least input and output widths; got {list(widths)}")
        self.widths = list(widths)
        self.execution = execution
        n = len(widths) - 1
        self.layers = [
            Linear(
                f"layer{i}",
                widths[i],
                widths[i + 1],
                relu=relu and i < n - 1,
                rng=rng,
                xp=xp,
                param_dtype=param_dtype,
                compute_dtype=compute_dtype,
                init=init if (relu and i < n - 1) else "lecun",
            )
            for i in range(n)
        ]
        self.set_bgrad(bgrad)

    def set_bgrad(self, bgrad: str | Sequence[str]) -> None:
        """Choose, per hidden layer, where its bias gradient is reduced (see class docstring)."""
        hidden = [layer for layer in self.layers if layer.relu]
        choices = [bgrad] * len(hidden) if isinstance(bgrad, str) else list(bgrad)
        if len(choices) != len(hidden) or any(c not in BGRAD_STRATEGIES for c in choices):
            raise ValueError(
                f"bgrad must be one of {BGRAD_STRATEGIES} or one per hidden layer ({len(hidden)}); got {bgrad!r}"
            )
        for layer, choice in zip(hidden, choices, strict=True):
            layer.bias_grad_in_wgrad = choice == "bgradb"

    @property
    def bgrad(self) -> list[str]:
        return ["bgradb" if layer.bias_grad_in_wgrad else "drelu_bgrad" for layer in self.layers if layer.relu]

    @property
    def params(self) -> list[Param]:
        return [p for layer in self.layers for p in layer.params]

    @property
    def num_params(self) -> int:
        return sum(int(p.value.size) for p in self.params)

    def forward(self, x: Any) -> Any:
        """``x (B, in) -> logits (B, out)``."""
        for layer in self.layers:
            x = layer.forward(self.execution, x)
        return x

    def backward(self, dlogits: Any, output_bias_grad: Any = None) -> None:
        """Fill every ``param.grad`` from ``dlogits (B, out)``, the loss gradient of the logits.

        ``output_bias_grad``: ``dlogits`` summed over the batch, when the loss computed it (then
        the output layer's weight-gradient GEMM runs without the BGRADB epilog).
        """
        dz = dlogits
        for i in reversed(range(len(self.layers))):
            below = self.layers[i - 1] if i > 0 else None
            bias_grad = output_bias_grad if i == len(self.layers) - 1 else None
            dz = self.layers[i].backward(self.execution, dz, below, bias_grad)
