"""The cuBLASLt epilog contract, implemented in NumPy.

A matmul *epilog* is work that cuBLASLt does on the GEMM result before it leaves the
registers, so the result is written once instead of being read and written again by separate
kernels. nvmath-python 1.0 exposes them as ``MatmulEpilog``. This module computes exactly what
those epilogs compute, with the same inputs, output names, shapes, dtypes and layouts, so that

* on a machine without a GPU it *is* the fused engine (``execution=fused`` on the CPU), and
* on a GPU it is the oracle the nvmath path is tested against.

The GEMM is ``D (M, N) = A (M, K) @ B (K, N)``. Epilogs used by mlptrain:

=============== ============== ==================== ===========================================
epilog          epilog input   aux output           what it computes
=============== ============== ==================== ===========================================
BIAS            bias (M,)      -                    D = A@B + bias[:, None]
RELU_BIAS       bias (M,)      -                    D = max(A@B + bias[:, None], 0)
RELU_AUX_BIAS   bias (M,)      relu_aux (Mb, N) u8  as RELU_BIAS, plus the bit-packed mask Z >= 0
DRELU           relu_aux       -                    D = (A@B) * mask
DRELU_BGRAD     relu_aux       drelu_bgrad (M,)     as DRELU, plus its row sums over N
BGRADA          -              bgrada (M,)          D = A@B, plus A summed over K
BGRADB          -              bgradb (N,)          D = A@B, plus B summed over K
GELU_BIAS       bias (M,)      -                    D = gelu(A@B + bias[:, None])
GELU_AUX_BIAS   bias (M,)      gelu_aux (Mp, N)     as GELU_BIAS, plus Z itself (the pre-activation)
DGELU           gelu_aux       -                    D = (A@B) * gelu'(Z)
DGELU_BGRAD     gelu_aux       dgelu_bgrad (M,)     as DGELU, plus its row sums over N
=============== ============== ==================== ===========================================

(GELU and GELU_AUX are the same without a bias.) GELU is the tanh approximation cuBLASLt computes,
``gelu(z) = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))``; its ``gelu_aux`` is the
pre-activation in D's dtype, ``(Mp, N)`` with ``Mp = round_up(M, 8)``, column-major, rows past M
undefined (zeros here). The training step uses the GELU epilogs with ``model.activation=gelu``
(:mod:`mlptrain.nn.execution`), as it uses the ReLU ones by default; this contract is the oracle of both.

Layout: every epilog above returns D column-major (F-order), as cuBLASLt's bias and aux
epilogs require. A plain GEMM (no epilog) follows A's order. The ``relu_aux`` mask is cuBLASLt's
bit-packed layout: element ``(i, j)`` is bit ``i % 8`` (LSB first) of byte ``[i // 8, j]``, the
column of ``M`` bits padded to a multiple of 128 bits, so the array is uint8 of shape
``(Mb, N)`` with ``Mb = round_up(ceil(M / 8), 16)``, stored column-major (strides ``(1, Mb)``).
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np


class Epilog(enum.Enum):
    """The cuBLASLt epilogs mlptrain uses; names match ``nvmath.linalg.advanced.MatmulEpilog``."""

    BIAS = "BIAS"
    RELU_BIAS = "RELU_BIAS"
    RELU_AUX_BIAS = "RELU_AUX_BIAS"
    DRELU = "DRELU"
    DRELU_BGRAD = "DRELU_BGRAD"
    BGRADA = "BGRADA"
    BGRADB = "BGRADB"
    GELU = "GELU"
    GELU_AUX = "GELU_AUX"
    GELU_BIAS = "GELU_BIAS"
    GELU_AUX_BIAS = "GELU_AUX_BIAS"
    DGELU = "DGELU"
    DGELU_BGRAD = "DGELU_BGRAD"


# Which epilog_inputs each epilog takes (the aux output names are in the table above).
EPILOG_INPUTS: dict[Epilog, tuple[str, ...]] = {
    Epilog.BIAS: ("bias",),
    Epilog.RELU_BIAS: ("bias",),
    Epilog.RELU_AUX_BIAS: ("bias",),
    Epilog.DRELU: ("relu_aux",),
    Epilog.DRELU_BGRAD: ("relu_aux",),
    Epilog.BGRADA: (),
    Epilog.BGRADB: (),
    Epilog.GELU: (),
    Epilog.GELU_AUX: (),
    Epilog.GELU_BIAS: ("bias",),
    Epilog.GELU_AUX_BIAS: ("bias",),
    Epilog.DGELU: ("gelu_aux",),
    Epilog.DGELU_BGRAD: ("gelu_aux",),
}
_GELU_FORWARD = (Epilog.GELU, Epilog.GELU_AUX, Epilog.GELU_BIAS, Epilog.GELU_AUX_BIAS)
_BIAS = (Epilog.BIAS, Epilog.RELU_BIAS, Epilog.RELU_AUX_BIAS, Epilog.GELU_BIAS, Epilog.GELU_AUX_BIAS)
_GELU_C = float(np.sqrt(2.0 / np.pi))


def gelu_aux_shape(m: int, n: int) -> tuple[int, int]:
    """Shape ``(Mp, N)`` of the gelu_aux of an ``(M, N)`` result: ``Mp = round_up(M, 8)``."""
    return m + (-m) % 8, n


def _gelu_sigmoid(z: Any) -> Any:
    """``s = 0.5 (1 + tanh(u))`` with ``u = sqrt(2/pi) (z + 0.044715 z^3)``, as the logistic function of
    ``2u`` evaluated without cancellation (``1 + tanh(u)`` loses every digit in the far negative tail)."""
    xp = _xp(z)
    u = _GELU_C * (z + 0.044715 * z**3)
    return xp.exp(-xp.logaddexp(0.0, -2.0 * u))


def gelu(z: Any) -> Any:
    """The tanh approximation of GELU, ``0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))``, in z's dtype."""
    return z * _gelu_sigmoid(z)


