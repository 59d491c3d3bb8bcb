"""Fused and naive execution of a linear layer's forward and backward GEMMs.

Layers never branch on the execution mode: they call the three methods of an execution object,
and the object decides how the work is done.

* :class:`FusedExecution` puts bias, ReLU, the ReLU mask, dReLU and the bias gradient into the
  GEMMs as cuBLASLt epilogs (nvmath-python on the GPU, the NumPy contract of
  :mod:`mlptrain.nn.epilogs` on the CPU).
* :class:`NaiveExecution` runs the same GEMMs with no epilog, then bias, ReLU, mask and
  reductions as separate array operations: what a framework without fusion does.

Layout, shared by both: activations and their gradients are C-contiguous ``(B, features)``
arrays, weights are C-contiguous ``(out, in)``. The memory of a C-order ``(B, out)`` array is
exactly the column-major ``(out, B)`` matrix that cuBLASLt's bias and aux epilogs produce, so the
fused path computes the transposed products (``Z^T = W @ X^T``) and every transpose is a free view:
no copy or transpose kernel runs between layers.

Every method also takes an ensemble's stacked operands (:mod:`mlptrain.nn.batched`): a leading member
axis on everything, ``X (K, B, in)``, ``W (K, out, in)``, the bias ``(K, 1, out)``, and the GEMM engine
runs one batched GEMM per call. Transposes are of the last two axes (:func:`_t`), reductions are over
the batch axis (``-2``); a single model's 2-D arrays take the very same code.

The three GEMMs of layer ``l`` (``X`` its input, ``Z = X @ W^T + b`` its pre-activation):

============ ================================== ============================================
role         fused                              naive
============ ================================== ============================================
forward      Z^T (out,B) = W @ X^T,             Z (B,out) = X @ W^T; Z += b; mask = Z >= 0;
             RELU_AUX_BIAS (BIAS if no ReLU;    Z = max(Z, 0)
             RELU_BIAS when no backward follows)
input grad   dX^T (in,B) = W^T @ dZ^T,          dX (B,in) = dZ @ W; dX *= mask_below;
             DRELU or DRELU_BGRAD with the      db_below = dX.sum(0)
             relu_aux of the layer below
weight grad  dW^T (in,out) = X^T @ dZ,          dW^T (in,out) = X^T @ dZ; db = dZ.sum(0)
             BGRADB gives db = dZ summed over B
============ ================================== ============================================

Where a ReLU layer's bias gradient comes from is the *bgrad strategy*: ``drelu_bgrad`` (the
input-gradient GEMM of the layer above reduces it) or ``bgradb`` (the layer's own weight-gradient
GEMM reduces it). Both are exact; which is faster depends on the shape (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from mlptrain.base.backend import get_array_module
from mlptrain.base.registry import Registry
from mlptrain.nn.epilogs import Epilog, gelu, gelu_grad, matmul, reduce_sum, unpack_relu_mask

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActivationSpec:
    """The epilogs of a hidden layer's activation: ``forward`` for training (with the aux the backward
    needs, named ``aux``), ``infer`` for inference (no aux), and the input-gradient GEMM of the layer
    above without and with the bias gradient (``backward``, ``backward_bgrad``). None: no activation
    (BIAS forward, a plain GEMM backward). Its naive twin is written in :class:`NaiveExecution`.

    ``forward_no_bias`` and ``infer_no_bias``: the same two forwards for a layer without a bias (the
    torch front end's ``bias=False``, :mod:`mlptrain.torch.chain`). None: the activation has no bias-free
    epilog (ReLU: the contract has no RELU_AUX), and ``forward``/``infer`` run with a bias of zeros.
    """

    forward: Epilog | None = None
    infer: Epilog | None = None
    backward: Epilog | None = None
    backward_bgrad: Epilog | None = None
    aux: str = ""
    forward_no_bias: Epilog | None = None
    infer_no_bias: Epilog | None = None


# model.activation: a new one is its epilogs in mlptrain.nn.epilogs, a row here, and NaiveExecution's branch
ACTIVATIONS: Registry[ActivationSpec] = Registry("model.activation")
ACTIVATIONS.add(
    "relu", ActivationSpec(Epilog.RELU_AUX_BIAS, Epilog.RELU_BIAS, Epilog.DRELU, Epilog.DRELU_BGRAD, "relu_aux")
)
ACTIVATIONS.add(
    "gelu",
    ActivationSpec(
        Epilog.GELU_AUX_BIAS,
        Epilog.GELU_BIAS,
        Epilog.DGELU,
        Epilog.DGELU_BGRAD,
        "gelu_aux",
        forward_no_bias=Epilog.GELU_AUX,
        infer_no_bias=Epilog.GELU,
    ),
    "the tanh form",
)
ACTIVATIONS.add("none", ActivationSpec())


def forward_site(key: str, mask: bool) -> str:
    """The forward GEMM's call site: ``<layer>.fwd`` in training, ``<layer>.infer`` when no backward follows
    (an FP8 engine casts there with the training forward's scales, and records no amax)."""
    return f"{key}.fwd" if mask else f"{key}.infer"


class Gemm(Protocol):
    """A GEMM engine: ``(D, aux) = A @ B`` with an optional cuBLASLt epilog.

    ``key`` names the call site (layer and role); engines that plan (nvmath) keep one plan per
    key and operand signature and reuse it every step. ``epilog_inputs`` go by nvmath's names
    (``bias``, ``relu_aux``, ``gelu_aux``); None values are left out.
    """

    def __call__(
        self, key: str, a: Any, b: Any, epilog: Epilog | None = None, **epilog_inputs: Any
    ) -> tuple[Any, dict[str, Any]]: ...

    def release_operands(self, prefix: str | None = None) -> None:
        """Forget the operands of the last call at the call sites whose key starts with ``prefix`` (all: None)."""


class NumpyGemm:
    """The CPU engine: :func:`mlptrain.nn.epilogs.matmul`, the contract the GPU is tested against."""

    def __call__(
        self, key: str, a: Any, b: Any, epilog: Epilog | None = None, **epilog_inputs: Any
    ) -> tuple[Any, dict[str, Any]]:
        inputs = {name: v for name, v in epilog_inputs.items() if v is not None}
        out = matmul(a, b, epilog=epilog, epilog_inputs=inputs)
        return out if isinstance(out, tuple) else (out, {})

    def release_operands(self, prefix: str | None = None) -> None:
        """Nothing to forget: no plan keeps operands."""


class FusedExecution:
    """Every elementwise op and reduction of a layer fused into its GEMMs as epilogs."""

    def __init__(self, gemm: Gemm) -> None:
        self.gemm = gemm

    def release(self, key: str) -> None:
        """Let the GEMMs of layer ``key`` forget their last operands (their memory can go)."""
        self.gemm.release_operands(f"{key}.")

    def forward(self, key: str, W: Any, b: Any, x: Any, activation: str, mask: bool = True) -> tuple[Any, Any]:
        """``y = act(x @ W^T + b)``; returns ``(y (B, out), aux or None)``, aux what the backward needs.

        RELU_AUX_BIAS: Z^T = W @ X^T + b[:, None], the ReLU applied, and the bit-packed mask
        ``Z >= 0`` returned as relu_aux (uint8 (Mb, B)) for the backward. GELU_AUX_BIAS: the same
        with GELU, and Z itself returned as gelu_aux ((round_up(out, 8), B), column-major). With
        ``mask=False`` (inference, evaluation: no backward follows) RELU_BIAS or GELU_BIAS, which
        write no aux. BIAS without an activation.
        """
        spec = ACTIVATIONS[activation]
        epilog = (spec.forward if mask else spec.infer) or Epilog.BIAS
        # (out, in) @ (in, B) -> (out, B) column-major == (B, out) C-order
        zt, aux = self.gemm(forward_site(key, mask), W, _t(x), epilog, bias=_bias_column(b))
        return _t(zt), (aux.get(spec.aux) if spec.aux else None)

    def input_grad(
        self, key: str, W: Any, dz: Any, mask_below: Any, bias_grad_below: bool, activation_below: str = "relu"
    ) -> tuple[Any, Any]:
        """``dZ_below = (dZ @ W) * act'(Z_below)``; returns ``(dZ_below (B, in), db_below (in,) or None)``.

        DRELU applies the derivative of the layer below's ReLU (its relu_aux) to the product, DGELU
        that of its GELU (at its gelu_aux, the pre-activation); DRELU_BGRAD and DGELU_BGRAD also
        return the row sums over the batch: the bias gradient of that layer. With no activation
        below, a plain GEMM. A layer with one output makes this GEMM's K = 1, which the epilogs
        reject: :meth:`_input_grad_k1` then applies the derivative separately.
        """
        if mask_below is None:  # no activation below: a plain GEMM
            dxt, _ = self.gemm(f"{key}.dgrad", _t(W), _t(dz))
            return _t(dxt), None
        if dz.shape[-1] == 1:
            return self._input_grad_k1(key, W, dz, mask_below, bias_grad_below, activation_below)
        below = ACTIVATIONS[activation_below]
        epilog = below.backward_bgrad if bias_grad_below else below.backward
        aux_input = {below.aux: mask_below}
        # (in, out) @ (out, B) -> (in, B) column-major == (B, in) C-order
        dxt, aux = self.gemm(f"{key}.dgrad", _t(W), _t(dz), epilog, **aux_input)
        return _t(dxt), aux.get("drelu_bgrad", aux.get("dgelu_bgrad"))

    def weight_grad(self, key: str, x: Any, dz: Any, bias_grad: bool) -> tuple[Any, Any]:
        """``dW = dZ^T @ X`` in W's (out, in) layout; with ``bias_grad`` also ``db = dZ.sum(0)``.

        BGRADB reduces the B operand (dZ, (batch, out)) over K = batch: the bias gradient.
        """
        # (in, B) @ (B, out) -> (in, out) column-major == (out, in) C-order, W's layout
        dwt, aux = self.gemm(f"{key}.wgrad", _t(x), dz, Epilog.BGRADB if bias_grad else None)
        return _t(dwt), aux.get("bgradb")

    def lookup(self, key: str, E: Any, x: Any) -> Any:
        """``H (B, d) = X (B, L) @ E (L, d)``: an embedding's forward (:mod:`mlptrain.nn.embedding`), one plain
        GEMM, epilog DEFAULT: no bias (the first layer's adds it) and no activation to fuse."""
        return _lookup(self.gemm, key, E, x)

    def lookup_grad(self, key: str, x: Any, dh: Any) -> Any:
        """``dE (L, d) = X^T @ dH``: an embedding's gradient, one plain GEMM (no bias to reduce)."""
        return _lookup_grad(self.gemm, key, x, dh)

    def _input_grad_k1(
        self, key: str, W: Any, dz: Any, mask_below: Any, bias_grad_below: bool, activation_below: str
    ) -> tuple[Any, Any]:
        """:meth:`input_grad` for a layer with one output (a single-target regression): K = 1, which
        cuBLASLt's dReLU and dGELU epilogs reject. The GEMM runs plain and the derivative is applied
        (and the bias gradient reduced) separately."""
        dxt, _ = self.gemm(f"{key}.dgrad", _t(W), _t(dz))  # (in, 1) @ (1, B): an outer product
        m = W.shape[-1]
        if activation_below == "gelu":
            dx = _t(dxt) * _t(gelu_grad(mask_below[..., :m, :].astype("float64"))).astype(dxt.dtype)  # (B, in)
        else:
            dx = _t(dxt) * _t(_unpack(mask_below, m))  # (B, in), dReLU of the layer below
        return dx, (_batch_sum(dx) if bias_grad_below else None)


# u = sqrt(2/pi) (z + 0.044715 z^3), t = tanh(u), du = du/dz; W: float, or double for float64 data
_GELU_CUDA = """
typedef typename mlptrain_wide<T>::type W;
W v = (W)z;
W u = (W)0.7978845608028654 * (v + (W)0.044715 * v * v * v);
W t = tanh(u);
W du = (W)0.7978845608028654 * ((W)1 + (W)(3 * 0.044715) * v * v);
"""
_WIDE_CUDA = """
template <typename T> struct mlptrain_wide { typedef float type; };
template <> struct mlptrain_wide<double> { typedef double type; };
"""


def _gpu_kernel(in_params: str, out_params: str, body: str, name: str) -> Any:
    from mlptrain.base.cuda.kernels import elementwise  # the GPU path only: CuPy is imported there

    return elementwise(in_params, out_params, body, name, preamble=_WIDE_CUDA)


class NaiveExecution:
    """Plain GEMMs, then bias, ReLU, mask and reductions as separate array operations.

    Written as a careful engineer would without fusion: in-place adds, ``maximum`` with ``out=``,
    a boolean mask kept for the backward and applied with a multiply (no boolean-index
    assignment, which costs a compaction pass).
    """

    def __init__(self, gemm: Gemm, xp: Any) -> None:
        self.gemm = gemm
        self.xp = xp

    def release(self, key: str) -> None:
        """Let the GEMMs of layer ``key`` forget their last operands (their memory can go)."""
        self.gemm.release_operands(f"{key}.")

    def forward(self, key: str, W: Any, b: Any, x: Any, activation: str, mask: bool = True) -> tuple[Any, Any]:
        z, _ = self.gemm(forward_site(key, mask), x, _t(W))  # (B, in) @ (in, out) -> (B, out)
        z += b  # bias per feature, broadcast over the batch (an ensemble's (K, 1, out) over (K, B, out))
        if activation == "none":
            return z, None
        if activation == "gelu":  # keep Z for the backward (gelu'(Z))
            return self._gelu(z), (z if mask else None)
        keep = z >= 0 if mask else None  # (B, out) bool, kept for the backward
        self.xp.maximum(z, 0, out=z)
        return z, keep

    def input_grad(
        self, key: str, W: Any, dz: Any, mask_below: Any, bias_grad_below: bool, activation_below: str = "relu"
    ) -> tuple[Any, Any]:
        dx, _ = self.gemm(f"{key}.dgrad", dz, W)  # (B, out) @ (out, in) -> (B, in)
        if mask_below is None:
            return dx, None
        if activation_below == "gelu":  # dGELU of the layer below, at its pre-activation
            dx = self._gelu_backward(dx, mask_below)
        else:
            dx *= mask_below  # dReLU of the layer below
        return dx, (self._sum(dx) if bias_grad_below else None)  # (in,) bias gradient of the layer below

    def weight_grad(self, key: str, x: Any, dz: Any, bias_grad: bool) -> tuple[Any, Any]:
        dwt, _ = self.gemm(f"{key}.wgrad", _t(x), dz)  # (in, B) @ (B, out) -> (in, out) == dW (out, in)^T
        return _t(dwt), (self._sum(dz) if bias_grad else None)  # (out,)

    def lookup(self, key: str, E: Any, x: Any) -> Any:
        """``H = X @ E``: the same plain GEMM as fused (an embedding has no epilog to leave out)."""
        return _lookup(self.gemm, key, E, x)

    def lookup_grad(self, key: str, x: Any, dh: Any) -> Any:
        """``dE = X^T @ dH``: the same plain GEMM as fused."""
        return _lookup_grad(self.gemm, key, x, dh)

    # GELU and its derivative: on the CPU the contract's float64 formulas (so that naive and fused
    # agree there); on the GPU one element-wise kernel each, in float32 for the narrower dtypes, as
    # PyTorch's eager gelu and gelu_backward kernels (a chain of CuPy array operations would make
    # six passes over memory and a slower baseline than a careful engineer's).
    def _gelu(self, z: Any) -> Any:
        if self.xp.__name__ == "numpy":
            return gelu(z.astype("float64")).astype(z.dtype)
        return _gpu_kernel("T z", "T y", _GELU_CUDA + "y = (T)((W)0.5 * v * ((W)1 + t));", "mlptrain_naive_gelu")(z)

    def _gelu_backward(self, dx: Any, z: Any) -> Any:
        if self.xp.__name__ == "numpy":
            return (dx.astype("float64") * gelu_grad(z.astype("float64"))).astype(dx.dtype)
        body = _GELU_CUDA + "g = (T)((W)g * ((W)0.5 * ((W)1 + t) + (W)0.5 * v * ((W)1 - t * t) * du));"
        _gpu_kernel("T z", "T g", body, "mlptrain_naive_dgelu")(z, dx)  # in place: dX *= gelu'(Z)
        return dx

    def _sum(self, x: Any) -> Any:
        """Column sums of ``x (B, n)`` (an ensemble's ``(K, B, n)``: ``(K, n)``): on the CPU in the epilog
        contract's accumulator (so that naive and fused agree bit for bit there), on the GPU as CuPy sums."""
        return _batch_sum(x) if self.xp.__name__ == "numpy" else x.sum(axis=-2)


def _lookup(gemm: Gemm, key: str, E: Any, x: Any) -> Any:
    """``H (B, d) = X (B, L) @ E (L, d)``, computed transposed as Linear's forward is (no copy either way)."""
    ht, _ = gemm(f"{key}.fwd", _t(E), _t(x))  # (d, L) @ (L, B) -> (d, B) column-major == (B, d) C-order
    return _t(ht)


def _lookup_grad(gemm: Gemm, key: str, x: Any, dh: Any) -> Any:
    """``dE (L, d) = X^T @ dH``, in E's C-order layout: ``dE^T = dH^T @ X``."""
    det, _ = gemm(f"{key}.wgrad", _t(dh), x)  # (d, B) @ (B, L) -> (d, L) column-major == (L, d) C-order
    return _t(det)


def _t(a: Any) -> Any:
    """The transpose of the last two axes, a free view: ``a.T`` of a 2-D array, per member of a stack."""
    return a.swapaxes(-1, -2)


def _bias_column(b: Any) -> Any:
    """The bias as the epilog takes it: ``(out,)``, or an ensemble's ``(K, 1, out)`` as ``(K, out, 1)`` (the
    batched BIAS epilog's ``(batch, M, 1)``, unit stride along M), a view."""
    return b if b is None or b.ndim < 3 else _t(b)


def _batch_sum(x: Any) -> Any:
    """The contract's column sums over the batch axis: ``(B, n) -> (n,)``; a stack ``(K, B, n) -> (K, n)``,
    summed member by member (each member's sum is then the single model's, bit for bit)."""
    if x.ndim == 2:
        return reduce_sum(x, axis=0)
    return get_array_module(x).stack([reduce_sum(m, axis=0) for m in x])


def _unpack(aux: Any, m: int) -> Any:
    """:func:`unpack_relu_mask` of a mask or of a stack of them (``(K, Mb, N) -> (K, M, N)``)."""
    if aux.ndim == 2:
        return unpack_relu_mask(aux, m)
    return get_array_module(aux).stack([unpack_relu_mask(a, m) for a in aux])
