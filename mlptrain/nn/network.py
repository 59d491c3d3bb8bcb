"""The multilayer perceptron: a chain of :class:`~mlptrain.nn.layers.Linear` layers.

``in -> hidden[0] -> ... -> hidden[-1] -> out``: every hidden layer is one GEMM with bias and the
model's activation (``model.activation``: ReLU by default, fused RELU_AUX_BIAS; GELU, fused
GELU_AUX_BIAS; or none, a deep linear model, BIAS), the output layer one GEMM with bias (fused:
BIAS). Activations flow between layers as C-contiguous ``(B, features)`` arrays with no copies.

The backward pass starts from the gradient of the logits that the output head computed
(:class:`mlptrain.nn.head.OutputHead`), together with whatever else of the output layer's backward
the head already did (:class:`HeadGrads`; in head mode ``kernel``, the output layer's DRELU_BGRAD
GEMM done by ``nn/cuda/head.py``'s kernel): :meth:`MLP.backward` computes the rest, layer by layer
from the top, with the two GEMMs of :class:`~mlptrain.nn.layers.Linear` (its docstring has the math).
How they are scheduled, what is freed when and, on the GPU, the weight gradients on a second stream
(:mod:`mlptrain.nn.cuda.streams`), is in the helpers after it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlptrain.config.schema import BGRAD_STRATEGIES, COMPUTE_COPIES, Init
from mlptrain.nn.embedding import ColumnEmbedding
from mlptrain.nn.epilogs_fp8 import FP8_MULTIPLE
from mlptrain.nn.execution import FusedExecution, NaiveExecution
from mlptrain.nn.layers import CastBuffer, Linear, Param


@dataclass
class HeadGrads:
    """What the output head computed of the output layer's backward, beyond ``dlogits``.

    Attributes:
        bias_grad: ``dlogits`` summed over the batch (``(out,)``): the output layer's bias gradient,
            when the loss kernel reduced it (then the weight-gradient GEMM runs without BGRADB).
        input_grad: ``dZ_below (B, H)``, the output layer's input gradient with the ReLU derivative
            of the layer below applied, when the head kernel computed it (then that GEMM is not run).
        input_bias_grad: ``input_grad`` summed over the batch: the layer below's bias gradient, when
            that layer takes it from above (``drelu_bgrad``) and the head kernel reduced it.
    """

    bias_grad: Any = None
    input_grad: Any = None
    input_bias_grad: Any = None


class MLP:
    """A multilayer perceptron over an execution object.

    Args:
        widths: ``[in, hidden..., out]``, at least two entries.
        execution: fused or naive execution (decides how each GEMM is done).
        xp: the array module the parameters live in.
        rng: host Generator for the initial weights.
        param_dtype, compute_dtype: master and GEMM dtypes (equal except for fp16/bf16).
        activation: of the hidden layers: ``"relu"``, ``"gelu"`` or ``"none"`` (a deep linear model).
        init: ``"he"``, ``"lecun"`` (the output layer: LeCun either way), or ``"torch"`` (every layer as
            PyTorch's ``nn.Linear`` starts, biases included).
        bgrad: per hidden layer, where its bias gradient is reduced (``drelu_bgrad``, DGELU_BGRAD for GELU: by the
            input-gradient GEMM of the layer above; ``bgradb``: by its own weight-gradient GEMM);
            one string for all.
        compute_copy: ``"kept"``: each parameter keeps a copy in the compute dtype (fp16/bf16), which
            the optimizer refreshes; ``"cast"``: none is kept, each layer's parameters are cast into one
            shared :class:`~mlptrain.nn.layers.CastBuffer` just before its GEMMs read them.
        fp8_weights: ``precision=fp8``: with ``compute_copy="cast"``, the weights of the layers whose
            widths FP8 takes (multiples of 16) are handed to the GEMM engine as the master, which it
            casts straight to FP8 (:attr:`mlptrain.nn.layers.Param.gemm_casts`); only the other weights
            (a 10-class head's) and the biases share the cast buffer.
        embedding: learned embeddings of some of the input columns (:mod:`mlptrain.nn.embedding`), in front
            of the first layer, which then reads ``embedding.out_features`` inputs (``widths[0]`` stays ``F``).
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
        activation: str = "relu",
        init: str = "he",
        bgrad: str | Sequence[str] = "bgradb",
        compute_copy: str = "kept",
        fp8_weights: bool = False,
        embedding: ColumnEmbedding | None = None,
    ) -> None:
        if len(widths) < 2 or (embedding is not None and embedding.in_features != widths[0]):
            raise ValueError(
                f"an MLP needs at least input and output widths (the embedding's input); got {list(widths)}"
            )
        self.widths = list(widths)
        self.embedding = embedding
        if embedding is not None:  # the first layer reads the kept columns and the embeddings
            widths = [embedding.out_features, *widths[1:]]
        self.execution = execution
        self.xp = xp
        n = len(widths) - 1
        if compute_copy not in COMPUTE_COPIES:
            raise ValueError(f"compute_copy must be {' or '.join(map(repr, COMPUTE_COPIES))}; got {compute_copy!r}")
        self.cast_buffer = None
        cast = compute_copy == "cast" and np.dtype(param_dtype) != np.dtype(compute_dtype)
        pairs = list(zip(widths, widths[1:], strict=False))  # (in, out) of each layer
        # per layer: its weight goes to the GEMM engine as the master (the FP8 cast reads it), or through the buffer
        gemm_casts = [cast and fp8_weights and a % FP8_MULTIPLE == 0 and b % FP8_MULTIPLE == 0 for a, b in pairs]
        if cast:
            buffered = [a * b for (a, b), own in zip(pairs, gemm_casts, strict=True) if not own]
            largest = {"weight": max(buffered, default=0), "bias": max(widths[1:])}
            self.cast_buffer = CastBuffer(xp, compute_dtype, largest)
        self.layers = [
            Linear(
                f"layer{i}",
                widths[i],
                widths[i + 1],
                activation=activation if i < n - 1 else "none",
                rng=rng,
                xp=xp,
                param_dtype=param_dtype,
                compute_dtype=compute_dtype,
                init=layer_init(init, activation, i, n),
                cast_buffer=self.cast_buffer,
                weight_gemm_casts=gemm_casts[i],
            )
            for i in range(n)
        ]
        self.set_bgrad(bgrad)
        self._side: Any = None  # GPU: the weight gradients' stream (use_wgrad_stream)
        # Called with a layer's weight Param as soon as its gradient is enqueued on the side stream
        # (data parallel: mlptrain.distributed.dp.GradientSync starts its all-reduce there)
        self.on_weight_grad: Callable[[Any], None] | None = None

    def set_bgrad(self, bgrad: str | Sequence[str]) -> None:
        """Choose, per hidden layer, where its bias gradient is reduced (see class docstring)."""
        hidden = [layer for layer in self.layers if layer.nonlinear]
        choices = [bgrad] * len(hidden) if isinstance(bgrad, str) else list(bgrad)
        if len(choices) != len(hidden) or any(c not in BGRAD_STRATEGIES for c in choices):
            raise ValueError(
                f"bgrad must be one of {BGRAD_STRATEGIES} or one per hidden layer ({len(hidden)}); got {bgrad!r}"
            )
        for layer, choice in zip(hidden, choices, strict=True):
            layer.bias_grad_in_wgrad = choice == "bgradb"

    @property
    def bgrad(self) -> list[str]:
        return ["bgradb" if layer.bias_grad_in_wgrad else "drelu_bgrad" for layer in self.layers if layer.nonlinear]

    @property
    def members(self) -> int:
        """The models it holds: 1 (an ensemble's :class:`~mlptrain.nn.batched.BatchedMLP`: K, stacked)."""
        return 1

    @property
    def params(self) -> list[Param]:
        embedded = self.embedding.params if self.embedding is not None else []
        return [p for layer in self.layers for p in layer.params] + embedded

    @property
    def num_params(self) -> int:
        return sum(int(p.value.size) for p in self.params)

    def forward(self, x: Any, keep: bool = True) -> Any:
        """``x (B, in) -> logits (B, out)``; ``keep=False`` for inference (RELU_BIAS, nothing kept for a backward)."""
        if self.embedding is not None:
            x = self.embedding.forward(self.execution, x, keep)  # (B, in) -> (B, in'), mlptrain.nn.embedding
        for layer in self.layers:
            x = layer.forward(self.execution, x, keep)
        return x

    def backward(self, dlogits: Any, head: HeadGrads | None = None) -> None:
        """Fill every ``param.grad`` from ``dlogits (B, out)``, the loss gradient of the logits.

        The math, from the top layer down, ``dZ = dlogits`` at the top (:class:`~mlptrain.nn.layers.Linear`
        gives each step with its epilog)::

            dW_l = dZ_l^T @ X_l,  db_l = sum_B dZ_l              (out, in)  layer.param_grads   BGRADB
            dZ_{l-1} = (dZ_l @ W_l) * relu'(Z_{l-1})             (B, in)    layer.grad_below    DRELU(_BGRAD)

        ``head``: what the output head already did of the top layer's backward (:class:`HeadGrads`):
        its bias gradient (the loss kernel's sum), and in head mode ``kernel`` its input gradient
        ``dZ_{top-1}``, where ``nn/cuda/head.py``'s kernel replaces the DRELU_BGRAD GEMM
        (:meth:`_input_grad`; ``head.input_grad`` is taken: set to None, so that it can go once read).

        The engineering is in the helpers below: :meth:`_backward_one_stream` lets each array go
        as soon as its last reader is enqueued (:meth:`_free_layer`), and on the GPU, with
        :meth:`use_wgrad_stream`, :meth:`_backward_two_streams` runs the weight gradients on a
        side stream beside the input-gradient chain. ``dlogits`` handed over as a one-element
        list (``[dlogits]``, emptied here) goes the same way; an array is kept by the caller's reference.
        """
        head = head or HeadGrads()
        handoff = dlogits if isinstance(dlogits, list) else [dlogits]  # the helper pops it: no reference here
        del dlogits
        if self._side is None:
            self._backward_one_stream(handoff, head)
        else:
            self._backward_two_streams(handoff, head)

    def _input_grad(self, i: int, dz: Any, head: HeadGrads) -> Any:
        """``dZ_{i-1}`` (None below the bottom layer): layer ``i``'s input-gradient GEMM, or, at the
        top in head mode ``kernel``, what the head kernel (``nn/cuda/head.py``) computed in its place."""
        layers, top = self.layers, len(self.layers) - 1
        if i == top and head.input_grad is not None:
            if head.input_bias_grad is not None:
                layers[i - 1].bias.grad = head.input_bias_grad
            dz_below, head.input_grad = head.input_grad, None
            return dz_below
        if i == 0 and self.embedding is not None:  # the embeddings' gradients, from layer 0's input gradient
            self.embedding.backward(self.execution, layers[0], dz, cast=i != top)
            return None
        # (the output layer's weight is still in the cast buffer, if any: the forward cast it last)
        return layers[i].grad_below(self.execution, dz, layers[i - 1] if i > 0 else None, cast=i != top)

    # --- the engineering of the backward: memory frees, the side stream ---------------------------

    def _backward_one_stream(self, handoff: list[Any], head: HeadGrads) -> None:
        """:meth:`backward` on one stream, each layer's inputs freed as soon as their last reader is enqueued.

        ``X_l`` goes after the weight gradient, before the input gradient allocates ``dZ_{l-1}``,
        and ``dZ_l`` before the layer below allocates anything: two ``dZ`` are alive at most. (With
        the head kernel the output layer's ``dZ_below`` is made with the loss, before the backward
        starts: there it is alive beside the top layer's input.)
        """
        ex, top = self.execution, len(self.layers) - 1
        dz = handoff.pop()
        for i in reversed(range(len(self.layers))):
            if i < top:  # the layer above is done: its dZ goes before this layer allocates
                self._free_layer(i + 1)
            self.layers[i].param_grads(ex, dz, head.bias_grad if i == top else None)
            self._free_layer(i)  # X_i had its last reader: it goes before dZ_below is allocated
            dz = self._input_grad(i, dz, head)
        self._free_layer(0)  # (a second time: the loop let layer 0 go at i = 0; the call ends both schedules)

    def _backward_two_streams(self, handoff: list[Any], head: HeadGrads) -> None:
        """:meth:`backward` with each layer's weight gradient (all but the bottom layer's) on the side
        stream, forked when its ``dZ`` is ready; the side stream is joined before returning.

        Layer ``l``'s inputs go once the input gradient of the layer below is enqueued: the main
        stream then waits for ``dW_l``, which ran beside ``dX_l`` and is done by then, so the chain
        never stalls on it (for a small, latency-bound step, where two streams pay, that matters
        more than the layer input and ``dZ`` held the longer).
        """
        ex, top = self.execution, len(self.layers) - 1
        dz = handoff.pop()
        for i in reversed(range(len(self.layers))):
            layer = self.layers[i]
            bias_grad = head.bias_grad if i == top else None
            if i == 0:  # the bottom layer's dW ends the chain: nothing to overlap
                layer.param_grads(ex, dz, bias_grad)
            else:
                hook = self.on_weight_grad  # data parallel: the all-reduce, after dW_i on the side stream
                then = None if hook is None else functools.partial(hook, layer.weight)
                self._side.run(i, functools.partial(self._param_grads, layer, dz, bias_grad), reads=dz, then=then)
            dz = self._input_grad(i, dz, head)
            if i < top:  # the layer above's dW ran beside its dX and, by now, is done
                self._free_layer(i + 1)
        self._side.join()
        self._free_layer(0)  # the bottom layer's weight gradient, the last reader of X_0 and dZ_0, is enqueued

    def _free_layer(self, i: int) -> None:
        """Let the memory of layer ``i``'s backward inputs go: its saved input and mask, and every
        reference the GEMM plans keep to their last operands (``X_i``, ``dZ_i``, the mask below).

        With the weight gradients on the side stream, the current stream first waits for layer
        ``i``'s (:meth:`SideStream.retire`): CuPy's pool hands freed blocks to the stream that
        allocated them, here the main stream, which must not overwrite ``X_i`` or ``dZ_i`` while the
        side stream's GEMM still reads them. By the time the main stream gets there the side stream
        has usually finished that GEMM: it ran beside the main stream's input-gradient GEMM.
        """
        if self._side is not None:
            self._side.retire(i)
        layer = self.layers[i]
        layer.release_saved()
        self.execution.release(layer.name)

    def _param_grads(self, layer: Linear, dz: Any, bias_grad: Any) -> None:
        """On the side stream: layer's weight gradient. ``on_weight_grad`` follows it there (data parallel:
        its all-reduce starts while the main stream goes on down the chain), after the event that
        :meth:`_free_layer` waits for, so the chain never waits for the all-reduce."""
        with self._side.allocating_on_main():  # dW from the blocks the main stream freed (nn/cuda/streams.py)
            layer.param_grads(self.execution, dz, bias_grad)

    @property
    def side_stream(self) -> Any:
        """The weight gradients' stream (:meth:`use_wgrad_stream`), or None."""
        return self._side.stream if self._side is not None else None

    def use_wgrad_stream(self, enabled: bool = True) -> None:
        """GPU: run the weight-gradient GEMMs on a second stream, concurrent with the input-gradient chain."""
        if enabled:
            from mlptrain.nn.cuda.streams import SideStream

            self._side = SideStream(len(self.layers))
        else:
            self._side = None

    @property
    def uses_wgrad_stream(self) -> bool:
        return self._side is not None

    # --- what a step leaves behind, and the parameters' state -------------------------------

    def step_arrays(self) -> list[Any]:
        """The gradients of the last step (for a CUDA graph to keep; the backward freed everything else)."""
        return [p.grad for p in self.params]

    def restore_step_arrays(self, grads: list[Any]) -> None:
        """Point the parameters at ``grads`` again (after a replayed step rewrote them)."""
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g

    def release_step_arrays(self) -> None:
        """Drop the gradients, saved inputs and masks of the last step (their memory can go)."""
        for p in self.params:
            p.grad = None
        for layer in self.layers:
            layer.release_saved()
        if self.embedding is not None:
            self.embedding.release_saved()

    def state_dict(self) -> dict[str, np.ndarray]:
        """The master copy of every parameter, as host arrays by name (``layer0.weight``, ...)."""
        to_host = np.array if self.xp is np else (lambda a: a.get())  # copies: the state at this moment
        return {p.name: to_host(p.value) for p in self.params}

    def load_state_dict(self, arrays: dict[str, Any]) -> None:
        """Copy ``arrays`` (by parameter name, shapes already checked) into the parameters and their compute copies."""
        for p in self.params:
            p.value[...] = self.xp.asarray(arrays[p.name])
            p.sync_compute()


def layer_init(init: str, activation: str, i: int, layers: int) -> str:
    """The initialisation of layer ``i`` of ``layers``: ``init`` for the hidden layers of a nonlinear model (and
    for every layer with ``torch``), LeCun for the output layer and for a deep linear model."""
    return init if init == Init.torch or (activation != "none" and i < layers - 1) else Init.lecun.value
