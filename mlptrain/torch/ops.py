"""The fused chain as two registered PyTorch operators, so that autograd, ``torch.compile`` and CUDA graphs see them.

``mlptrain::fused_mlp`` (forward) and ``mlptrain::fused_mlp_backward`` are ``torch.library.custom_op``
operators: each has a fake-tensor rule (``register_fake``: output shapes and dtypes, no compute), so
that ``torch.compile(fullgraph=True)`` traces through them without a graph break, and the forward has
its backward registered with ``register_autograd``. Their bodies are opaque to the compiler: plan
look-ups, nvmath calls and the NumPy engine run as they do eagerly.

The forward returns one list, ``[y, *hidden, *aux_t]``: the output, then (when it keeps what the
backward needs) each layer's input but the first and each activation's aux, all C-contiguous
(:class:`mlptrain.torch.chain.Saved`). Outputs are new tensors, never views of the inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mlptrain.torch import chain
from mlptrain.torch.engines import aux_shape_t, engine_for, to_arrays, to_tensors

BGRAD_CHOICES = ("bgradb", "drelu_bgrad")


@torch.library.custom_op("mlptrain::fused_mlp", mutates_args=())
def fused_mlp(
    x: Tensor, weights: list[Tensor], biases: list[Tensor], activations: str, keep: bool, bgrad: str
) -> list[Tensor]:
    """``x (B, in)`` through the layers ``weights[l] (out, in)``, ``biases[l] (out,)`` (none: ``[]``).

    ``activations``: one per layer, comma-separated (``"relu,relu,none"``). ``keep``: write the aux
    and keep the layer inputs for a backward (training), else the epilogs without aux (no_grad).
    ``bgrad`` is the backward's (``"auto"`` or one strategy per hidden layer, comma-separated).
    """
    eng = engine_for(x)
    xa, *params = to_arrays(eng, [x, *weights, *biases])
    n = len(weights)
    y, saved = chain.forward(eng, xa, params[:n], params[n:], activations.split(","), keep)
    return to_tensors(eng, [y, *saved.hidden, *saved.aux_t])


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
    (``bgradb`` on the CPU, where both do the same work; on a GPU :meth:`TorchNvmathGemm.choose_bgrad`)."""
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


def _backward(ctx: torch.autograd.function.FunctionCtx, grads: list[Tensor | None]) -> tuple:
    activations, bias, keep, bgrad = ctx.meta  # type: ignore[attr-defined]
    if not keep:
        raise RuntimeError("mlptrain::fused_mlp ran with keep=False (no aux kept): it has no backward")
    n = ctx.n  # type: ignore[attr-defined]
    x, *rest = ctx.saved_tensors  # type: ignore[attr-defined]
    weights, saved = rest[:n], rest[n:]
    dy = grads[0] if grads[0] is not None else x.new_zeros((x.shape[0], weights[-1].shape[0]))  # y unused
    input_grad = bool(ctx.needs_input_grad[0])  # type: ignore[attr-defined]
    out = fused_mlp_backward(dy.contiguous(), x, weights, saved, activations, bias, bgrad, input_grad)
    dx = out.pop(0) if input_grad else None
    dws, dbs = out[:n], (out[n:] if bias else [])
    return dx, dws, dbs, None, None, None


torch.library.register_autograd("mlptrain::fused_mlp", _backward, setup_context=_setup_context)
