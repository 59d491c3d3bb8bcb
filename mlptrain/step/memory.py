"""What a training step holds in memory, by formula: the state after a step and the peak of the step's own arrays.

The GPU tests hold :func:`mlptrain.step.cuda.memory.account` and a real step's allocations to these
formulas; the CPU tests hold them to the backward's schedule (``tests/test_backward_memory.py``, which
follows every array of a NumPy step by weak reference). No CuPy here: a formula is arithmetic.

An ensemble's account is per member (:func:`member_bytes`, :func:`member_account`): its ``K`` members are
stacked on a leading axis, ``W (K, out, in)``, ``X (K, B, in)``, so every array of the step is ``K`` times
one member's, and ``run.json``'s ``memory.members`` says what one member costs and what the ``K`` do.
:func:`check_members_memory` refuses, before anything is built, K members that cannot fit in the host's memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlptrain.base.errors import ResourceError
from mlptrain.config.schema import TrainConfig, ensemble_members
from mlptrain.data.rows import host_memory_available
from mlptrain.nn.epilogs import gelu_aux_shape, relu_aux_shape
from mlptrain.nn.epilogs_fp8 import FP8_MULTIPLE


def expected_bytes(
    widths: list[int],
    batch: int,
    param_dtype: Any,
    compute_dtype: Any,
    state_per_param: int,
    compute_copy: str = "kept",
    fp8_weights: bool = False,
    state_dtype: Any = None,
    wide_states: int = 0,
) -> dict:
    """The live bytes of a fused MLP step by the formula (what :func:`account` must find after a step).

    Parameters ``P = sum(w_i w_{i+1} + w_{i+1})``: master weights ``P`` in the parameter dtype,
    compute copies ``P`` in the compute dtype (when it differs; ``compute_copy="cast"``: the shared
    buffer instead, the largest weight and the largest bias; with ``fp8_weights``, precision=fp8, the
    largest weight whose widths FP8 does not take, read through the buffer),
    gradients ``P`` in the compute dtype, optimizer state ``state_per_param x P``: in ``state_dtype``
    (``optimizer.state_dtype``; None: the parameter dtype) but for ``wide_states`` of them, kept in the
    parameter dtype (the optimizer's ``wide_states``: Adam's second moment). The saved inputs and the
    relu_aux masks are gone after a step: the backward frees each layer's once read.
    """
    sp, sc = np.dtype(param_dtype).itemsize, np.dtype(compute_dtype).itemsize
    s_state = np.dtype(state_dtype or param_dtype).itemsize
    n = sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))
    copies = sc * n
    if compute_copy == "cast":
        pairs = list(zip(widths, widths[1:], strict=False))
        fp8 = [fp8_weights and a % FP8_MULTIPLE == 0 and b % FP8_MULTIPLE == 0 for a, b in pairs]
        buffered = [a * b for (a, b), own in zip(pairs, fp8, strict=True) if not own]
        copies = sc * (max(buffered, default=0) + max(widths[1:]))
    return {
        "master_weights": sp * n,
        "compute_copies": copies if np.dtype(param_dtype) != np.dtype(compute_dtype) else 0,
        "gradients": sc * n,
        "optimizer_state": n * (s_state * (state_per_param - wide_states) + sp * wide_states),
        "saved_inputs": 0,
        "relu_aux": 0,
    }


def expected_step_peak(
    widths: list[int], batch: int, compute_dtype: Any, two_streams: bool = True, head_kernel: bool = False
) -> int:
    """The most bytes a fused ReLU step's own arrays hold at once, by the backward's schedule.

    Layer ``i`` (of ``L``) keeps its input ``X_i (B, w_i)`` (``X_0`` is the batch, held outside the
    step) and, below the top, its relu_aux mask. The logits ``(B, w_L)`` become their gradient in
    place. Alive at layer ``i`` of the backward (:meth:`mlptrain.nn.network.MLP.backward`), beside
    ``dZ_i (B, w_{i+1})`` and the weight gradients of layers ``i..L-1``:

    * one stream: what layers ``0..i`` keep, until the weight gradient has read ``X_i``; then what
      layers ``0..i-1`` keep and the new ``dZ_{i-1} (B, w_i)``;
    * two streams: what layers ``0..i+1`` keep, ``dZ_{i+1}``, and ``dZ_{i-1}`` (the layer above
      goes once ``dZ_{i-1}`` is enqueued, so that the chain never waits for its weight gradient).

    With the head kernel (``head_kernel``: :class:`mlptrain.nn.head.OutputHead` in mode ``kernel``) the
    top layer's ``dZ_{L-2}`` exists before the backward starts, so on one stream it is alive beside
    ``X_{L-1}`` too. The peak is the largest of these sums (the forward's end, with the logits, is
    never larger). The K = 1 input gradient (a single regression output) allocates temporaries of
    its own that are not counted.
    Bias-gradient vectors and the loss's per-row scalars are left out.
    """
    sc = np.dtype(compute_dtype).itemsize
    L = len(widths) - 1

    def kept(i: int) -> int:  # X_1..X_i and the masks of layers 0..i
        x = sum(batch * widths[l] * sc for l in range(1, i + 1))
        masks = sum(int(np.prod(relu_aux_shape(widths[l + 1], batch))) for l in range(min(i + 1, L - 1)))
        return x + masks

    def grads(i: int) -> int:
        return sum((widths[l] * widths[l + 1] + widths[l + 1]) * sc for l in range(i, L))

    def dz(i: int) -> int:  # dZ_i (B, w_{i+1}); none below the bottom or above the top
        return batch * widths[i + 1] * sc if 0 <= i < L else 0

    sums = []
    for i in range(L):
        if two_streams:
            sums.append(kept(min(i + 1, L - 1)) + dz(i + 1) + dz(i) + dz(i - 1) + grads(i))
        else:
            early = dz(i - 1) if head_kernel and i == L - 1 else 0  # the head kernel's dZ_{L-2}
            sums += [kept(i) + dz(i) + early + grads(i), (kept(i - 1) if i >= 1 else 0) + dz(i) + dz(i - 1) + grads(i)]
    return max(sums)


def activation_aux_bytes(width: int, batch: int, compute_dtype: Any, activation: str, mode: str) -> int:
    """What a hidden layer of ``width`` keeps of its activation for the backward at batch ``batch``: fused ReLU its
    relu_aux (uint8 ``relu_aux_shape``), naive ReLU a ``(B, out)`` bool mask; GELU its pre-activation (fused: the
    gelu_aux ``(round_up(out, 8), B)``, naive ``(B, out)``, in the compute dtype)."""
    sc = np.dtype(compute_dtype).itemsize
    if activation == "gelu":
        return sc * int(np.prod(gelu_aux_shape(width, batch) if mode == "fused" else (batch, width)))
    return int(np.prod(relu_aux_shape(width, batch))) if mode == "fused" else batch * width


def member_bytes(
    widths: list[int],
    batch: int,
    param_dtype: Any,
    compute_dtype: Any,
    state_per_param: int,
    activation: str = "relu",
    mode: str = "fused",
    state_dtype: Any = None,
    wide_states: int = 0,
) -> dict[str, int]:
    """What one member of an ensemble holds, by formula: :func:`expected_bytes`' parameters (master weights,
    compute copies, gradients, optimizer state) and, at its batch of ``batch`` rows, what its forward keeps for
    the backward (all alive when the backward starts; it frees each once read): the inputs of layers ``1..L-1``,
    ``X_i (B, w_i)`` in the compute dtype, and each hidden layer's :func:`activation_aux_bytes`."""
    out = expected_bytes(
        widths, batch, param_dtype, compute_dtype, state_per_param, state_dtype=state_dtype, wide_states=wide_states
    )
    hidden = widths[1:-1]
    out["saved_inputs"] = sum(batch * w * np.dtype(compute_dtype).itemsize for w in hidden)
    out["relu_aux"] = sum(activation_aux_bytes(w, batch, compute_dtype, activation, mode) for w in hidden)
    return out


