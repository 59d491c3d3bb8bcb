"""Optimizers (SGD with momentum/Nesterov, Adam, AdamW) and learning-rate schedules.

One update rule per optimizer, written twice with the same arithmetic: as NumPy expressions
for the CPU and as one fused CuPy ``ElementwiseKernel`` per parameter for the GPU, which reads
the gradient, updates the master weight and the optimizer state, and writes the half-precision
compute copy in a single pass over memory.

Per-step scalars (learning rate, inverse loss scale, the skip flag of an overflowing fp16 step)
are 0-d device arrays read inside the kernels, not host numbers baked into the launch, so a step
never waits on the host and can be captured into a CUDA graph.

Semantics follow ``torch.optim``: SGD ``buf = momentum * buf + g`` (buf starts at 0, which equals
torch's first-step ``buf = g``), Nesterov ``g + momentum * buf``; weight decay adds ``wd * p`` to the
gradient (L2) in SGD and Adam, and is decoupled in AdamW (``p *= 1 - lr * wd``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from mlptrain.backend import get_array_module
from mlptrain.errors import ConfigError
from mlptrain.layers import Param


class Optimizer:
    """Base class: per-parameter state, the step counter, and state dicts.

    Subclasses implement :meth:`_update_numpy` and :meth:`_update_cupy` for one parameter.
    """

    state_names: tuple[str, ...] = ()

    def __init__(self, params: list[Param], *, lr: float, weight_decay: float = 0.0) -> None:
        if not lr > 0:
            raise ConfigError(f"optimizer lr={lr} must be positive")
        if weight_decay < 0:
            raise ConfigError(f"optimizer weight_decay={weight_decay} must be >= 0")
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.xp = get_array_module(params[0].value)
        # Per-parameter state in the master dtype, zero-initialised.
        self.state: dict[str, dict[str, Any]] = {
            p.name: {s: self.xp.zeros_like(p.value) for s in self.state_names} for p in params
        }
        # Number of applied (not skipped) steps, on the device.
        self.t = self.xp.zeros((), dtype=self.xp.float64)
        self._one = self.xp.ones((), dtype=self.xp.float64)
        self._no_skip = self.xp.zeros((), dtype=self.xp.int32)

    def step(self, lr: Any, inv_scale: Any = None, skip: Any = None) -> None:
        """Apply one update to every parameter from its ``grad``.

        Args:
            lr: 0-d device array, the learning rate of this step.
            inv_scale: 0-d device array multiplying every gradient (1 / loss scale), or None.
            skip: 0-d int32 device array; non-zero skips the update (an fp16 overflow), or None.
        """
        xp = self.xp
        inv_scale = self._one if inv_scale is None else inv_scale
        skip = self._no_skip if skip is None else skip
        self.t += skip == 0  # counts applied steps (Adam's bias correction)
        gpu = xp is not np
        if not gpu and skip:
            return
        for p in self.params:
            if p.grad is None:
                raise RuntimeError(f"parameter {p.name} has no gradient; run backward before step")
            if gpu:
                self._update_cupy(p, self.state[p.name], lr, inv_scale, skip)
            else:
                self._update_numpy(p, self.state[p.name], float(lr), float(inv_scale))
                p.sync_compute()  # the half-precision copy the GEMMs read (the CuPy kernels write it too)

    def state_dict(self) -> dict[str, Any]:
        """Arrays (host NumPy) by ``"<param>/<state>"`` plus ``"t"``; no pickle needed."""
        to_host = (lambda a: a.get()) if self.xp is not np else np.array
        out = {f"{name}/{s}": to_host(a) for name, st in self.state.items() for s, a in st.items()}
        out["t"] = to_host(self.t)
        return out

    def load_state_dict(self, arrays: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`; shapes and names must match exactly."""
        for name, st in self.state.items():
            for s, a in st.items():
                key = f"{name}/{s}"
                if key not in arrays:
                    raise KeyError(f"optimizer state {key!r} is missing")
                src = arrays[key]
                if tuple(src.shape) != tuple(a.shape):
                    raise ValueError(f"optimizer state {key!r} has shape {tuple(src.shape)}, expected {a.shape}")
                a[...] = self.xp.asarray(src, dtype=a.dtype)
        self.t[...] = self.xp.asarray(arrays["t"])

    def _update_numpy(self, p: Param, st: dict[str, Any], lr: float, inv_scale: float) -> None:
        raise NotImplementedError

    def _update_cupy(self, p: Param, st: dict[str, Any], lr: Any, inv_scale: Any, skip: Any) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """SGD with optional (Nesterov) momentum and L2 weight decay."""

    def __init__(
        self,
        params: list[Param],
        *,
        lr: float,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
    ) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"SGD momentum={momentum} must be in [0, 1)")
        if nesterov and momentum == 0:
            raise ConfigError("SGD nesterov=True needs momentum > 0")
        self.state_names = ("momentum",) if momentum > 0 else ()
        super().__init__(params, lr=lr, weight_decay=weight_decay)
        self.momentum = momentum
        self.nesterov = nesterov

    def _update_numpy(self, p: Param, st: dict[str, Any], lr: float, inv_scale: float) -> None:
        g = p.grad.astype(p.value.dtype) * inv_scale + self.weight_decay * p.value
        if self.momentum > 0:
            buf = st["momentum"]
            buf *= self.momentum
            buf += g
            g = g + self.momentum * buf if self.nesterov else buf
        p.value -= lr * g

    def _update_cupy(self, p: Param, st: dict[str, Any], lr: Any, inv_scale: Any, skip: Any) -> None:
        buf = st.get("momentum", p.value)  # unused when momentum == 0
        outs = (p.value, buf, p.compute) if p.has_compute_copy else (p.value, buf)
        _sgd_kernel(p.has_compute_copy)(
            p.grad, lr, inv_scale, skip, self.momentum, self.weight_decay, self.nesterov, *outs
        )


