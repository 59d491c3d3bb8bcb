"""The fused forward and backward of a chain of linear layers, over any GEMM engine.

This is the math of :class:`mlptrain.torch.FusedMLP` (and of :class:`~mlptrain.torch.FusedLinear`, a
chain of one), written once for both engines: NumPy arrays through the epilog contract on the CPU
(:class:`~mlptrain.torch.engines.NumpyEngine`), torch tensors through cuBLASLt on a GPU
(:class:`~mlptrain.torch.engines.TorchEngine` over :mod:`mlptrain.torch.torch_gemm`). The
layout is the trainer's (:mod:`mlptrain.nn.execution`): activations ``(B, features)`` C-contiguous,
which is the column-major ``(features, B)`` matrix cuBLASLt's bias and aux epilogs write, so every
``.T`` below is a free view and no copy runs between layers.

Layer ``l`` maps ``h_l (B, in)`` to ``y = act(h_l @ W_l^T + b_l)``:

=========== ================================= =============================================
GEMM        training (aux kept)               what it computes
=========== ================================= =============================================
forward     RELU_AUX_BIAS / GELU_AUX_BIAS     Z^T (out, B) = W @ h^T + b, act, and the aux
            (no_grad: RELU_BIAS / GELU_BIAS)  (relu_aux: the bit mask Z >= 0; gelu_aux: Z)
input grad  DRELU(_BGRAD) / DGELU(_BGRAD)     dZ_below^T (in, B) = W^T @ dZ^T times act'
            with the aux of the layer below   below, plus (_BGRAD) the bias gradient below
weight grad BGRADB (or plain)                 dW^T (in, out) = h^T @ dZ, plus db = sum_B dZ
=========== ================================= =============================================

Each activation's epilogs are the trainer's table's row (:data:`mlptrain.nn.execution.ACTIVATIONS`:
``forward``/``infer``, ``forward_no_bias``/``infer_no_bias``, and through :class:`FusedExecution` the
backward's), and its aux output's name is the row's ``aux``.

A hidden layer's bias gradient comes from the layer above's DRELU_BGRAD (``drelu_bgrad``) or from its
own BGRADB (``bgradb``): both exact, their speed depends on the shape (:mod:`mlptrain.step.cuda.bgrad`).

Fallbacks, where an epilog does not fit:

* no bias (``bias=False``): the row's bias-free epilogs, GELU_AUX / GELU for GELU; for ReLU, which has
  none (the contract has no RELU_AUX), RELU_AUX_BIAS reads a bias of zeros (``out`` elements, made
  once): Z + 0 is Z, the mask and the output are RELU_AUX's. No bias gradient is computed.
* the top layer's own activation (a :class:`FusedLinear` with ``activation``): no GEMM above it can
  apply its derivative, so ``dZ = dY * act'(Z)`` is one element-wise pass (:meth:`Engine.act_grad`).
* a layer with one output (K = 1 in the input-gradient GEMM, which DRELU and DGELU reject, and N = 1
  in the weight gradient, which nvmath's tests leave out for BGRADB): plain GEMMs and the derivative
  and the column sums element-wise, as :class:`~mlptrain.nn.execution.FusedExecution` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from mlptrain.nn.epilogs import Epilog
from mlptrain.nn.execution import ACTIVATIONS, FusedExecution, Gemm


class Engine(Protocol):
    """What the chain needs beside the GEMMs: a zero bias, and the element-wise fallbacks."""

    @property
    def gemm(self) -> Gemm:
        """The GEMMs, with their epilogs (:class:`~mlptrain.nn.execution.Gemm`)."""

    def zero_bias(self, m: int, like: Any) -> Any:
        """A bias of ``m`` zeros in ``like``'s dtype and memory (RELU_AUX_BIAS standing in for RELU_AUX)."""

    def act_grad(self, dy: Any, aux_t: Any, m: int, activation: str) -> Any:
        """``dY (B, m) * act'(Z)``, read from ``aux_t``: the forward's aux transposed, ``(B, Mb)`` or ``(B, Mp)``."""

    def col_sum(self, x: Any) -> Any:
        """``x (B, m)`` summed over the batch, ``(m,)`` in x's dtype, in a wide accumulator."""


@dataclass
class Saved:
    """What the forward keeps for the backward: each layer's input but the first (``hidden[l - 1]`` is
    layer ``l``'s input, ``(B, in_l)``) and each activation's aux, transposed (``(B, Mb)`` uint8 or
    ``(B, Mp)``: C-contiguous, so that a framework can hold it as an ordinary tensor)."""

    hidden: list[Any]
    aux_t: list[Any]