def gelu_grad(z: Any) -> Any:
    """``d gelu / dz`` of :func:`gelu`: ``s + 2 z s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 z^2)``, ``s`` as above
    (the same as ``0.5 (1 + t) + 0.5 z (1 - t^2) ...`` with ``t = tanh(u)``, without its cancellation)."""
    s = _gelu_sigmoid(z)
    return s + 2.0 * z * s * (1.0 - s) * _GELU_C * (1.0 + 3 * 0.044715 * z * z)


def relu_aux_shape(m: int, n: int) -> tuple[int, int]:
    """Shape ``(Mb, N)`` of the uint8 relu_aux mask of an ``(M, N)`` result.

    ``Mb = round_up(ceil(M / 8), 16)``: M bits per column, in bytes, padded to 16 bytes.
    For example M=30 -> 16, M=256 -> 32, M=1000 -> 128.
    """
    mb = -(-m // 8)
    return mb + (-mb) % 16, n


def pack_relu_mask(mask: Any) -> Any:
    """Pack a boolean ``(M, N)`` mask into cuBLASLt's relu_aux layout.

    Works for NumPy and CuPy arrays (``xp`` from the input). Padding bits are zero.

    Returns:
        uint8 ``(Mb, N)``, column-major.
    """
    xp = _xp(mask)
    m, n = mask.shape
    mb, _ = relu_aux_shape(m, n)
    # (M, N) -> (N, Mb*8) rows of bits, LSB first, padded with zeros: packbits over the last axis.
    bits = xp.zeros((n, mb * 8), dtype=xp.uint8)
    bits[:, :m] = mask.T
    weights = (1 << xp.arange(8, dtype=xp.uint8)).astype(xp.uint8)  # bit k has weight 2**k
    packed = (bits.reshape(n, mb, 8) * weights).sum(axis=2, dtype=xp.uint8)  # (N, Mb)
    return packed.T  # (Mb, N) view of C-order (N, Mb): column-major, strides (1, Mb)


def unpack_relu_mask(aux: Any, m: int) -> Any:
    """Inverse of :func:`pack_relu_mask`: the boolean ``(M, N)`` mask held in ``aux``."""
    xp = _xp(aux)
    mb, n = aux.shape
    shifts = xp.arange(8, dtype=xp.uint8)
    bits = (aux.T[:, :, None] >> shifts) & 1  # (N, Mb, 8): bit k of byte [b, j]
    return bits.reshape(n, mb * 8)[:, :m].T.astype(bool)  # (M, N)


def matmul(
    a: np.ndarray,
    b: np.ndarray,
    *,
    epilog: Epilog | None = None,
    epilog_inputs: dict[str, Any] | None = None,
) -> Any:
    """``D = A @ B`` with an optional epilog, returning what nvmath's ``execute()`` returns.

    Args:
        a: ``(M, K)`` float array, either order.
        b: ``(K, N)`` float array, either order.
        epilog: one of :class:`Epilog`, or None for a plain GEMM.
        epilog_inputs: ``{"bias": (M,)}`` or ``{"relu_aux": uint8 (Mb, N)}`` as the epilog needs.

    Returns:
        ``D`` alone when the epilog has no aux output, else ``(D, {aux_name: aux})``, exactly as
        ``nvmath.linalg.advanced.Matmul.execute``. ``D`` has A's dtype; bias gradients have D's.

    Raises:
        ValueError: shapes, dtypes or epilog inputs that cuBLASLt (or nvmath) would reject.
    """
    epilog_inputs = dict(epilog_inputs or {})
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul needs A (M, K) and B (K, N); got A {a.shape} and B {b.shape}")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul needs A and B of one dtype; got {a.dtype} and {b.dtype}")
    k = a.shape[1]
    check_epilog_inputs(epilog, epilog_inputs)

    col_major = epilog is not None or (a.flags.f_contiguous and not a.flags.c_contiguous)
    # (B^T @ A^T)^T is the same product, computed so that D comes out column-major without a
    # copy: B^T @ A^T is a C-order (N, M) array, whose transpose is the F-order (M, N) result.
    # The CPU naive path issues the very same BLAS call for the same layer, which is why fused
    # and naive agree bit for bit on the CPU.
    a_c, b_c = (a, b) if a.dtype in (np.float32, np.float64) else (a.astype(np.float32), b.astype(np.float32))
    d = (b_c.T @ a_c.T).T if col_major else a_c @ b_c  # (M, K) @ (K, N) -> (M, N)
    d = _compute_copy(d, a.dtype)
    if epilog is Epilog.BGRADA:
        return d, {"bgrada": reduce_sum(a, axis=1, dtype=d.dtype)}  # (M,): A summed over K
    if epilog is Epilog.BGRADB:
        return d, {"bgradb": reduce_sum(b, axis=0, dtype=d.dtype)}  # (N,): B summed over K
    return apply_epilog(d, epilog, epilog_inputs, k)