class Adam(Optimizer):
    """Adam (``decoupled=False``, L2 weight decay) and AdamW (``decoupled=True``)."""

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: list[Param],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled: bool = False,
    ) -> None:
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ConfigError(f"Adam beta{i + 1}={beta} must be in [0, 1)")
        if not eps > 0:
            raise ConfigError(f"Adam eps={eps} must be positive")
        super().__init__(params, lr=lr, weight_decay=weight_decay)
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.decoupled = decoupled

    def _update_numpy(self, p: Param, st: dict[str, Any], lr: float, inv_scale: float) -> None:
        t = float(self.t)
        g = p.grad.astype(p.value.dtype) * inv_scale
        if self.decoupled:
            p.value *= 1 - lr * self.weight_decay
        else:
            g = g + self.weight_decay * p.value
        m, v = st["exp_avg"], st["exp_avg_sq"]
        m *= self.beta1
        m += (1 - self.beta1) * g
        v *= self.beta2
        v += (1 - self.beta2) * g * g
        m_hat = m / (1 - self.beta1**t)
        v_hat = v / (1 - self.beta2**t)
        p.value -= lr * m_hat / (np.sqrt(v_hat) + self.eps)

    def _update_cupy(self, p: Param, st: dict[str, Any], lr: Any, inv_scale: Any, skip: Any) -> None:
        outs = (p.value, st["exp_avg"], st["exp_avg_sq"])
        outs += (p.compute,) if p.has_compute_copy else ()
        _adam_kernel(p.has_compute_copy)(
            p.grad,
            lr,
            inv_scale,
            skip,
            self.t,
            self.beta1,
            self.beta2,
            self.eps,
            self.weight_decay,
            self.decoupled,
            *outs,
        )


def make_optimizer(name: str, params: list[Param], cfg: Any) -> Optimizer:
    """Build the optimizer ``name`` (``sgd``, ``adam``, ``adamw``) from an OptimizerConfig."""
    if name == "sgd":
        return SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
    if name in ("adam", "adamw"):
        return Adam(
            params,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            decoupled=name == "adamw",
        )
    raise ConfigError(f"optimizer {name!r} is unknown; expected one of sgd, adam, adamw")


# --- learning-rate schedules ---------------------------------------------------------------


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
    raise ConfigError(f"schedule {schedule!r} is unknown; expected constant or cosine")


