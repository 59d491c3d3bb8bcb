"""The fused chain as autograd sees it: two registered PyTorch operators, and the same bodies eagerly.

``mlptrain::fused_mlp`` (forward) and ``mlptrain::fused_mlp_backward`` are ``torch.library.custom_op``
operators: each has a fake-tensor rule (``register_fake``: output shapes and dtypes, no compute), so
that ``torch.compile(fullgraph=True)`` traces through them without a graph break, and the forward has
its backward registered with ``register_autograd``. Their bodies (:func:`forward_body`,
:func:`backward_body`) are opaque to the compiler: plan look-ups, cuBLASLt calls and the NumPy engine
run as they do eagerly.

Eagerly a custom op's dispatch (schema checks, the autograd and fake-tensor machinery) costs host time
twice a step; :func:`fused_mlp_apply` skips it outside ``torch.compile``: :class:`FusedMLPFunction`, a
``torch.autograd.Function`` whose forward and backward call the same bodies and save the same tensors
(the results are the op's, bit for bit), or under ``torch.no_grad()`` the forward body alone.

The forward returns one list, ``[y, *hidden, *aux_t]``: the output, then (when it keeps what the
backward needs) each layer's input but the first and each activation's aux, all C-contiguous
(:class:`mlptrain.torch.chain.Saved`). Outputs are new tensors, never views of the inputs.

The backward is first-order only: cuBLASLt's DRELU / DGELU / BGRAD epilogs have no derivative of their
own. Under ``create_graph=True`` (a gradient penalty) its gradients come out with a grad_fn that raises
:class:`SecondOrderError` when they are differentiated, instead of a second-order term silently left out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mlptrain.base.errors import MlptrainError
from mlptrain.torch import chain
from mlptrain.torch.engines import aux_shape_t, engine_for, to_arrays, to_tensors


class SecondOrderError(MlptrainError, RuntimeError):
    """A second-order gradient (double backward) was asked of the fused chain, whose backward has none."""


SECOND_ORDER = (
    "FusedMLP/FusedLinear have no second-order gradient: their backward (cuBLASLt's DRELU/DGELU and BGRAD "
    "epilogs) is not differentiable, so a term that differentiates their gradients again (a gradient penalty "
    "from torch.autograd.grad(..., create_graph=True)) cannot be computed; use nn.Sequential of nn.Linear for "
    "that model"
)


class _NoSecondOrder(torch.autograd.Function):
    """The identity on a gradient of the chain, whose own backward raises :class:`SecondOrderError`."""

    @staticmethod
    def forward(ctx: Any, g: Tensor) -> Tensor:
        return g.clone()

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> Tensor:
        raise SecondOrderError(SECOND_ORDER)


def _first_order(grads: list[Tensor]) -> list[Tensor]:
    """``grads`` as they are, or under ``create_graph=True`` (grad mode on in a backward) each tied to a
    :class:`_NoSecondOrder` node, so that differentiating them again raises instead of giving zero."""
    if not torch.is_grad_enabled():
        return grads
    return [_NoSecondOrder.apply(g.detach().requires_grad_(True)) for g in grads]


def forward_body(x: Tensor, weights: list[Tensor], biases: list[Tensor], activations: str, keep: bool) -> list[Tensor]:
    """``[y (B, out), *hidden, *aux_t]``: ``x (B, in)`` through the layers ``weights[l] (out, in)``, ``biases[l]
    (out,)`` (none: ``[]``); ``activations`` one per layer, comma-separated (``"relu,relu,none"``); ``keep``:
    write the aux and keep the layer inputs for a backward (training), else the epilogs without aux (no_grad)."""
    eng = engine_for(x)
    xa, *params = to_arrays(eng, [x, *weights, *biases])
    n = len(weights)
    y, saved = chain.forward(eng, xa, params[:n], params[n:], activations.split(","), keep)
    return to_tensors(eng, [y, *saved.hidden, *saved.aux_t])


@torch.library.custom_op("mlptrain::fused_mlp", mutates_args=())
def fused_mlp(
    x: Tensor, weights: list[Tensor], biases: list[Tensor], activations: str, keep: bool, bgrad: str
) -> list[Tensor]:
    """:func:`forward_body` as an operator; ``bgrad`` is the backward's (``"auto"`` or one strategy per hidden
    layer, comma-separated)."""
    return forward_body(x, weights, biases, activations, keep)


@fused_mlp.register_fake
def _fused_mlp_fake(
    x: Tensor, weights: list[Tensor], biases: list[Tensor], activations: str, keep: bool, bgrad: str
) -> list[Tensor]:
    B = x.shape[0]
    out = [x.new_empty((B, weights[-1].shape[0]))]
    if keep:
        acts = activations.split(",")
        out += [x.new_empty((B, W.shape[0])) for W in weights[:-1]]
        for W, act in zip(weights, acts, strict=True):
            if act != "none":
                dtype = torch.uint8 if act == "relu" else x.dtype
                out.append(x.new_empty(aux_shape_t(act, W.shape[0], B), dtype=dtype))
    return out


def backward_body(
    dy: Tensor,
    x: Tensor,
    weights: list[Tensor],
    saved: list[Tensor],
    activations: str,
    bias: bool,
    bgrad: str,
    input_grad: bool,
) -> list[Tensor]:
    """``[dx (if input_grad), *dW, *db (if bias)]`` from ``dy (B, out)`` and what the forward kept (``saved``)."""
    eng = engine_for(x)
    n = len(weights)
    acts = activations.split(",")
    arrays = to_arrays(eng, [dy, x, *weights, *saved])
    dya, xa, ws, rest = arrays[0], arrays[1], arrays[2 : 2 + n], arrays[2 + n :]
    kept = chain.Saved(hidden=rest[: n - 1], aux_t=rest[n - 1 :])
    choice = resolve_bgrad(eng, bgrad, [int(x.shape[1])] + [int(W.shape[0]) for W in weights], x, acts)
    dx, dws, dbs = chain.backward(
        eng, dya, xa, ws, acts, kept, bias=bias, bias_in_wgrad=[c == "bgradb" for c in choice], input_grad=input_grad
    )
    return to_tensors(eng, ([dx] if input_grad else []) + dws + dbs)


@torch.library.custom_op("mlptrain::fused_mlp_backward", mutates_args=())
def fused_mlp_backward(
    dy: Tensor,
    x: Tensor,
    weights: list[Tensor],
    saved: list[Tensor],
    activations: str,
    bias: bool,
    bgrad: str,
    input_grad: bool,
) -> list[Tensor]:
    """:func:`backward_body` as an operator."""
    return backward_body(dy, x, weights, saved, activations, bias, bgrad, input_grad)


@fused_mlp_backward.register_fake
def _fused_mlp_backward_fake(
    dy: Tensor,
    x: Tensor,
    weights: list[Tensor],
    saved: list[Tensor],
    activations: str,
    bias: bool,
    bgrad: str,
    input_grad: bool,
) -> list[Tensor]:
    out = [torch.empty_like(x)] if input_grad else []
    out += [torch.empty_like(W) for W in weights]
    if bias:
        out += [W.new_empty((W.shape[0],)) for W in weights]
    return out


def resolve_bgrad(eng: object, bgrad: str, widths: list[int], x: Tensor, acts: list[str]) -> list[str]:
    """One strategy per hidden layer: as given, or for ``"auto"`` the choice mlptrain makes for this shape
    (``bgradb`` on the CPU, where both do the same work; on a GPU :meth:`TorchCublasLtGemm.choose_bgrad`)."""
    hidden = len(widths) - 2
    if bgrad != "auto":
        return bgrad.split(",") if hidden else []
    choose = getattr(eng.gemm, "choose_bgrad", None)  # type: ignore[attr-defined]
    if choose is None or hidden == 0:
        return ["bgradb"] * hidden
    return choose(eng, widths, int(x.shape[0]), x.dtype, acts[0])


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: list[Tensor]) -> None:
    x, weights, biases, activations, keep, bgrad = inputs
    ctx.n = len(weights)  # type: ignore[attr-defined]
    ctx.meta = (activations, bool(biases), keep, bgrad)  # type: ignore[attr-defined]
    ctx.save_for_backward(x, *weights, *output[1:])


def _gradients(ctx: Any, dy: Tensor | None, backward: Any) -> tuple[Tensor | None, list[Tensor], list[Tensor]]:
    """``(dx or None, dWs, dbs)`` from what ``ctx`` saved, through ``backward`` (the op, or its body)."""
    activations, bias, keep, bgrad = ctx.meta
    if not keep:
        raise RuntimeError("mlptrain::fused_mlp ran with keep=False (no aux kept): it has no backward")
    n = ctx.n
    x, *rest = ctx.saved_tensors
    weights, saved = rest[:n], rest[n:]
    dy = dy if dy is not None else x.new_zeros((x.shape[0], weights[-1].shape[0]))  # y unused
    input_grad = bool(ctx.needs_input_grad[0])
    with torch.no_grad():  # create_graph=True runs this in grad mode: the bodies are not differentiable
        out = backward(dy.contiguous(), x, weights, saved, activations, bias, bgrad, input_grad)
    out = _first_order(out)
    dx = out.pop(0) if input_grad else None
    return dx, out[:n], (out[n:] if bias else [])


def _backward(ctx: torch.autograd.function.FunctionCtx, grads: list[Tensor | None]) -> tuple:
    dx, dws, dbs = _gradients(ctx, grads[0], fused_mlp_backward)
    return dx, dws, dbs, None, None, None


torch.library.register_autograd("mlptrain::fused_mlp", _backward, setup_context=_setup_context)


class FusedMLPFunction(torch.autograd.Function):
    """The eager twin of ``mlptrain::fused_mlp`` with its registered backward: the same bodies, called directly.

    ``apply(x, activations, bgrad, n, *weights, *biases) -> y (B, out)``; saves ``x``, the weights, each
    layer's input but the first and each aux (:class:`mlptrain.torch.chain.Saved`), as the op's
    ``setup_context`` does. Its backward returns ``(dx, None, None, None, *dW, *db)``.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, activations: str, bgrad: str, n: int, *params: Tensor) -> Tensor:
        weights, biases = list(params[:n]), list(params[n:])
        out = forward_body(x, weights, biases, activations, True)
        ctx.n, ctx.meta = n, (activations, bool(biases), True, bgrad)
        ctx.save_for_backward(x, *weights, *out[1:])
        ctx.set_materialize_grads(False)  # an unused y gives None, as the op's backward sees it
        return out[0]

    @staticmethod
    def backward(ctx: Any, dy: Tensor | None) -> tuple:
        dx, dws, dbs = _gradients(ctx, dy, backward_body)
        return (dx, None, None, None, *dws, *dbs)


DIRECT = True  # eager calls skip the operators' dispatch (the CPU tests turn it off to compare)


def fused_mlp_apply(
    x: Tensor, weights: list[Tensor], biases: list[Tensor], activations: str, keep: bool, bgrad: str
) -> Tensor:
    """``y (B, out)`` of the fused chain, with autograd's backward when ``keep``.

    Under ``torch.compile`` (and for a tensor subclass: fake, functional, ...) the registered operator, so
    that the compiler traces it; eagerly :class:`FusedMLPFunction`, or without a backward the forward body.
    """
    if not DIRECT or torch.compiler.is_compiling() or type(x) is not torch.Tensor:
        return fused_mlp(x, weights, biases, activations, keep, bgrad)[0]
    if not keep:
        return forward_body(x, weights, biases, activations, False)[0]
    return FusedMLPFunction.apply(x, activations, bgrad, len(weights), *weights, *biases)