def apply_epilog(d: np.ndarray, epilog: Epilog | None, epilog_inputs: dict[str, Any], k: int) -> Any:
    """The epilog on the rounded product ``d (M, N)`` (D's dtype; ``k``: the GEMM's K), as :func:`matmul`
    returns it. The FP8 contract (:mod:`mlptrain.nn.epilogs_fp8`) shares it: only the product differs."""
    m, n = d.shape
    aux: dict[str, Any] = {}
    if epilog in _GELU_FORWARD or epilog in (Epilog.DGELU, Epilog.DGELU_BGRAD):
        return _gelu_epilog(epilog, d, epilog_inputs, k)
    if epilog in _BIAS:
        # Two roundings in half precision, as cuBLASLt does (measured on the H200): the product is
        # rounded to D's dtype, then the bias added and rounded again. A=[[1, -2^-13]], B=[[1], [1]],
        # bias=[-1] in float16 gives Z = 0 (mask bit set), not -2^-13.
        _add_bias(epilog, d, epilog_inputs["bias"])  # per row i (M), broadcast along N
        if epilog is Epilog.RELU_AUX_BIAS:
            aux["relu_aux"] = pack_relu_mask(d >= 0)  # (Mb, N) uint8: bit set where Z >= 0
        if epilog is not Epilog.BIAS:
            np.maximum(d, 0, out=d)
    elif epilog in (Epilog.DRELU, Epilog.DRELU_BGRAD):
        relu_aux = epilog_inputs["relu_aux"]
        if k == 1:
            raise ValueError(f"epilog {epilog.name} rejects K=1 (nvmath 1.0 does too)")
        expected = relu_aux_shape(m, n)
        if relu_aux.dtype != np.uint8 or relu_aux.shape != expected:
            raise ValueError(
                f"epilog {epilog.name} needs relu_aux of dtype uint8 and shape {expected} for an ({m}, {n}) "
                f"result; got {relu_aux.dtype} {relu_aux.shape}"
            )
        _check_unit_stride(epilog, "relu_aux", relu_aux, 1)
        d *= unpack_relu_mask(relu_aux, m)  # dReLU: keep the gradient where the forward Z >= 0 (relu'(0) = 1)
        if epilog is Epilog.DRELU_BGRAD:
            aux["drelu_bgrad"] = reduce_sum(d, axis=1)  # (M,): row sums over N, in a wide accumulator
    return (d, aux) if aux else d


