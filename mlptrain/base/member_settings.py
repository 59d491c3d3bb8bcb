"""An ensemble's per-member update settings, and where member ``k``'s elements lie in a stacked array.

An ensemble (:mod:`mlptrain.run.ensemble`) stacks its members' parameters with a leading member axis,
``W (K, out, in)``, ``b (K, out)``, C-contiguous, so the flat element ``j`` of a tensor of ``n`` elements
belongs to member ``j // (n // K)`` (:func:`member_of`; :func:`member_index_cuda` is the same expression in
CUDA, which the multi-tensor update kernel writes for every tensor).

:class:`MemberSettings` holds what differs per member in a batched sweep (``ensemble.lr``,
``ensemble.weight_decay``) or a cross-validation (a member stopped early is *frozen*: no update at all):

* on the host, for the CPU's update (:meth:`mlptrain.step.optim.Optimizer.step`, member by member): this
  step's rate of each member (set before each step from the schedule at the member's own ``lr``), its
  weight decay, and the frozen mask;
* on the device, ``(K,)`` arrays the GPU's multi-tensor update reads (:data:`MEMBER_PARAMS`): each member's
  rate as a ratio to ``optimizer.lr`` (the kernel multiplies the step's scheduled rate by it: the schedule
  is linear in its base rate), its weight decay, and the frozen flags. They are made once, so a CUDA graph
  captured once keeps reading them; freezing a member (:meth:`MemberSettings.freeze`, at an epoch's end) is
  one host-to-device copy of ``K`` flags outside the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# The kernel parameters of the device arrays, in the order MemberSettings.device_arrays gives them
MEMBER_PARAMS = "raw float64 member_lr, raw float64 member_wd, raw int32 member_frozen"


def member_stride(size: int, members: int) -> int:
    """The elements of one member in a stacked tensor of ``size`` elements (ValueError if it does not divide)."""
    if members < 1 or size % members:
        raise ValueError(f"a stacked tensor of {size} elements does not hold {members} members of one shape")
    return size // members


def member_of(index: Any, size: int, members: int) -> Any:
    """The member of the flat element ``index`` (an int or an array) of a stacked ``(K, ...)`` tensor."""
    return index // member_stride(size, members)


def member_index_cuda(size: int, members: int, index: str = "j") -> str:
    """:func:`member_of` as a CUDA expression over the ``ptrdiff_t`` flat index ``index`` (never negative)."""
    return f"(int)({index} / {member_stride(size, members)}LL)"


def member_update_cuda(body: str) -> str:
    """An optimizer's update of one element (:meth:`mlptrain.step.optim.Optimizer._cuda_update` in its per-member
    form) as member ``member``'s: skipped when the member is frozen (weights, state and compute copy untouched),
    else run with its rate ``lr_v`` (``lr_m`` in float64: the step's scheduled rate times the member's ratio) and
    its weight decay ``wd_m`` (``wd_d`` in float64)."""
    return (
        "if (member_frozen[member] == 0) {\n"
        "const double lr_m = lr[0] * member_lr[member];  // this member's rate\n"
        "const P lr_v = (P)lr_m;\n"
        "const double wd_d = member_wd[member];\n"
        "const P wd_m = (P)wd_d;\n" + body + "\n}"
    )


class MemberSettings:
    """Each member's learning rate, weight decay and frozen flag (see the module docstring).

    Args:
        xp: NumPy or CuPy: where the device arrays live.
        base_lr: ``optimizer.lr``, the base rate of the run's schedule.
        lr: each member's base rate (``ensemble.lr``), ``(K,)``.
        weight_decay: each member's weight decay (``ensemble.weight_decay``), ``(K,)``.
    """

    def __init__(self, xp: Any, base_lr: float, lr: Sequence[float], weight_decay: Sequence[float]) -> None:
        if len(lr) != len(weight_decay):
            raise ValueError(f"{len(lr)} learning rates for {len(weight_decay)} weight decays")
        self.xp = xp
        self.base_lr = [float(v) for v in lr]
        self.lr = list(self.base_lr)  # this step's rate of each member: the CPU's update reads it
        self.weight_decay = [float(v) for v in weight_decay]
        self.frozen = np.zeros(len(lr), dtype=bool)  # (K,) on the host
        # (K,) on the device, read by the GPU's update kernel (MEMBER_PARAMS): made once, never reallocated
        self.lr_ratio = xp.asarray(np.array([v / base_lr for v in self.base_lr], dtype=np.float64))
        self.decay = xp.asarray(np.array(self.weight_decay, dtype=np.float64))
        self.frozen_flags = xp.asarray(np.zeros(len(lr), dtype=np.int32))

    @property
    def members(self) -> int:
        return len(self.base_lr)

    def device_arrays(self) -> tuple[Any, Any, Any]:
        """``(member_lr, member_wd, member_frozen)`` of :data:`MEMBER_PARAMS`."""
        return self.lr_ratio, self.decay, self.frozen_flags

    def freeze(self, k: int) -> None:
        """Member ``k`` takes no more updates: the host mask, then its copy on the device (between steps: one
        host-to-device copy of ``K`` flags into the same array, so a captured CUDA graph sees it)."""
        self.frozen[k] = True
        flags = self.frozen.astype(np.int32)
        if self.xp is np:
            self.frozen_flags[...] = flags
        else:
            self.frozen_flags.set(flags)  # cupy.ndarray.set: a copy from the host on the current stream
