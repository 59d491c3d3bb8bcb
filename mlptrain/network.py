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
        self._wgrad: _WgradStream | None = None  # see use_wgrad_stream

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

    def backward(self, dlogits: Any, output_bias_grad: Any = None, head_grad: tuple | None = None) -> None:
        """Fill every ``param.grad`` from ``dlogits (B, out)``, the loss gradient of the logits.

        ``output_bias_grad``: ``dlogits`` summed over the batch, when the loss computed it (then
        the output layer's weight-gradient GEMM runs without the BGRADB epilog).
        ``head_grad``: ``(dZ_below, db_below or None)``, the output layer's input gradient when the
        head kernel computed it (:mod:`mlptrain.head`); then that GEMM is not run.
        """
        side = self._wgrad
        if side is None:
            dz = dlogits
            for i in reversed(range(len(self.layers))):
                bias_grad = output_bias_grad if i == len(self.layers) - 1 else None
                self.layers[i].param_grads(self.execution, dz, bias_grad)
                dz = self.grad_below(i, dz, head_grad)
            return
        side.backward(self, dlogits, output_bias_grad, head_grad)

    def grad_below(self, i: int, dz: Any, head_grad: tuple | None = None) -> Any:
        """Layer ``i``'s input gradient ``dZ_{i-1}`` (None for the first layer), or the head's, given."""
        if i == len(self.layers) - 1 and head_grad is not None:
            dz_below, db_below = head_grad
            if db_below is not None:
                self.layers[i - 1].bias.grad = db_below
            return dz_below
        return self.layers[i].grad_below(self.execution, dz, self.layers[i - 1] if i > 0 else None)

    def release_step_arrays(self) -> None:
        """Drop the gradients, saved inputs and masks of the last step (their memory can go)."""
        for layer in self.layers:
            layer.weight.grad = layer.bias.grad = None
            layer.release_saved()

    def use_wgrad_stream(self, enabled: bool = True) -> None:
        """GPU: run the weight-gradient GEMMs on a second stream, concurrent with the input-gradient chain."""
        self._wgrad = _WgradStream(len(self.layers)) if enabled else None


class _WgradStream:
    """The backward pass on two CUDA streams.

    Layer ``l``'s two backward GEMMs both need only ``dZ_l``: the input gradient ``dZ_{l-1}``
    (the critical path: the layer below waits for it) and the weight gradient ``dW_l`` (nothing
    in the backward waits for it; only the optimizer does). At the small sizes where a step is
    latency-bound one GEMM fills a fraction of the GPU, so the weight gradients run on a side
    stream while the main stream goes on down the chain::

        main:  loss ─┬─ dX (layer 2, DRELU_BGRAD) ─┬─ dX (layer 1, DRELU) ── dW (layer 0) ─┬─ check, update
        side:        └─ dW (layer 2) ──────────────┴─ dW (layer 1) ─────────────────────────┘

    (With the head kernel, :mod:`mlptrain.head`, layer 2's dX is that kernel, before the first fork.)

    An event recorded on the main stream when ``dZ_l`` is ready orders the side stream's GEMM
    after it; one event at the end joins the side stream back before the optimizer. A CUDA graph
    capture records the same fork and join as edges between parallel branches.

    Memory: CuPy's pool gives each stream its own free lists. ``dZ_l`` is allocated on the main
    stream and read by the side stream, so it stays referenced until the join is enqueued;
    otherwise the main stream could reuse its memory while the side GEMM still reads it. The
    gradients the side stream allocates are read by the optimizer after the join, and the side
    stream reuses their memory only after the next step's first fork, which comes after that
    optimizer launch on the main stream.
    """

    def __init__(self, num_layers: int) -> None:
        import cupy as cp

        self.stream = cp.cuda.Stream(non_blocking=True)
        self.forks = [cp.cuda.Event(disable_timing=True) for _ in range(num_layers)]
        self.join = cp.cuda.Event(disable_timing=True)

    def backward(self, model: MLP, dlogits: Any, output_bias_grad: Any, head_grad: tuple | None) -> None:
        import cupy as cp

        main = cp.cuda.get_current_stream()
        ex, layers = model.execution, model.layers
        read_by_side = []  # the dZ_l the side stream reads: alive until the join is enqueued
        dz = dlogits
        for i in reversed(range(len(layers))):
            bias_grad = output_bias_grad if i == len(layers) - 1 else None
            if i == 0:  # the last GEMM of the backward: nothing left to overlap on the main stream
                layers[i].param_grads(ex, dz, bias_grad)
                break
            self.forks[i].record(main)  # dZ_l is ready
            self.stream.wait_event(self.forks[i])
            with self.stream:  # nvmath and CuPy enqueue (and allocate) on the current stream
                layers[i].param_grads(ex, dz, bias_grad)
            read_by_side.append(dz)
            dz = model.grad_below(i, dz, head_grad)
        self.join.record(self.stream)
        main.wait_event(self.join)  # the optimizer sees every gradient; read_by_side may go now
