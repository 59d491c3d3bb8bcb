"""An ensemble's network: K members of one shape, stacked, each layer's GEMMs one batched call.

Member ``k``'s parameters are slice ``k`` of stacked arrays, ``W (K, out, in)`` and ``b (K, out)``, and the
batch flows as ``X (K, B, in)``: member ``k`` sees its own rows. Each layer's three GEMMs are then one
batched GEMM with the same epilogs as a single model's (:class:`mlptrain.nn.layers.Linear`), through the
same execution objects (:mod:`mlptrain.nn.execution` transposes the last two axes and reduces over the
batch axis, so it serves both)::

    forward   Z^T (K, out, B) = W (K, out, in) @ X^T (K, in, B)    RELU_AUX_BIAS, bias (K, out, 1),
                                                                    relu_aux (K, Mb, B)
    input     dX^T (K, in, B) = W^T (K, in, out) @ dZ^T (K, out, B) DRELU(_BGRAD): bgrad (K, in, 1)
    weight    dW^T (K, in, out) = X^T (K, in, B) @ dZ (K, B, out)   BGRADB: bgradb (K, out, 1)

These are nvmath's batched operands (``../shared/docs/nvmath-notes.md``): a bias of shape ``(batch, M, 1)``,
a batched ``relu_aux``, bias gradients of shape ``(batch, L, 1)``, which :class:`BatchedLinear` reads back as
``(K, out)``. On the GPU one cuBLASLt call runs all K members (:mod:`mlptrain.nn.cuda.gemm`); on the CPU
:class:`BatchedNumpyGemm` computes the batched contract member by member with the single model's
:func:`mlptrain.nn.epilogs.matmul`, so member ``k`` computes exactly what a single model of its seed does,
bit for bit (the contract is batched; its NumPy implementation may loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mlptrain.nn.epilogs import Epilog, matmul
from mlptrain.nn.execution import FusedExecution, NaiveExecution
from mlptrain.nn.layers import Linear, Param, initial
from mlptrain.nn.network import MLP, layer_init

# the aux outputs that are bias gradients: (M,) per member, (K, M, 1) batched, as nvmath returns them
_BIAS_GRADS = ("bgradb", "bgrada", "drelu_bgrad", "dgelu_bgrad")


class BatchedNumpyGemm:
    """The batched epilog contract on the CPU: ``D (K, M, N) = A (K, M, Kd) @ B (K, Kd, N)`` with an epilog.

    Epilog inputs are batched as nvmath takes them: ``bias (K, M, 1)``, ``relu_aux (K, Mb, N)``, ``gelu_aux
    (K, Mp, N)``; bias gradients come back as ``(K, L, 1)``. Each member is the single GEMM of
    :func:`mlptrain.nn.epilogs.matmul` on its slices, and every result keeps the layout that GEMM gives it
    (column-major per member where the epilog makes it so), so the next GEMM reads what a single model reads.
    """

    def __call__(
        self, key: str, a: Any, b: Any, epilog: Epilog | None = None, **epilog_inputs: Any
    ) -> tuple[Any, dict[str, Any]]:
        if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0]:
            raise ValueError(f"{key}: a batched GEMM needs A (K, M, Kd) and B (K, Kd, N); got {a.shape} and {b.shape}")
        inputs = {name: v for name, v in epilog_inputs.items() if v is not None}
        outs, auxes = [], []
        for k in range(a.shape[0]):
            out = matmul(a[k], b[k], epilog=epilog, epilog_inputs={n: v[k] for n, v in inputs.items()})
            d, aux = out if isinstance(out, tuple) else (out, {})
            outs.append(d)
            auxes.append(aux)
        stacked = {name: stack_members([x[name] for x in auxes]) for name in auxes[0]}
        for name in _BIAS_GRADS:
            if name in stacked:
                stacked[name] = stacked[name][..., None]  # (K, L) -> (K, L, 1), nvmath's batched bias gradient
        return stack_members(outs), stacked

    def release_operands(self, prefix: str | None = None) -> None:
        """Nothing to forget: no plan keeps operands."""


def stack_members(parts: Sequence[Any]) -> Any:
    """``K`` arrays of one shape as ``(K, ...)``, each member slice in the layout its array had (column-major
    matrices stay column-major: a stack of ``(N, M)`` C-order arrays, transposed, as cuBLASLt lays a batch out)."""
    first = parts[0]
    if first.ndim == 2 and first.flags.f_contiguous and not first.flags.c_contiguous:
        return np.stack([p.T for p in parts]).swapaxes(-1, -2)
    return np.stack(parts)


class BatchedLinear(Linear):
    """:class:`~mlptrain.nn.layers.Linear` of ``K`` members: ``Y (K, B, out) = act(X (K, B, in) @ W^T + b)``.

    ``W (K, out, in)``, ``b (K, out)``, each member's drawn from its own generator exactly as a single
    model's layer draws it (:func:`~mlptrain.nn.layers.initial`). The math and the epilogs are Linear's; the
    bias goes to the execution as ``(K, 1, out)`` (broadcast over the batch; fused: the epilog's
    ``(K, out, 1)``), and the bias gradients it returns are read as ``(K, out)``.
    """

    def __init__(
        self,
        name: str,
        in_features: int,
        out_features: int,
        *,
        activation: str,
        rngs: Sequence[np.random.Generator],
        xp: Any,
        param_dtype: Any,
        compute_dtype: Any,
        init: str = "he",
    ) -> None:
        self.name, self.in_features, self.out_features = name, in_features, out_features
        self.activation = activation
        drawn = [initial(init, in_features, out_features, rng) for rng in rngs]  # member k from rngs[k]
        w = xp.asarray(np.stack([w for w, _ in drawn]), dtype=param_dtype)  # (K, out, in)
        b = xp.asarray(np.stack([b for _, b in drawn]), dtype=param_dtype)  # (K, out)
        self.weight = Param(f"{name}.weight", w, compute_dtype, None, "weight")
        self.bias = Param(f"{name}.bias", b, compute_dtype, None, "bias")
        self.bias_grad_in_wgrad = True
        self.x: Any = None  # (K, B, in)
        self.mask: Any = None  # fused ReLU: relu_aux (K, Mb, B); naive: (K, B, out) bool; GELU: Z

    @property
    def members(self) -> int:
        return int(self.weight.value.shape[0])

    def forward(self, ex: FusedExecution | NaiveExecution, x: Any, keep: bool = True) -> Any:
        """``x (K, B, in) -> y (K, B, out)``: one batched GEMM, RELU_AUX_BIAS (GELU_AUX_BIAS; BIAS on top)."""
        b = self.bias.for_gemm()[:, None, :]  # (K, 1, out): broadcast over each member's batch
        y, mask = ex.forward(self.name, self.weight.for_gemm(), b, x, self.activation, mask=keep)
        if keep:
            self.x, self.mask = x, mask
        return y

    def param_grads(self, ex: FusedExecution | NaiveExecution, dz: Any, bias_grad: Any = None) -> None:
        """``dW (K, out, in) = dZ^T @ X`` per member, BGRADB ``db (K, out, 1)`` read as ``(K, out)``."""
        super().param_grads(ex, dz, bias_grad)
        self.bias.grad = member_rows(self.bias.grad, self.bias.value.shape)

    def grad_below(self, ex: FusedExecution | NaiveExecution, dz: Any, below: Linear | None, cast: bool = True) -> Any:
        """``dZ_below (K, B, in)``, DRELU(_BGRAD); the layer below's ``db (K, in, 1)`` read as ``(K, in)``."""
        dz_below = super().grad_below(ex, dz, below, cast)
        if below is not None:
            below.bias.grad = member_rows(below.bias.grad, below.bias.value.shape)
        return dz_below


