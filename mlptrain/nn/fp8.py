"""FP8 training: per-tensor delayed scaling, and the GEMM engine that quantises each operand.

**Delayed scaling** (Transformer Engine's ``DelayedScaling``). Every FP8 operand of every GEMM call
site (``layer1.fwd`` A, ``layer1.wgrad`` B, ...) has its own :class:`TensorScale`: a history of the
last ``H`` amaxes (``max |x|`` of the 16-bit tensor before its cast) and the scale its cast uses::

    x8      = fp8(scale * x)                          with the scale of the steps before
    history = [amax(x), history[:-1]]                 (unchanged when amax(x) is inf or NaN)
    scale   = fp8_max / (2**margin * max(history))    (unchanged while the history is all 0)

So the cast of step ``t`` uses the amaxes of steps ``t-H .. t-1``: the amax of a tensor is known only
once the tensor is made, too late for its own cast unless it is read twice (that is *current*
scaling, one more pass over memory). The first step casts with scale 1. A non-finite amax leaves the
history and scale as they were: that step's gradients hold the NaN (:func:`mlptrain.nn.epilogs_fp8.quantize`)
and the step is skipped, as an overflowing fp16 step is.

All of it is device arrays updated by array operations (on the GPU, kernels inside the captured
step): the host never reads a scale. :meth:`Fp8Scaling.state_dict` puts them in the checkpoint, so a
resumed FP8 run continues bit for bit.

**The engine** (:class:`Fp8Gemm`) is a :class:`mlptrain.nn.execution.Gemm`: it takes the 16-bit operands
the executions hand it, casts them (e4m3 for weights and activations, e5m2 for the gradient dZ) and
runs the FP8 contract of :mod:`mlptrain.nn.epilogs_fp8`, or, where FP8 cannot run (a dimension that is
not a multiple of 16: the 10-class head, a batch of 100), the 16-bit GEMM of the engine it wraps.
BGRADB has no FP8 form: the weight-gradient GEMM runs without it and the bias gradient is the sum of
the 16-bit dZ (what a cast + transpose + bias-gradient kernel computes on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mlptrain.nn.epilogs import Epilog, reduce_sum
from mlptrain.nn.epilogs_fp8 import FP8_MAX, amax, fits_fp8, matmul_fp8, quantize

# The formats of (A, B) per GEMM role and execution: dZ is the gradient operand, in e5m2.
FORMATS = {
    "fused": {"fwd": ("e4m3", "e4m3"), "dgrad": ("e4m3", "e5m2"), "wgrad": ("e4m3", "e5m2")},
    "naive": {"fwd": ("e4m3", "e4m3"), "dgrad": ("e5m2", "e4m3"), "wgrad": ("e4m3", "e5m2")},
}
# The smallest amax a scale is computed from: keeps fp8_max / amax a finite float32.
_TINY_AMAX = 1e-30


class TensorScale:
    """One FP8 tensor's delayed-scaling state: ``amax_history (H,)`` and ``scale ()``, float32 device arrays."""

    def __init__(self, xp: Any, history_len: int) -> None:
        # made on the host and copied: on the GPU no fill kernel has to be compiled for them
        self.amax_history = xp.asarray(np.zeros(history_len, dtype=np.float32))
        self.scale = xp.asarray(np.ones(1, dtype=np.float32)).reshape(())