class LRSchedule:
    """:func:`lr_at` evaluated on the device from a device step counter.

    ``advance()`` sets ``lr`` (0-d device array) to the rate of step ``step`` and increments
    ``step``, with no host value in the launch, so a step captured into a CUDA graph still follows
    the schedule when replayed. On the CPU it calls :func:`lr_at` directly.
    """

    def __init__(
        self, xp: Any, *, base_lr: float, total_steps: int, schedule: str, warmup_steps: int = 0, min_ratio=0.0
    ) -> None:
        if schedule not in ("constant", "cosine"):
            raise ConfigError(f"schedule {schedule!r} is unknown; expected constant or cosine")
        self.xp = xp
        self.kw = dict(
            base_lr=base_lr, total_steps=total_steps, schedule=schedule, warmup_steps=warmup_steps, min_ratio=min_ratio
        )
        self.step = xp.zeros((), dtype=xp.int64)  # optimizer steps taken, skipped fp16 steps included
        self.lr = xp.zeros((), dtype=xp.float64)

    def host(self, step: int) -> float:
        """The rate of ``step``, computed on the host (for logs)."""
        return lr_at(step, **self.kw)

    def advance(self) -> None:
        """``lr = lr_at(step); step += 1`` on the device."""
        if self.xp is np:
            self.lr[...] = self.host(int(self.step))
            self.step += 1
            return
        kw = self.kw
        _lr_kernel()(
            kw["base_lr"],
            kw["total_steps"],
            kw["warmup_steps"],
            kw["schedule"] == "cosine",
            kw["min_ratio"],
            self.step,
            self.lr,
        )

    def set_step(self, step: int) -> None:
        """Continue from ``step`` (resume)."""
        self.step[...] = step


@functools.cache
def _lr_kernel() -> Any:
    import cupy as cp

    return cp.ElementwiseKernel(
        "float64 base, int64 total, int64 warmup, bool cosine, float64 min_ratio",
        "int64 step, float64 lr",
        """
        if (step < warmup) {
            lr = base * (double)(step + 1) / (double)warmup;
        } else if (!cosine) {
            lr = base;
        } else {
            const long long span = max(total - warmup - 1, 1LL);
            const double progress = min((double)(step - warmup) / (double)span, 1.0);
            lr = base * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + cos(3.141592653589793 * progress)));
        }
        step += 1;
        """,
        "mlptrain_lr_schedule",
    )


# --- fused CuPy kernels ---------------------------------------------------------------------
# T: gradient dtype (the GEMM's: fp16/bf16/fp32/fp64), P: master dtype, C: compute-copy dtype.
# lr, inv_scale, skip, t are 0-d device arrays read as raw pointers.


@functools.cache
def _sgd_kernel(with_compute_copy: bool) -> Any:
    import cupy as cp

    out_params = "P p, P buf" + (", C pc" if with_compute_copy else "")
    body = """
    if (skip[0] == 0) {
        P g = (P)grad * (P)inv_scale[0] + (P)weight_decay * p;
        if (momentum != 0) {
            buf = (P)momentum * buf + g;
            g = nesterov ? g + (P)momentum * buf : buf;
        }
        p = p - (P)lr[0] * g;
        %s
    }
    """ % ("pc = (C)p;" if with_compute_copy else "")
    return cp.ElementwiseKernel(
        "T grad, raw float64 lr, raw float64 inv_scale, raw int32 skip, "
        "float64 momentum, float64 weight_decay, bool nesterov",
        out_params,
        body,
        "mlptrain_sgd_step",
    )


@functools.cache
def _adam_kernel(with_compute_copy: bool) -> Any:
    import cupy as cp

    out_params = "P p, P m, P v" + (", C pc" if with_compute_copy else "")
    body = """
    if (skip[0] == 0) {
        P g = (P)grad * (P)inv_scale[0];
        if (decoupled) { p = p * (P)(1.0 - lr[0] * weight_decay); } else { g = g + (P)weight_decay * p; }
        m = (P)beta1 * m + (P)(1.0 - beta1) * g;
        v = (P)beta2 * v + (P)(1.0 - beta2) * g * g;
        P m_hat = m / (P)(1.0 - pow(beta1, t[0]));
        P v_hat = v / (P)(1.0 - pow(beta2, t[0]));
        p = p - (P)lr[0] * m_hat / (sqrt(v_hat) + (P)eps);
        %s
    }
    """ % ("pc = (C)p;" if with_compute_copy else "")
    return cp.ElementwiseKernel(
        "T grad, raw float64 lr, raw float64 inv_scale, raw int32 skip, raw float64 t, "
        "float64 beta1, float64 beta2, float64 eps, float64 weight_decay, bool decoupled",
        out_params,
        body,
        "mlptrain_adam_step",
    )