def member_rows(grad: Any, shape: tuple[int, ...]) -> Any:
    """A bias gradient as the parameter is shaped: the epilog's ``(K, L, 1)`` as ``(K, L)`` (a view); None stays."""
    return None if grad is None else grad.reshape(shape)


class BatchedMLP(MLP):
    """:class:`~mlptrain.nn.network.MLP` of ``K = len(rngs)`` members of one shape, trained as one.

    Member ``k`` is initialised from ``rngs[k]`` as a single MLP from that generator is (the same draws in the
    same order), and its forward and backward are the MLP's, each GEMM batched over the members. Its inputs
    are ``(K, B, in)``, its logits ``(K, B, out)``. Parameters are kept in one dtype (no compute copy cast on
    use, no FP8 weights): the ensemble builder refuses the settings that would need them.
    """

    def __init__(
        self,
        widths: Sequence[int],
        *,
        execution: FusedExecution | NaiveExecution,
        xp: Any,
        rngs: Sequence[np.random.Generator],
        param_dtype: Any,
        compute_dtype: Any,
        activation: str = "relu",
        init: str = "he",
        bgrad: str | Sequence[str] = "bgradb",
    ) -> None:
        if len(widths) < 2 or len(rngs) < 1:
            raise ValueError(f"a batched MLP needs widths [in, ..., out] and one generator per member; got {widths}")
        self.widths, self.execution, self.xp = list(widths), execution, xp
        self.cast_buffer, self.embedding = None, None  # (model.embedding_dim refuses an ensemble)
        n = len(widths) - 1
        self.layers = [
            BatchedLinear(
                f"layer{i}",
                widths[i],
                widths[i + 1],
                activation=activation if i < n - 1 else "none",
                rngs=rngs,
                xp=xp,
                param_dtype=param_dtype,
                compute_dtype=compute_dtype,
                init=layer_init(init, activation, i, n),
            )
            for i in range(n)
        ]
        self.set_bgrad(bgrad)
        self._side: Any = None
        self.on_weight_grad = None

    @property
    def members(self) -> int:
        return len(self.layers[0].weight.value)

    def member_state(self, k: int) -> dict[str, np.ndarray]:
        """Member ``k``'s parameters as a single model's state dict (``layer0.weight (out, in)``, ...)."""
        return {name: a[k] for name, a in self.state_dict().items()}