def member_account(tr: Any) -> dict[str, Any]:
    """An ensemble trainer's memory per member and for its ``K`` members (``run.json``'s ``memory.members``).

    Measured where the arrays exist now, each stacked array's bytes over ``K``: the master weights, the compute
    copies, the optimizer state, and the gradients while a step holds them; the rest (the gradients between steps,
    the saved inputs and activation aux, which the backward frees) by :func:`member_bytes` at the batch size.
    """
    k, params, p, cfg = tr.members, tr.model.params, tr.precision, tr.cfg
    formula = member_bytes(
        tr.widths,
        cfg.data.batch_size,
        p.param_dtype,
        p.compute_dtype,
        len(tr.optimizer.state_names),
        cfg.model.activation,
        cfg.execution.mode.value,
        tr.optimizer.state_dtype,
        len(tr.optimizer.wide_states),
    )
    measured = {
        "master_weights": sum(int(q.value.nbytes) for q in params),
        "compute_copies": sum(int(q.compute.nbytes) for q in params if q.has_compute_copy),
        "optimizer_state": sum(int(a.nbytes) for st in tr.optimizer.state.values() for a in st.values()),
    }
    if all(q.grad is not None for q in params):
        measured["gradients"] = sum(int(q.grad.nbytes) for q in params)
    per = {name: measured[name] // k if name in measured else value for name, value in formula.items()}
    return {
        "members": k,
        "batch_size": cfg.data.batch_size,
        "per_member": per,
        "per_member_total": sum(per.values()),
        "total": k * sum(per.values()),
        "by_formula": sorted(set(formula) - set(measured)),
    }


def describe_members(acc: dict[str, Any]) -> str:
    """:func:`member_account` in a line (MiB)."""
    mib = 2**20
    cats = ", ".join(f"{name} {v / mib:.3f}" for name, v in acc["per_member"].items() if v)
    return (
        f"{acc['per_member_total'] / mib:.3f} MiB per member ({cats}; batch {acc['batch_size']}), "
        f"{acc['total'] / mib:.3f} MiB for the {acc['members']} members"
    )


def check_members_memory(what: str, members: int, per_member: int, advice: str) -> None:
    """Raise ResourceError (a MemoryError) before a batched run of ``members`` members of at least ``per_member`` bytes
    each is built where they cannot fit in the host's available memory: building it would fill the memory first (and
    the kernel's OOM killer end the process) rather than fail. ``what`` names the setting, ``advice`` what to do."""
    need, have = members * per_member, host_memory_available()
    if need > have:
        raise ResourceError(
            f"{what}: {members} members of at least {per_member / 2**20:.3g} MiB each need {need / 2**30:.3g} GiB, and "
            f"the host has {have / 2**30:.3g} GiB available; {advice}"
        )


def members_fit(cfg: TrainConfig, device: str) -> None:
    """An ensemble of ``ensemble.size`` (or ``ensemble.folds``) members on the CPU (``device``), checked before its
    members' seeds, loaders and parameters are made (:func:`check_members_memory`): each member holds at least
    its parameters and gradients, and the inputs its forward keeps, of a network ``1-<model.hidden>-1`` at
    ``data.batch_size`` rows (the data's widths are not read yet: a lower bound). On a GPU the device's allocator
    fails first, as one out-of-memory error naming the setting (:mod:`mlptrain.run.faults`)."""
    k = ensemble_members(cfg)
    if k < 2 or device != "cpu":
        return
    dtype = np.float64 if cfg.precision.name == "fp64" else np.float32
    per = sum(member_bytes([1, *cfg.model.hidden, 1], cfg.data.batch_size, dtype, dtype, 0).values())
    key = "ensemble.folds" if cfg.ensemble.folds else "ensemble.size"
    check_members_memory(f"{key}={k}", k, per, f"lower {key}, or train the members as separate runs")
