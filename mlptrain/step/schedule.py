"""The step counter and the learning-rate schedule, both kept on the device.

:class:`StepClock` is the one place a run counts optimizer steps. It has two halves that move
together: ``n``, the host count the training loop reads without waiting for the device, and
``device``, a 0-d int64 array that the step's own last kernel advances, so that a step captured
into a CUDA graph still knows which step it is when it is replayed. :meth:`Trainer.step` advances
``n``; the end-of-step bookkeeping (:mod:`mlptrain.step.steplog`) advances ``device``.

:class:`LRSchedule` keeps the rate of the current step in a 0-d device array, recomputed on the
device from the device count after every step.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mlptrain.base.backend import scalar
from mlptrain.base.cuda_source import c_literal
from mlptrain.base.errors import ConfigError
from mlptrain.config.schema import SCHEDULES


class StepClock:
    """Optimizer steps taken (skipped fp16 steps included): host count ``n``, device mirror ``device``."""

    def __init__(self, xp: Any, n: int = 0) -> None:
        self.xp = xp
        self.n = int(n)
        self.device = scalar(xp, n, np.int64)

    def tick(self) -> None:
        """The host half: one more step has been launched."""
        self.n += 1

    def advance_device(self) -> None:
        """The device half, on the CPU (on the GPU the step's last kernel runs :meth:`cuda_advance`)."""
        self.device += 1

    @staticmethod
    def cuda_advance(lvalue: str) -> str:
        """The device half as a CUDA statement on the int64 lvalue holding the count."""
        return f"{lvalue} += 1;"

    def set(self, n: int) -> None:
        """Continue counting from ``n`` (resume)."""
        self.n = int(n)
        self.device[...] = n


def lr_at(step: int, *, base_lr: float, total_steps: int, schedule: str, warmup_steps: int = 0, min_ratio=0.0):
    """Learning rate of (0-based) optimizer step ``step``.

    Linear warm-up from ``base_lr / warmup_steps`` to ``base_lr`` over ``warmup_steps`` steps, then
    ``constant`` or ``cosine`` decay to ``base_lr * min_ratio`` at ``total_steps - 1``.
    """
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    if schedule == "cosine":
        span = max(total_steps - warmup_steps - 1, 1)
        progress = min((step - warmup_steps) / span, 1.0)
        return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    raise ConfigError(f"schedule {schedule!r} is unknown; expected one of {', '.join(SCHEDULES)}")


class LRSchedule:
    """:func:`lr_at` kept in device memory: ``lr`` (0-d float64) is the rate of step ``clock.device``.

    After each step the rate moves on with the count, on the device, with no host value in the
    launch: the training step fuses :meth:`cuda_update` into its last kernel (:mod:`mlptrain.step.steplog`);
    on the CPU :meth:`update` runs :func:`lr_at` on the host.
    """

    def __init__(
        self,
        xp: Any,
        clock: StepClock,
        *,
        base_lr: float,
        total_steps: int,
        schedule: str,
        warmup_steps: int = 0,
        min_ratio=0.0,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ConfigError(f"schedule {schedule!r} is unknown; expected one of {', '.join(SCHEDULES)}")
        self.xp = xp
        self.clock = clock
        self.kw = dict(
            base_lr=base_lr, total_steps=total_steps, schedule=schedule, warmup_steps=warmup_steps, min_ratio=min_ratio
        )
        self.lr = scalar(xp, self.host(clock.n), np.float64)

    def host(self, step: int) -> float:
        """The rate of ``step``, computed on the host (for logs)."""
        return lr_at(step, **self.kw)

    def update(self) -> None:
        """CPU: ``lr = lr_at(clock.device)``, after the clock moved."""
        if self.xp is not np:
            raise RuntimeError("on the GPU the step's last kernel updates the rate (cuda_update)")
        self.lr[...] = self.host(int(self.clock.device))

    def sync(self) -> None:
        """Recompute ``lr`` from the clock's host count (after :meth:`StepClock.set`)."""
        self.lr[...] = self.host(self.clock.n)

    def cuda_update(self, step: str, lr: str) -> str:
        """CUDA statement setting the float64 lvalue ``lr`` to the rate of the int64 ``step``."""
        kw = self.kw
        args = (
            f"{c_literal(kw['base_lr'])}, {int(kw['total_steps'])}LL, {int(kw['warmup_steps'])}LL, "
            f"{'true' if kw['schedule'] == 'cosine' else 'false'}, {c_literal(kw['min_ratio'])}"
        )
        return f"{lr} = mlptrain_lr_at({step}, {args});"


LR_AT_CUDA = """
// lr_at() of mlptrain/step/schedule.py: linear warm-up, then constant or cosine decay.
__device__ double mlptrain_lr_at(long long step, double base, long long total, long long warmup, bool cosine,
                                 double min_ratio) {
    if (step < warmup) return base * (double)(step + 1) / (double)warmup;
    if (!cosine) return base;
    const long long span = max(total - warmup - 1, 1LL);
    const double progress = min((double)(step - warmup) / (double)span, 1.0);
    return base * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + cos(3.141592653589793 * progress)));
}
"""