def check_epilog_inputs(epilog: Epilog | None, epilog_inputs: dict[str, Any]) -> None:
    """Raise ValueError unless ``epilog_inputs`` are exactly the inputs ``epilog`` takes (nvmath's rule)."""
    required = EPILOG_INPUTS[epilog] if epilog is not None else ()
    if set(epilog_inputs) != set(required):
        raise ValueError(f"epilog {epilog} needs epilog_inputs {list(required)}; got {sorted(epilog_inputs)}")


def _add_bias(epilog: Epilog, d: np.ndarray, bias: Any) -> None:
    m = d.shape[0]
    if bias.shape not in ((m,), (m, 1)):
        raise ValueError(f"epilog {epilog.name} needs a bias of shape ({m},) along M; got {bias.shape}")
    _check_unit_stride(epilog, "bias", bias, bias.itemsize)
    d += bias.reshape(m, 1).astype(d.dtype, copy=False)  # rounded a second time in half precision


def _gelu_epilog(epilog: Epilog, d: np.ndarray, inputs: dict[str, Any], k: int) -> Any:
    """The GELU family on the rounded product ``d (M, N)`` (F-order, D's dtype). The activation and
    its derivative are evaluated in float64 and rounded once to D's dtype."""
    m, n = d.shape
    aux: dict[str, Any] = {}
    if epilog in _GELU_FORWARD:
        if "bias" in inputs:
            _add_bias(epilog, d, inputs["bias"])
        if epilog in (Epilog.GELU_AUX, Epilog.GELU_AUX_BIAS):
            z = np.zeros(gelu_aux_shape(m, n), dtype=d.dtype, order="F")  # (Mp, N), rows past M undefined
            z[:m] = d
            aux["gelu_aux"] = z
        out = gelu(d.astype(np.float64)).astype(d.dtype, order="F")
        return (out, aux) if aux else out
    if k == 1:
        raise ValueError(f"epilog {epilog.name} rejects K=1 (nvmath 1.0 does too)")
    z = inputs["gelu_aux"]
    expected = gelu_aux_shape(m, n)
    if z.dtype != d.dtype or z.shape != expected:
        raise ValueError(
            f"epilog {epilog.name} needs gelu_aux of dtype {d.dtype} and shape {expected} for an ({m}, {n}) "
            f"result; got {z.dtype} {z.shape}"
        )
    _check_unit_stride(epilog, "gelu_aux", z, z.itemsize)
    out = (d.astype(np.float64) * gelu_grad(z[:m].astype(np.float64))).astype(d.dtype, order="F")
    if epilog is Epilog.DGELU_BGRAD:
        return out, {"dgelu_bgrad": reduce_sum(out, axis=1)}  # (M,): row sums over N
    return out


def _compute_copy(d: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The GEMM result in ``dtype``: half precision is computed in float32 and rounded once."""
    return d if d.dtype == dtype else d.astype(dtype, order="K")


def accumulator(dtype: Any) -> np.dtype:
    """The dtype the contract's reductions accumulate in: float32 for half precision, float64 for
    float32 and float64 (at least as exact as cuBLASLt, whose epilogs reduce in float32)."""
    return np.dtype(np.float32) if np.dtype(dtype).itemsize < 4 else np.dtype(np.float64)


def reduce_sum(x: Any, axis: int, dtype: Any = None) -> Any:
    """``x`` summed over ``axis`` in :func:`accumulator`'s dtype, rounded once to ``dtype`` (default x's).

    A sum in the data's own dtype drifts: in float16 a running sum of ones stops at 2048, and
    NumPy's float32 sums of 65,536 terms are off by about 1e-3 relative (nvmath's suite allows 2e-4).
    """
    dtype = x.dtype if dtype is None else dtype
    return x.sum(axis=axis, dtype=accumulator(x.dtype)).astype(dtype)


def _check_unit_stride(epilog: Epilog, name: str, x: Any, unit: int) -> None:
    """nvmath refuses an epilog input whose elements along M are not adjacent (the stride along M is 1)."""
    if x.strides[0] != unit:
        raise ValueError(
            f"epilog {epilog.name} needs {name} with unit stride along M (nvmath's requirement); got strides "
            f"{x.strides} for shape {x.shape} ({x.dtype}): pass a contiguous array"
        )


def _xp(a: Any) -> Any:
    from mlptrain.base.backend import get_array_module

    return get_array_module(a)