class Fp8Scaling:
    """Delayed scaling for every FP8 tensor of a model, by name (the GEMM call site and operand).

    Args:
        xp: the array module the state lives in.
        amax_history: ``H``, the steps of amax the scale is taken from (``precision.amax_history``).
        margin: the scale leaves ``2**margin`` of headroom below the format's max (``precision.fp8_margin``).
    """

    def __init__(self, xp: Any, *, amax_history: int = 16, margin: int = 0) -> None:
        if amax_history < 1:
            raise ValueError(f"amax_history={amax_history} must be >= 1")
        self.xp = xp
        self.history_len = amax_history
        self.margin = margin
        self.tensors: dict[str, TensorScale] = {}

    def get(self, name: str) -> TensorScale:
        """The state of tensor ``name``, made (scale 1, an empty history) the first time it is asked for."""
        if name not in self.tensors:
            self.tensors[name] = TensorScale(self.xp, self.history_len)
        return self.tensors[name]

    def quantize(
        self, name: str, x: Any, fmt: str, record: bool = True, order: str = "K", via: Any = None
    ) -> tuple[Any, Any]:
        """``(fp8(scale * x), 1 / scale)`` with tensor ``name``'s current scale; then, with ``record``, its amax
        enters the history and the scale for the next step is computed (``record=False``: inference).

        ``order``: the memory order the FP8 copy must have (``"C"``: a GEMM's A, row-major; ``"F"``: its B,
        column-major; the GPU casts with a transpose where x has the other). The CPU keeps x's order: the
        contract reads values, not layouts. ``via``: a 16-bit dtype x (a float32 master weight) is rounded
        to first, so the bytes and the amax are those of its 16-bit copy."""
        if via is not None:
            x = x.astype(via)
        st = self.get(name)
        scale_inv = (1.0 / st.scale).astype(self.xp.float32)  # the dequantisation scale of this cast
        q = quantize(x, st.scale, fmt)
        if record:
            self.record(st, amax(x), fmt)
        return q, scale_inv

    def record(self, st: TensorScale, a: Any, fmt: str) -> None:
        """Push amax ``a`` (0-d) into ``st``'s history and recompute its scale, with array operations only."""
        xp = self.xp
        finite = xp.isfinite(a)
        rolled = xp.concatenate([a.reshape(1), st.amax_history[:-1]])  # newest first
        st.amax_history[...] = xp.where(finite, rolled, st.amax_history)
        top = st.amax_history.max().astype(xp.float64)
        fresh = FP8_MAX[fmt] / (2.0**self.margin * xp.maximum(top, _TINY_AMAX))
        st.scale[...] = xp.where(top > 0, fresh, st.scale).astype(xp.float32)

    def state_dict(self) -> dict[str, Any]:
        """Host arrays ``fp8/<name>/amax_history`` and ``fp8/<name>/scale`` (copies: the state now)."""
        to_host = np.array if self.xp is np else (lambda a: a.get())
        out = {}
        for name, st in self.tensors.items():
            out[f"fp8/{name}/amax_history"] = to_host(st.amax_history)
            out[f"fp8/{name}/scale"] = to_host(st.scale)
        return out

    def expected(self, arrays: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{key: (shape, dtype)}`` of the ``fp8/`` arrays of a checkpoint this state can load."""
        shapes = {"amax_history": (self.history_len,), "scale": ()}
        out = {}
        for key in arrays:
            if key.startswith("fp8/") and key.rsplit("/", 1)[-1] in shapes:
                out[key] = (shapes[key.rsplit("/", 1)[-1]], "float32")
        return out

    def load_state_dict(self, arrays: dict[str, Any]) -> None:
        """Take every ``fp8/`` array of ``arrays`` (shapes checked by :meth:`expected`)."""
        for key, value in arrays.items():
            if not key.startswith("fp8/"):
                continue
            name, field = key[len("fp8/") :].rsplit("/", 1)
            getattr(self.get(name), field)[...] = self.xp.asarray(value)


@dataclass
class Fp8Call:
    """One FP8 GEMM as :meth:`Fp8Gemm.matmul` runs it."""

    key: str  # the call site (``layer1.dgrad``)
    a: tuple[Any, Any, str]  # A's FP8 copy (M, K), its dequantisation scale (0-d float32), its format
    b: tuple[Any, Any, str]  # the same of B (K, N)
    epilog: Epilog | None
    inputs: dict[str, Any]  # the epilog's inputs (bias, relu_aux, gelu_aux)
    out_dtype: Any  # D's dtype (bfloat16)
    c_order: bool  # D in C order (a plain GEMM whose 16-bit A was C-order), else column-major


class Fp8Gemm:
    """The :class:`~mlptrain.nn.execution.Gemm` of ``precision=fp8``: FP8 operands, 16-bit results.

    Args:
        base: the 16-bit engine, for the GEMMs FP8 cannot run (dimensions not multiples of 16).
        scaling: the delayed scales of every operand.
        mode: ``"fused"`` or ``"naive"``: which operand of each role is the gradient (:data:`FORMATS`).
        dtype: the 16-bit dtype of the operands and results (``precision.compute_dtype``, bfloat16); an
            operand of another dtype is a weight's float32 master (:attr:`mlptrain.nn.layers.Param.gemm_casts`),
            which stands for its value in ``dtype``: rounded to it before its FP8 cast (on the GPU inside
            the cast kernel), cast to it for a 16-bit GEMM. None: A's dtype (no masters).

    Call sites ``<layer>.fwd``, ``.dgrad``, ``.wgrad`` record amaxes; ``<layer>.infer`` (a forward
    with no backward: evaluation) casts with the training forward's scales and records nothing.
    """

    def __init__(self, base: Any, scaling: Fp8Scaling, mode: str = "fused", *, dtype: Any = None) -> None:
        self.base = base
        self.scaling = scaling
        self.formats = FORMATS[mode]
        self.dtype = None if dtype is None else np.dtype(dtype)

    def __call__(
        self, key: str, a: Any, b: Any, epilog: Epilog | None = None, **epilog_inputs: Any
    ) -> tuple[Any, dict[str, Any]]:
        (m, k), n = a.shape, b.shape[1]
        site, role = key.rsplit(".", 1)
        dtype = self.dtype if self.dtype is not None else a.dtype  # the results', and what a master stands for
        via_a, via_b = (dtype if x.dtype != dtype else None for x in (a, b))  # a weight's master (Param.gemm_casts)
        if role not in ("fwd", "infer", "dgrad", "wgrad") or not fits_fp8(m, n, k):
            a16, b16 = (x if via is None else x.astype(dtype) for x, via in ((a, via_a), (b, via_b)))
            return self.base(key, a16, b16, epilog, **epilog_inputs)
        record = role != "infer"
        names = f"{site}.fwd" if role == "infer" else key
        fa, fb = self.formats["fwd" if role == "infer" else role]
        # TN: K contiguous in A and in B; a master is rounded to dtype first (on the GPU in the cast's registers)
        a8, a_inv = self.scaling.quantize(f"{names}.a", a, fa, record, order="C", via=via_a)
        b8, b_inv = self.scaling.quantize(f"{names}.b", b, fb, record, order="F", via=via_b)
        aux: dict[str, Any] = {}
        if epilog is Epilog.BGRADB:  # NOT_SUPPORTED in FP8: the bias gradient from the 16-bit operand
            aux["bgradb"] = self.bias_gradient(b)  # (N,): B summed over K
            epilog = None
        inputs = {name: v for name, v in epilog_inputs.items() if v is not None}
        c_order = epilog is None and a.flags.c_contiguous  # D follows A's order, as the 16-bit contract's
        d, more = self.matmul(Fp8Call(key, (a8, a_inv, fa), (b8, b_inv, fb), epilog, inputs, dtype, c_order))
        return d, {**aux, **more}

    def bias_gradient(self, b: Any) -> Any:
        """BGRADB's bias gradient of the 16-bit ``b (K, N)``: its sum over K, ``(N,)`` in b's dtype."""
        return reduce_sum(b, axis=0, dtype=b.dtype)

    def matmul(self, call: Fp8Call) -> tuple[Any, dict[str, Any]]:
        """The FP8 GEMM of ``call``: here the contract, which keeps A's order in its FP8 copy (the GPU: cuBLASLt)."""
        (a8, a_inv, _), (b8, b_inv, _) = call.a, call.b
        scales = {"scale_a_inv": a_inv, "scale_b_inv": b_inv}
        out = matmul_fp8(a8, b8, **scales, epilog=call.epilog, epilog_inputs=call.inputs, out_dtype=call.out_dtype)
        return out if isinstance(out, tuple) else (out, {})

    def release_operands(self, prefix: str | None = None) -> None:
        self.base.release_operands(prefix)

    def free(self) -> None:
        """Drop the plans of the 16-bit engine (the GPU engine drops its FP8 plans too)."""
        if hasattr(self.base, "free"):
            self.base.free()


# The FP8 state of a run's GEMM engine, for the checkpoint (empty unless precision=fp8).
def state_dict(gemm: Any) -> dict[str, Any]:
    """``fp8/...`` host arrays of ``gemm``'s scales when it is an :class:`Fp8Gemm`, else ``{}``."""
    return gemm.scaling.state_dict() if isinstance(gemm, Fp8Gemm) else {}


def expected_arrays(gemm: Any, arrays: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The ``fp8/`` arrays of a checkpoint that ``gemm`` takes (none unless it is an :class:`Fp8Gemm`)."""
    return gemm.scaling.expected(arrays) if isinstance(gemm, Fp8Gemm) else {}


def load_state_dict(gemm: Any, arrays: dict[str, Any]) -> None:
    """Restore ``gemm``'s scales from a checkpoint's ``fp8/`` arrays (nothing unless it is an :class:`Fp8Gemm`)."""
    if isinstance(gemm, Fp8Gemm):
        gemm.scaling.load_state_dict(arrays)
