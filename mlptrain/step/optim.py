"""Optimizers: SGD with momentum/Nesterov, Adam, AdamW; :data:`OPTIMIZERS`, the registry of them.

One update rule per optimizer, written twice with the same arithmetic: as NumPy expressions
for the CPU (one parameter at a time) and as the CUDA body of one element for the GPU, where a
single multi-tensor kernel (:mod:`mlptrain.step.cuda.multitensor`) applies it to every parameter of the
model. Per element it reads the gradient, updates the master weight and the optimizer state, and
writes the half-precision compute copy, in a single pass over memory.

Per-step scalars (learning rate, inverse loss scale, the skip flag of an overflowing fp16 step,
Adam's step count) are 0-d device arrays read inside the kernel, not host numbers baked into the
launch, so a step never waits on the host and can be captured into a CUDA graph. Hyperparameters
(momentum, betas, weight decay) are fixed per optimizer and compiled in as constants.

Semantics follow ``torch.optim``: SGD ``buf = momentum * buf + g`` (buf starts at 0, which equals
torch's first-step ``buf = g``), Nesterov ``g + momentum * buf``; weight decay adds ``wd * p`` to the
gradient (L2) in SGD and Adam, and is decoupled in AdamW (``p *= 1 - lr * wd``).

A new optimizer is one class registered with :func:`register_optimizer`, naming the settings of
``OptimizerConfig`` it reads with their ranges in :attr:`Optimizer.settings`, and one
``conf/optimizer/<name>.yaml``: the checks (ranges, settings the chosen optimizer does not use),
``--help`` and :func:`mlptrain.step.build.optimizer` read the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from mlptrain.base import optim_state
from mlptrain.base.backend import get_array_module, scalar
from mlptrain.base.cuda_source import Job, KernelTail, c_literal
from mlptrain.base.errors import ConfigError
from mlptrain.base.member_settings import MEMBER_PARAMS, MemberSettings, member_update_cuda
from mlptrain.base.registry import NON_NEGATIVE, POSITIVE, UNIT, Range, Registry
from mlptrain.nn.layers import Param

NESTEROV_NEEDS_MOMENTUM = "optimizer.nesterov=true needs optimizer.momentum > 0"


@dataclass(frozen=True)
class OptimizerSpec:
    """A registered optimizer: its class and the constant keywords it is built with (adamw: ``decoupled``)."""

    cls: type[Optimizer]
    options: dict[str, Any] = field(default_factory=dict)

    def build(self, cfg: Any, params: list[Param]) -> Optimizer:
        """The optimizer of ``cfg`` (an ``OptimizerConfig``) over ``params``."""
        return self.cls.from_config(cfg, params, **self.options).set_state_dtype(getattr(cfg, "state_dtype", None))


OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer.name")


def setting_ranges() -> dict[str, Range | None]:
    """``optimizer.<key>`` -> its range, for every setting a registered optimizer reads (one range per key)."""
    ranges = dict(Optimizer.COMMON)
    for name, spec in OPTIMIZERS.items():
        for key, r in spec.cls.settings.items():
            if ranges.setdefault(key, r) != r:
                raise ValueError(f"optimizer={name} declares optimizer.{key} {r}, another optimizer {ranges[key]}")
    return ranges


def users(key: str) -> list[str]:
    """The registered optimizers that read ``optimizer.<key>`` (beyond :attr:`Optimizer.COMMON`)."""
    return [name for name, spec in OPTIMIZERS.items() if key in spec.cls.settings]


def register_optimizer(name: str, help: str = "", **options: Any) -> Callable[[type[Optimizer]], type[Optimizer]]:
    """Class decorator: register the optimizer as ``optimizer.name=<name>``, built with ``options``."""

    def add(cls: type[Optimizer]) -> type[Optimizer]:
        OPTIMIZERS.add(name, OptimizerSpec(cls, dict(options)), help)
        return cls

    return add


class Optimizer:
    """Base class: per-parameter state, the step counter, and state dicts.

    Subclasses implement :meth:`_update_numpy` (one parameter, NumPy) and :meth:`_cuda_update`
    (one element, CUDA, run over all parameters in one kernel), and declare in :attr:`settings` the
    settings of ``OptimizerConfig`` they take as keywords besides :data:`COMMON`'s, each with its range.
    """

    state_names: tuple[str, ...] = ()
    # optimizer.<key> -> its range (None: any value), read by every optimizer / by this one
    COMMON: ClassVar[dict[str, Range | None]] = {"lr": POSITIVE, "weight_decay": NON_NEGATIVE, "state_dtype": None}
    settings: ClassVar[dict[str, Range | None]] = {}
    narrow_state: ClassVar[bool] = False  # the update widens and rounds its state (mlptrain.base.optim_state)
    wide_states: ClassVar[tuple[str, ...]] = ()  # states kept in the master dtype under a narrow state_dtype
    state_dtype: np.dtype  # the setting's (set_state_dtype); each state's dtype in state_dtypes

    @classmethod
    def from_config(cls, cfg: Any, params: list[Param], **options: Any) -> Optimizer:
        """The optimizer from ``cfg`` (an ``OptimizerConfig``): ``lr``, ``weight_decay`` and :attr:`settings`."""
        values = {k: getattr(cfg, k) for k in cls.settings}
        return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **values, **options)

    @classmethod
    def config_problems(cls, cfg: Any) -> list[str]:
        """What the settings of ``cfg`` say wrong together beyond one range each (SGD: Nesterov without momentum)."""
        return []

    @classmethod
    def check(cls, **values: Any) -> None:
        """ConfigError for a value outside its declared range (the wording of :mod:`mlptrain.step.checks`)."""
        for key, value in values.items():
            if (r := {**cls.COMMON, **cls.settings}[key]) is not None:
                r.check(f"optimizer.{key}", value)

    def __init__(self, params: list[Param], *, lr: float, weight_decay: float = 0.0) -> None:
        Optimizer.check(lr=lr, weight_decay=weight_decay)
        self.params = params
        self.lr, self.weight_decay = lr, weight_decay
        self.xp = get_array_module(params[0].value)
        self.set_state_dtype(None)  # per-parameter state in the master dtype, zero-initialised
        # Updates applied (skipped fp16 steps excluded), on the device: Adam's t, per-optimizer state as
        # torch.optim keeps it. Not a step counter of the run: that is mlptrain.step.schedule.StepClock.
        self.t = self.xp.zeros((), dtype=self.xp.float64)
        self._one = scalar(self.xp, 1.0, np.float64)
        self._no_skip = self.xp.zeros((), dtype=self.xp.int32)
        self._kernels: dict[Any, Any] = {}  # GPU multi-tensor kernels by tail and member count, built at first use
        self.members: MemberSettings | None = None  # an ensemble's per-member settings, else None

    def set_state_dtype(self, name: str | None) -> Optimizer:
        """The state in ``optimizer.state_dtype=name`` (None: the master's), zeros unless in it; returns ``self``."""
        dtype, dtypes, narrow = optim_state.layout(name, self)
        if "state_dtype" not in vars(self) or self.state_dtype != dtype:  # (null leaves a built state alone)
            self.state_dtype, self.state_dtypes, self.narrow = dtype, dtypes, narrow  # narrow: the kernel's S roles
            self.state = optim_state.zeros(self.xp, self.params, dtypes)
        return self

    def step(self, lr: Any, inv_scale: Any = None, skip: Any = None, tail: KernelTail | None = None) -> None:
        """Apply one update to every parameter from its ``grad``.

        On the GPU this is one multi-tensor kernel for the whole model (:mod:`mlptrain.step.cuda.multitensor`);
        on the CPU one NumPy update per parameter.

        Args:
            lr: 0-d device array, the learning rate of this step.
            inv_scale: 0-d device array multiplying every gradient (1 / loss scale), or None.
            skip: 0-d int32 device array; non-zero skips the update (an fp16 overflow), or None.
            tail: GPU only: work for the kernel's last block, after every parameter is updated
                (the training step's bookkeeping, :meth:`mlptrain.step.steplog.StepLog.tail`).
        """
        xp = self.xp
        inv_scale = self._one if inv_scale is None else inv_scale
        skip = self._no_skip if skip is None else skip
        for p in self.params:
            if p.grad is None:
                raise RuntimeError(f"parameter {p.name} has no gradient; run backward before step")
        if xp is not np:  # t (applied steps) advances in the kernel's last block
            per_member = self.members.device_arrays() if self.members is not None else ()
            kernel = self._multi_tensor_kernel(tail)
            kernel(*self._tensors(), lr, inv_scale, skip, self.t, *per_member, *(tail.args if tail else ()))
            return
        if tail is not None:
            raise ValueError("a kernel tail needs the GPU; on the CPU run the bookkeeping after step()")
        self.t += skip == 0  # counts applied steps (Adam's bias correction)
        if skip:
            return
        for p in self.params:
            if self.members is None:
                self._update_numpy(p, self.state[p.name], float(lr), float(inv_scale))
            else:
                self._update_members(p, float(inv_scale))
            p.sync_compute()  # the half-precision copy the GEMMs read (the CuPy kernel writes it too)

    def _update_members(self, p: Param, inv_scale: float) -> None:
        """An ensemble with per-member settings (:class:`MemberSettings`): member ``k``'s slice of ``p`` updated
        as a single model of its learning rate and weight decay is; a frozen member's not at all."""
        m, decay = self.members, self.weight_decay
        assert m is not None
        try:
            for k in range(len(m.lr)):
                if m.frozen[k]:
                    continue
                view = Param(p.name, p.value[k], p.value.dtype)  # member k's slice: a view, updated in place
                view.grad = p.grad[k]
                self.weight_decay = m.weight_decay[k]
                self._update_numpy(view, {s: a[k] for s, a in self.state[p.name].items()}, m.lr[k], inv_scale)
        finally:
            self.weight_decay = decay

    # --- the GPU path: one kernel for all parameters -------------------------------------------

    def _roles(self) -> list[tuple[str, str]]:
        """Per-tensor arrays of the update: gradient, master weight, state, compute copy."""
        roles = [("g", "G"), ("p", "P")] + [(s, "S" if s in self.narrow else "P") for s in self.state_names]
        return roles + ([("pc", "C")] if self.params[0].has_compute_copy else [])

    def _tensors(self) -> list[list[Any]]:
        lists = [[p.grad for p in self.params], [p.value for p in self.params]]
        lists += [[self.state[p.name][s] for p in self.params] for s in self.state_names]
        return lists + ([[p.compute for p in self.params]] if self.params[0].has_compute_copy else [])

    def _multi_tensor_kernel(self, tail: KernelTail | None) -> Any:
        """The update kernel; an ensemble with per-member settings gets its per-member form (each element's member
        from the stacked layout, its rate, weight decay and frozen flag read from :class:`MemberSettings`' arrays)."""
        k = self.members.members if self.members is not None else 0
        key = ((tail.code, tail.params) if tail else None, k)
        if key not in self._kernels:
            from mlptrain.step.cuda.multitensor import MultiTensorKernel

            if len({p.has_compute_copy for p in self.params}) != 1:
                raise ValueError("all parameters must have a compute copy, or none")
            # (an optimizer of one's own whose _cuda_update takes no per_member serves runs without per-member settings)
            loop_prep, body = self._cuda_update(per_member=True) if k else self._cuda_update()
            body += "$pc = (C)$p;" if self.params[0].has_compute_copy else ""
            self._kernels[key] = MultiTensorKernel(
                f"mlptrain_{type(self).__name__.lower()}_step" + ("_members" if k else ""),
                self._roles(),
                [p.value.size for p in self.params],
                member_update_cuda(body) if k else body,
                extra_params="raw float64 lr, raw float64 inv_scale, raw int32 skip, raw float64 t"
                + (f", {MEMBER_PARAMS}" if k else "")
                + (f", {tail.params}" if tail else ""),
                loop_prep="const bool skipped = skip[0] != 0;\n"
                + ("" if k else "const P lr_v = (P)lr[0];\n")
                + "const P inv_s = (P)inv_scale[0];\n"
                + loop_prep,
                members=k,
                epilogue="if (!skipped) t[0] += 1.0;  // one more applied step\n" + (tail.code if tail else ""),
                preamble=tail.preamble if tail else "",
            )
        return self._kernels[key]

    def _cuda_update(self, per_member: bool = False) -> tuple[str, str]:
        """``(loop_prep, body)`` of the CUDA update of one element (see :class:`MultiTensorKernel`), at the rate
        ``lr_v``; ``per_member``: the weight decay is the element's member's, ``wd_m`` (``wd_d`` in float64), and its
        rate ``lr_m`` in float64 (:func:`~mlptrain.base.member_settings.member_update_cuda`), not the run's."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Host NumPy arrays by ``"<param>/<state>"``, and ``"t"``; a bfloat16 state as its bits (``to_file``)."""
        return optim_state.to_host(self.state, self.t)

    def load_state_dict(self, arrays: dict[str, Any]) -> list[str]:
        """Inverse of :meth:`state_dict` (names, shapes exact); returns the keys widened from an older bfloat16."""
        return optim_state.load(self.xp, self.state, self.t, arrays, optim_state.kept_wide(self))

    def _update_numpy(self, p: Param, st: dict[str, Any], lr: float, inv_scale: float) -> None:
        raise NotImplementedError

    # --- compiled ahead (mlptrain.step.cuda.precompile) -----------------------------------------------

    def precompile_jobs(self, grad_dtype: Any, step_args: tuple[Any, Any, Any], tail: Any = None) -> list[Any]:
        """:meth:`step`'s kernel compiled ahead (a :class:`~mlptrain.base.cuda_source.Job`): the same call, on a copy
        holding zeros, with its own kernel cache, parameters, gradients (``grad_dtype``), state and count.

        ``step_args``: the step's ``lr, inv_scale, skip`` (zeros of their dtypes are passed); ``tail()``: the
        step's tail on zeros (:meth:`mlptrain.step.steplog.StepLog.scratch_tail`), or None.
        """
        g = np.dtype(grad_dtype)
        state = sum(int(a.nbytes) for st in self.state.values() for a in st.values())
        copies = sum(int(p.value.nbytes) + p.value.size * g.itemsize * (1 + p.has_compute_copy) for p in self.params)
        name = f"mlptrain_{type(self).__name__.lower()}_step" + (" (and the step log's tail)" if tail else "")
        return [Job(name, "update", lambda: self._compile_step(g, step_args, tail), state + copies)]

    def _compile_step(self, grad_dtype: Any, step_args: tuple[Any, Any, Any], tail: Any) -> None:
        import copy

        xp, kernel_tail = self.xp, tail() if tail is not None else None
        opt = copy.copy(self)
        opt._kernels = {}  # its own kernel object (its own block counter); the run's finds the compiled code
        opt.params = []
        for p in self.params:
            q = copy.copy(p)
            q.value = xp.zeros_like(p.value)
            q.compute = xp.zeros_like(p.compute) if p.has_compute_copy else q.value
            q.grad = xp.zeros(p.value.shape, grad_dtype)
            opt.params.append(q)
        opt.state = {name: {s: xp.zeros_like(a) for s, a in st.items()} for name, st in self.state.items()}
        opt.t = xp.zeros_like(self.t)
        lr, inv_scale, skip = (xp.zeros_like(a) for a in step_args)
        opt.step(lr, inv_scale, skip, tail=kernel_tail)


@register_optimizer("sgd")
class SGD(Optimizer):
    """SGD with optional (Nesterov) momentum and L2 weight decay."""

    settings = {"momentum": UNIT, "nesterov": None}
    narrow_state = True

    def __init__(
        self,
        params: list[Param],
        *,
        lr: float,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
    ) -> None:
        self.check(momentum=momentum)
        if nesterov and momentum == 0:
            raise ConfigError(NESTEROV_NEEDS_MOMENTUM)
        self.state_names = ("momentum",) if momentum > 0 else ()
        super().__init__(params, lr=lr, weight_decay=weight_decay)
        self.momentum = momentum
        self.nesterov = nesterov

    @classmethod
    def config_problems(cls, cfg: Any) -> list[str]:
        return [NESTEROV_NEEDS_MOMENTUM] if cfg.nesterov and not cfg.momentum > 0 else []

    def _update_numpy(self, p: Param, st: dict[str, Any], lr: float, inv_scale: float) -> None:
        g = p.grad.astype(p.value.dtype) * inv_scale + self.weight_decay * p.value
        if self.momentum > 0:
            buf = optim_state.widen(st["momentum"], p.value.dtype)  # (the state itself unless stored narrower)
            buf *= self.momentum
            buf += g
            optim_state.store(st, momentum=buf)
            g = g + self.momentum * buf if self.nesterov else buf
        p.value -= lr * g

    def _cuda_update(self, per_member: bool = False) -> tuple[str, str]:
        lit = c_literal
        wd = "wd_m" if per_member else f"(P){lit(self.weight_decay)}"
        body = f"if (!skipped) {{ P g = (P)$g * inv_s + {wd} * $p;"
        if self.momentum > 0:  # the momentum read and widened, updated, stored (rounded when narrow)
            mu, old = f"(P){lit(self.momentum)}", optim_state.cuda_read("momentum", "momentum" in self.narrow)
            body += f"const P buf = {mu} * {old} + g; {optim_state.cuda_store(self.narrow, momentum='buf')}"
            body += f"g = g + {mu} * buf;" if self.nesterov else "g = buf;"
        return "", body + "$p = $p - lr_v * g; }"


@register_optimizer("adamw", decoupled=True)
@register_optimizer("adam")
class Adam(Optimizer):
    """Adam (``decoupled=False``, L2 weight decay) and AdamW (``decoupled=True``)."""

    state_names = ("exp_avg", "exp_avg_sq")
    settings = {"beta1": UNIT, "beta2": UNIT, "eps": POSITIVE}
    narrow_state = True
    wide_states = ("exp_avg_sq",)  # its 0.1% decay a step is below half a bfloat16 step: rounded, it never decays

    @classmethod
    def from_config(cls, cfg: Any, params: list[Param], **options: Any) -> Optimizer:
        betas = (cfg.beta1, cfg.beta2)
        return cls(params, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **options)

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
        self.check(beta1=betas[0], beta2=betas[1], eps=eps)
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
        m, v = (optim_state.widen(st[s], p.value.dtype) for s in ("exp_avg", "exp_avg_sq"))
        m *= self.beta1
        m += (1 - self.beta1) * g
        v *= self.beta2
        v += (1 - self.beta2) * g * g
        optim_state.store(st, exp_avg=m, exp_avg_sq=v)  # (m rounded when narrow; the update goes on with m, v)
        m_hat = m / (1 - self.beta1**t)
        v_hat = v / (1 - self.beta2**t)
        p.value -= lr * m_hat / (np.sqrt(v_hat) + self.eps)

    def _cuda_update(self, per_member: bool = False) -> tuple[str, str]:
        lit = c_literal
        b1, b2, wd = lit(self.beta1), lit(self.beta2), lit(self.weight_decay)
        loop_prep = f"""
        const double t_now = t[0] + 1.0;  // this step is the (t+1)-th applied one
        const P bc1 = (P)(1.0 - pow({b1}, t_now)), bc2 = (P)(1.0 - pow({b2}, t_now));
        """
        loop_prep += "" if per_member else f"const P decay = (P)(1.0 - lr[0] * {wd});\n"
        decay = "(P)(1.0 - lr_m * wd_d)" if per_member else "decay"  # AdamW: p *= 1 - lr * wd
        body = "if (!skipped) { P g = (P)$g * inv_s;"
        body += f"$p = $p * {decay};" if self.decoupled else f"g = g + {'wd_m' if per_member else f'(P){wd}'} * $p;"
        m0, v0 = (optim_state.cuda_read(s, s in self.narrow) for s in ("exp_avg", "exp_avg_sq"))  # (widened)
        body += f"""
            const P m = (P){b1} * {m0} + (P)(1.0 - {b1}) * g, v = (P){b2} * {v0} + (P)(1.0 - {b2}) * g * g;
            {optim_state.cuda_store(self.narrow, exp_avg="m", exp_avg_sq="v")}
            const P m_hat = m / bc1, v_hat = v / bc2;
            $p = $p - lr_v * m_hat / (sqrt(v_hat) + (P){lit(self.eps)}); }}"""
        return loop_prep, body