def forward(
    eng: Engine, x: Any, weights: list[Any], biases: list[Any], acts: list[str], keep: bool
) -> tuple[Any, Saved]:
    """``x (B, in) -> y (B, out)`` through every layer; ``keep=False`` (no_grad) writes no aux.

    ``acts[l]``: ``"relu"``, ``"gelu"`` or ``"none"`` for layer ``l``; ``biases`` empty for bias=False.
    """
    saved = Saved([], [])
    h = x
    for l, (W, act) in enumerate(zip(weights, acts, strict=True)):
        spec, b = ACTIVATIONS[act], (biases[l] if biases else None)
        if spec.forward is None and b is None:  # a plain GEMM follows A's order: (B, in) @ (in, out) -> (B, out)
            y, _ = eng.gemm(f"{l}.fwd", h, W.T)
        else:
            bias_free = None if b is not None else (spec.forward_no_bias if keep else spec.infer_no_bias)
            if b is None and bias_free is None:
                b = eng.zero_bias(W.shape[0], W)  # RELU_AUX_BIAS with zeros is RELU_AUX (the contract has none)
            epilog = bias_free or (spec.forward if keep else spec.infer) or Epilog.BIAS
            # (out, in) @ (in, B) -> (out, B) column-major == (B, out) C-order
            zt, aux = eng.gemm(f"{l}.fwd", W, h.T, epilog, bias=b)
            y = zt.T
            if keep and spec.aux:
                saved.aux_t.append(aux[spec.aux].T)  # (Mb, B) or (Mp, B) column-major -> (B, Mb) C-order
        if keep and l < len(weights) - 1:
            saved.hidden.append(y)
        h = y
    return h, saved


def backward(
    eng: Engine,
    dy: Any,
    x: Any,
    weights: list[Any],
    acts: list[str],
    saved: Saved,
    *,
    bias: bool,
    bias_in_wgrad: list[bool],
    input_grad: bool,
) -> tuple[Any, list[Any], list[Any]]:
    """``(dx or None, [dW_l (out, in)], [db_l (out,)] or [])`` from ``dy (B, out)``, the top layer's output gradient.

    ``bias_in_wgrad[l]``: layer ``l`` (with an activation, below the top) reduces its own bias gradient
    with BGRADB (``bgradb``); otherwise the layer above's DRELU_BGRAD / DGELU_BGRAD does (``drelu_bgrad``).
    ``input_grad``: also compute ``dx`` (B, in) (a plain GEMM: the input has no activation below it).
    """
    ex = FusedExecution(eng.gemm)
    n = len(weights)
    inputs = [x, *saved.hidden]
    aux_t = list(saved.aux_t)
    aux_of = {l: aux_t.pop(0) for l in range(n) if acts[l] != "none"}  # layer -> its aux, (B, Mb) or (B, Mp)
    dws: list[Any] = [None] * n
    dbs: list[Any] = [None] * n
    dz = dy
    if acts[-1] != "none":  # the top layer's own activation: no GEMM above applies its derivative
        dz = eng.act_grad(dy, aux_of[n - 1], weights[-1].shape[0], acts[-1])
    for l in reversed(range(n)):
        own_bias = bias and (l == n - 1 or acts[l] == "none" or bias_in_wgrad[l])
        dws[l], dbs[l] = _weight_grad(eng, ex, l, inputs[l], dz, own_bias, dbs[l])
        if l == 0:
            dx = _input_grad(eng, ex, 0, weights[0], dz, None, "none", False)[0] if input_grad else None
            break
        below_bias = bias and acts[l - 1] != "none" and not bias_in_wgrad[l - 1]
        dz, db_below = _input_grad(eng, ex, l, weights[l], dz, aux_of.get(l - 1), acts[l - 1], below_bias)
        if below_bias:
            dbs[l - 1] = db_below
    return dx, dws, (dbs if bias else [])


def _weight_grad(eng: Engine, ex: FusedExecution, l: int, h: Any, dz: Any, own_bias: bool, db: Any) -> tuple:
    """``dW = dZ^T @ h`` (BGRADB: ``db = sum_B dZ`` too, when the layer reduces its own bias gradient)."""
    if own_bias and dz.shape[1] == 1:  # N = 1: no BGRADB (nvmath's tests leave that case out)
        return ex.weight_grad(str(l), h, dz, bias_grad=False)[0], eng.col_sum(dz)
    dw, db_own = ex.weight_grad(str(l), h, dz, bias_grad=own_bias)
    return dw, (db_own if own_bias else db)


def _input_grad(
    eng: Engine, ex: FusedExecution, l: int, W: Any, dz: Any, aux_t: Any, act_below: str, bias_below: bool
) -> tuple[Any, Any]:
    """``dZ_below (B, in) = (dZ @ W) * act'_below``, and its column sums when ``bias_below``."""
    if aux_t is not None and dz.shape[1] == 1:  # K = 1: DRELU and DGELU reject it
        dh, _ = ex.input_grad(str(l), W, dz, None, False)  # (B, 1) @ (1, in): an outer product
        dzb = eng.act_grad(dh, aux_t, W.shape[1], act_below)
        return dzb, (eng.col_sum(dzb) if bias_below else None)
    mask = aux_t.T if aux_t is not None else None  # (Mb, B) or (Mp, B) column-major, as the forward wrote it
    return ex.input_grad(str(l), W, dz, mask, bias_below, act_below)
