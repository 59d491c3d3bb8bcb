"""The linear layer, its forward and its backward, and the parameters it owns.

Read :class:`Linear` first: its docstring is the math of one layer, forward and backward, with the
cuBLASLt epilog that fuses each step and the shape of every array; :meth:`Linear.forward`,
:meth:`Linear.param_grads` and :meth:`Linear.grad_below` are its three GEMMs, each one call of the
execution object (:mod:`mlptrain.nn.execution`: fused epilogs, or the same math unfused), so a
layer never branches on the execution mode. :class:`mlptrain.nn.network.MLP` chains the layers
(and schedules the backward's GEMMs: memory frees, a side stream).

After it, how the parameters are stored (the engineering the math does not need): a
:class:`Param` keeps the master copy ``value`` in the parameter dtype (float32 for fp16/bf16
training) and, when the compute dtype differs, a ``compute`` copy that the GEMMs read. The
optimizer updates ``value`` and refreshes ``compute`` in the same kernel. With
``precision.compute_copy=cast`` no copy is kept: a :class:`CastBuffer`, one per model, receives
each layer's parameters cast just before its GEMMs read them (2 of the 12 bytes a parameter costs
in fp16/bf16 with SGD momentum; one cast kernel per layer and pass). Under ``precision=fp8`` the
weights whose GEMMs run in FP8 skip that buffer too: the GEMM engine's FP8 cast reads the float32
master itself (rounded to the compute dtype in registers, so the FP8 bytes are those of the kept
copy's), and only the other weights (the head's) and the biases are cast into it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mlptrain.config.schema import Init
from mlptrain.nn.execution import ACTIVATIONS, FusedExecution, NaiveExecution


class Linear:
    """One layer, ``Y (B, out) = act(X (B, in) @ W^T + b)``: one GEMM forward, two backward.

    ``W (out, in)``, ``b (out,)``; ``act`` is ReLU or GELU (hidden layers) or nothing (the output
    layer). Fused, each GEMM does its elementwise work and reductions as a cuBLASLt epilog
    (:mod:`mlptrain.nn.epilogs`); ReLU below, with GELU in brackets::

        forward   Z = X @ W^T + b;  Y = relu(Z)          (B, out)  RELU_AUX_BIAS (GELU_AUX_BIAS): also the
                                                                   mask Z >= 0, bit-packed (relu_aux; GELU:
                                                                   Z itself), kept with X for the backward;
                                                                   BIAS on the output layer
        backward, given dZ = dL/dZ (B, out):
          weight  dW = dZ^T @ X                          (out, in) BGRADB: also db = sum_B dZ  (out,)
          input   dZ_below = (dZ @ W) * relu'(Z_below)   (B, in)   DRELU (DGELU) with the layer below's
                                                                   relu_aux; DRELU_BGRAD (DGELU_BGRAD):
                                                                   also db_below = sum_B dZ_below  (in,)

    The two backward GEMMs read the same ``dZ`` and not each other's results, so
    :meth:`mlptrain.nn.network.MLP.backward` may run them on two streams. A hidden layer's bias
    gradient comes from one of them (the *bgrad strategy*, :attr:`bias_grad_in_wgrad`): BGRADB of
    its own weight GEMM, or DRELU_BGRAD of the input GEMM of the layer above. For small heads on
    the GPU the output layer's input GEMM (DRELU or DRELU_BGRAD at K = classes) is not run: one kernel,
    :func:`mlptrain.nn.cuda.head.head_input_grad` (``nn/cuda/head.py``), computes the same
    ``dZ_below`` and ``db_below`` with the loss (:class:`mlptrain.nn.head.OutputHead`, mode ``kernel``).

    Args:
        name: prefix of the parameter names and of the GEMM call sites.
        in_features, out_features: ``W`` is ``(out_features, in_features)``.
        activation: ``"relu"`` or ``"gelu"`` (hidden layers), or ``"none"`` (the output layer).
        rng: host NumPy Generator; He init ``N(0, 2/in)`` for ReLU layers, LeCun ``N(0, 1/in)``
            otherwise (or as ``init`` says). Drawn on the host so CPU and GPU runs start from
            the same weights.
        cast_buffer: where the parameters are cast on use (``compute_copy=cast``), or None.
        weight_gemm_casts: the weight is handed to the GEMM engine as the master (:attr:`Param.gemm_casts`).
    """

    def __init__(
        self,
        name: str,
        in_features: int,
        out_features: int,
        *,
        activation: str,
        rng: np.random.Generator,
        xp: Any,
        param_dtype: Any,
        compute_dtype: Any,
        init: str = "he",
        cast_buffer: CastBuffer | None = None,
        weight_gemm_casts: bool = False,
    ) -> None:
        self.name = name
        self.in_features = in_features
        self.out_features = out_features
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS.names()}")
        self.activation = activation
        w, b = initial(init, in_features, out_features, rng)
        w_master = xp.asarray(w, dtype=param_dtype)
        self.weight = Param(f"{name}.weight", w_master, compute_dtype, cast_buffer, "weight", weight_gemm_casts)
        self.bias = Param(f"{name}.bias", xp.asarray(b, dtype=param_dtype), compute_dtype, cast_buffer, "bias")
        # Where this layer's bias gradient is computed (see mlptrain.nn.execution): in its own
        # weight-gradient GEMM (BGRADB), or by the layer above (DRELU_BGRAD). A layer without
        # ReLU has no relu_aux for the layer above to use, so it always reduces its own.
        self.bias_grad_in_wgrad = True
        self.x: Any = None  # (B, in) the input of the last forward, kept for the weight gradient
        self.mask: Any = None  # what the backward needs of the activation: ReLU: its mask (fused:
        # relu_aux (Mb, B) uint8; naive: (B, out) bool); GELU: the pre-activation (fused: gelu_aux
        # (round_up(out, 8), B) column-major; naive: (B, out))

    def forward(self, ex: FusedExecution | NaiveExecution, x: Any, keep: bool = True) -> Any:
        """``x (B, in) -> y (B, out)``, one GEMM: RELU_AUX_BIAS (GELU_AUX_BIAS; BIAS without activation).

        Keeps ``x`` and the mask for the backward; ``keep=False`` (inference): RELU_BIAS (GELU_BIAS),
        no mask made, nothing kept. :meth:`mlptrain.nn.execution.FusedExecution.forward` makes the call.
        """
        y, mask = ex.forward(self.name, self.weight.for_gemm(), self.bias.for_gemm(), x, self.activation, mask=keep)
        if keep:
            self.x, self.mask = x, mask  # X (B, in) and the mask (see __init__)
        return y

    def param_grads(self, ex: FusedExecution | NaiveExecution, dz: Any, bias_grad: Any = None) -> None:
        """The weight-gradient GEMM: ``dW (out, in) = dZ^T @ X``, with BGRADB ``db (out,) = sum_B dZ``.

        ``dz (B, out)``: the loss gradient of this layer's pre-activation; ``X``: the input the
        forward kept. ``bias.grad`` comes from BGRADB when this layer reduces it, or is
        ``bias_grad`` when the caller already did (the loss kernel sums the logits' gradient).
        Independent of :meth:`grad_below`, so the two may run on different streams
        (:class:`mlptrain.nn.cuda.streams.SideStream`).
        :meth:`mlptrain.nn.execution.FusedExecution.weight_grad` makes the call.
        """
        reduce_here = self.bias_grad_in_wgrad and bias_grad is None
        self.weight.grad, db = ex.weight_grad(self.name, self.x, dz, reduce_here)  # (out, in), (out,) or None
        if bias_grad is not None:
            self.bias.grad = bias_grad
        elif db is not None:
            self.bias.grad = db

    def grad_below(self, ex: FusedExecution | NaiveExecution, dz: Any, below: Linear | None, cast: bool = True) -> Any:
        """The input-gradient GEMM: ``dZ_below (B, in) = (dZ @ W) * relu'(Z_below)``, DRELU (DGELU).

        The derivative is that of ``below``'s activation, read from the mask its forward kept.
        With DRELU_BGRAD (DGELU_BGRAD), when ``below`` takes its bias gradient from above, the same
        GEMM gives ``below.bias.grad = sum_B dZ_below (in,)``. None at the bottom layer (``below``
        None): nobody needs the gradient of the data. ``cast=False``: the cast buffer still holds
        this layer's weight (:meth:`Param.for_gemm`).
        :meth:`mlptrain.nn.execution.FusedExecution.input_grad` makes the call.
        """
        if below is None:
            return None
        dz_below, db_below = ex.input_grad(
            self.name,
            self.weight.for_gemm(cast),  # W (out, in)
            dz,  # (B, out)
            below.mask,
            bias_grad_below=not below.bias_grad_in_wgrad,
            activation_below=below.activation,
        )
        if db_below is not None:
            below.bias.grad = db_below  # (in,)
        return dz_below  # (B, in)

    # --- what the layer holds ------------------------------------------------------------------

    @property
    def relu(self) -> bool:
        return self.activation == "relu"

    @property
    def nonlinear(self) -> bool:
        """A hidden layer: its activation has a derivative the layer above applies (DRELU, DGELU)."""
        return self.activation != "none"

    @property
    def params(self) -> list[Param]:
        return [self.weight, self.bias]

    def release_saved(self) -> None:
        """Forget the input and mask kept for the backward (the network's backward does, once they are read)."""
        self.x = self.mask = None


# --- how the parameters are stored: master and compute copies, the cast buffer, the first values ---


class CastBuffer:
    """Where parameters are cast to the compute dtype just before a GEMM reads them (``compute_copy=cast``).

    One region per role (``"weight"``, ``"bias"``), each the size of the largest parameter of that
    role: the layers take turns, one at a time. The stream orders it: a layer's cast is enqueued
    after the GEMMs that read the last layer's, on the same stream (the weight gradients on the
    side stream never read a weight).
    """

    def __init__(self, xp: Any, dtype: Any, sizes: dict[str, int]) -> None:
        self.regions = {role: xp.empty(n, dtype=dtype) for role, n in sizes.items()}
        self.holds: dict[str, Any] = dict.fromkeys(sizes)  # the master array last cast into each region

    def cast(self, role: str, value: Any, again: bool = True) -> Any:
        """``value`` in the compute dtype, a view of the region (valid until the next cast of ``role``).

        ``again=False``: the region already holds ``value`` (the output layer's weight, cast by the
        forward and read again by the backward right after it): no kernel, only a check on the host.
        """
        view = self.regions[role][: value.size].reshape(value.shape)
        if again:
            view[...] = value  # the cast kernel: master (parameter dtype) -> compute dtype
            self.holds[role] = value
        elif self.holds[role] is not value:
            raise RuntimeError(f"the {role} cast buffer does not hold this parameter: it was cast over since")
        return view

    @property
    def nbytes(self) -> int:
        return sum(int(r.nbytes) for r in self.regions.values())


class Param:
    """A trainable array with its gradient.

    Attributes:
        name: ``"layer0.weight"`` etc.; keys of checkpoints and optimizer state.
        value: master copy, parameter dtype.
        compute: the copy the GEMMs read, compute dtype (``value`` itself when the dtypes agree;
            None when it is cast on use into ``cast_buffer``: read it through :meth:`for_gemm`).
        grad: gradient in compute dtype as the backward produced it (None before the first).
        gemm_casts: the GEMM engine reads the master and casts it itself (``precision=fp8`` with
            ``compute_copy=cast``: straight to FP8, :meth:`mlptrain.nn.fp8.Fp8Gemm.__call__`): no copy, no buffer.
    """

    def __init__(
        self,
        name: str,
        value: Any,
        compute_dtype: Any,
        cast_buffer: CastBuffer | None = None,
        role: str = "",
        gemm_casts: bool = False,
    ) -> None:
        self.name = name
        self.value = value
        self.gemm_casts = gemm_casts and value.dtype != compute_dtype
        self.cast_buffer = cast_buffer if value.dtype != compute_dtype and not self.gemm_casts else None
        self.role = role
        if self.gemm_casts or self.cast_buffer is not None:
            self.compute: Any = None  # read through for_gemm(): the master, or its cast into the buffer
        else:
            self.compute = value if value.dtype == compute_dtype else value.astype(compute_dtype)
        self.grad: Any = None

    @property
    def has_compute_copy(self) -> bool:
        """A kept copy in the compute dtype, which the optimizer refreshes."""
        return self.compute is not None and self.compute is not self.value

    def for_gemm(self, cast: bool = True) -> Any:
        """The array a GEMM reads: the kept compute copy, or the master cast now (``cast=False``:
        the cast buffer still holds this parameter, see :meth:`CastBuffer.cast`); the master itself
        where the GEMM engine casts it (``gemm_casts``)."""
        if self.gemm_casts:
            return self.value
        if self.cast_buffer is None:
            return self.compute
        return self.cast_buffer.cast(self.role, self.value, again=cast)

    def sync_compute(self) -> None:
        """Refresh the compute copy from the master copy (after loading a checkpoint)."""
        if self.has_compute_copy:
            self.compute[...] = self.value


def initial(init: str, in_features: int, out_features: int, rng: np.random.Generator) -> tuple[Any, Any]:
    """A layer's initial ``W (out, in)`` and ``b (out,)`` as host float64 arrays.

    ``he``: ``N(0, 2/in)``, ``lecun``: ``N(0, 1/in)``, zero biases; ``torch``: PyTorch's ``nn.Linear``
    default (``kaiming_uniform_(a=sqrt(5))``), ``U(-1/sqrt(in), 1/sqrt(in))`` for the weights and the biases.
    """
    init = Init(init)  # ValueError for a name the schema does not know
    if init is Init.torch:
        bound = 1.0 / math.sqrt(in_features)
        w = rng.uniform(-bound, bound, size=(out_features, in_features))
        return w, rng.uniform(-bound, bound, size=out_features)
    gain = 2.0 if init is Init.he else 1.0
    return rng.standard_normal((out_features, in_features)) * math.sqrt(gain / in_features), np.zeros(out_features)
