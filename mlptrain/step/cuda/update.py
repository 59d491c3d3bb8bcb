"""The optimizer's update on the GPU: one multi-tensor kernel over a group of the model's parameters.

:meth:`mlptrain.step.optim.Optimizer.step` updates every parameter in one launch of the optimizer's kernel
(:class:`mlptrain.step.cuda.multitensor.MultiTensorKernel`), whose last block then runs the once-a-step work: the
applied-step count ``t`` advances, and the step log's tail (:meth:`mlptrain.step.steplog.StepLog.tail`) runs. The
same kernel can also take a *group* of the parameters, without that last-block work
(:meth:`~mlptrain.step.optim.Optimizer.step_group`), so that a layer's update can start as soon as its gradients
are made, beside the rest of the backward (:class:`mlptrain.nn.network.MLP`, ``on_layer_grads``); the step's own
launch then updates the rest and counts the step (``done``: the groups already updated)::

    side:  dW_2 ── update(layer 2) ── dW_1 ── update(layer 1) ──┐
    main:  dX_2 ──────── dX_1 ──────── mask ── dW_0 ─────────────┴─ update(the rest: layer 0), t += 1, the step log

Each group's kernel is its own compiled code (the tensor sizes are compile-time constants), built once per group and
kept by the optimizer with the others (``Optimizer._kernels``, keyed by tail, member count and group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cupy as cp

from mlptrain.base.member_settings import MEMBER_PARAMS, member_update_cuda


def roles(opt: Any) -> list[tuple[str, str]]:
    """Per-tensor arrays of the update: gradient, master weight, state, compute copy."""
    out = [("g", "G"), ("p", "P")] + [(s, "S" if s in opt.narrow else "P") for s in opt.state_names]
    return out + ([("pc", "C")] if opt.params[0].has_compute_copy else [])


def tensors(opt: Any, group: Sequence[int]) -> list[list[Any]]:
    """The arrays of each role, for the parameters ``group`` (indices into ``opt.params``), in order."""
    params = [opt.params[i] for i in group]
    lists = [[p.grad for p in params], [p.value for p in params]]
    lists += [[opt.state[p.name][s] for p in params] for s in opt.state_names]
    return lists + ([[p.compute for p in params]] if opt.params[0].has_compute_copy else [])


def kernel(opt: Any, tail: Any, group: tuple[int, ...], last: bool) -> Any:
    """The update kernel of the parameters ``group``; ``last``: its last block counts the step and runs ``tail``
    (the step's own launch), else neither (a group updated early). An ensemble with per-member settings gets the
    per-member form (each element's member from the stacked layout, its rate, weight decay and frozen flag read from
    :class:`~mlptrain.base.member_settings.MemberSettings`' arrays)."""
    k = opt.members.members if opt.members is not None else 0
    key = ((tail.code, tail.params) if tail else None, k, group, last)
    if key not in opt._kernels:
        from mlptrain.step.cuda.multitensor import MultiTensorKernel

        if len({p.has_compute_copy for p in opt.params}) != 1:
            raise ValueError("all parameters must have a compute copy, or none")
        if tail is not None and not last:
            raise ValueError("the step log's tail runs in the step's own launch (last=True), not in a group's")
        # (an optimizer of one's own whose _cuda_update takes no per_member serves runs without per-member settings)
        loop_prep, body = opt._cuda_update(per_member=True) if k else opt._cuda_update()
        body += "$pc = (C)$p;" if opt.params[0].has_compute_copy else ""
        name = f"mlptrain_{type(opt).__name__.lower()}_step" + ("_members" if k else "") + ("" if last else "_early")
        opt._kernels[key] = MultiTensorKernel(
            name,
            roles(opt),
            [opt.params[i].value.size for i in group],
            member_update_cuda(body) if k else body,
            extra_params="raw float64 lr, raw float64 inv_scale, raw int32 skip, raw float64 t"
            + (f", {MEMBER_PARAMS}" if k else "")
            + (f", {tail.params}" if tail else ""),
            loop_prep="const bool skipped = skip[0] != 0;\n"
            + ("" if k else "const P lr_v = (P)lr[0];\n")
            + "const P inv_s = (P)inv_scale[0];\n"
            + loop_prep,
            members=k,
            epilogue=("if (!skipped) t[0] += 1.0;  // one more applied step\n" + (tail.code if tail else ""))
            if last
            else "",
            preamble=tail.preamble if tail else "",
        )
    return opt._kernels[key]


def launch(opt: Any, group: tuple[int, ...], last: bool, lr: Any, inv_scale: Any, skip: Any, tail: Any) -> None:
    """Update the parameters ``group`` in one launch (see :func:`kernel`), on the current stream."""
    if not group:
        raise ValueError("an update of no parameters")
    for name, a in (("lr", lr), ("inv_scale", inv_scale), ("skip", skip)):
        if not isinstance(a, cp.ndarray) or a.ndim != 0:  # a host number would be baked into a captured graph
            raise TypeError(f"the update's {name} must be a 0-d CuPy array, read on the device; got {type(a).__name__}")
    per_member = opt.members.device_arrays() if opt.members is not None else ()
    run = kernel(opt, tail, group, last)
    run(*tensors(opt, group), lr, inv_scale, skip, opt.t, *per_member, *(tail.args if tail else ()))
