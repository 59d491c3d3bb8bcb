"""The cuBLASLt epilog contract in FP8, implemented in NumPy: what an FP8 GEMM on Hopper computes.

An FP8 GEMM reads 8-bit operands, each with a per-tensor *dequantisation scale*, accumulates in
float32 on the tensor cores, multiplies the accumulator by both scales and writes a 16-bit ``D``
(bfloat16 here) through the same epilogs as a 16-bit GEMM::

    A8 = fp8(scale_a * A)      B8 = fp8(scale_b * B)             (the casts, before the GEMM)
    D  = bf16((A8 @ B8) / (scale_a * scale_b))  then the epilog  (cuBLASLt: A/B_SCALE_POINTER)

Two formats (OCP FP8, as ``ml_dtypes`` names them, which round to nearest even as the hardware):

======= ===================== ========= =====================================================
format  ml_dtypes             max       used for
======= ===================== ========= =====================================================
e4m3    ``float8_e4m3fn``     448       forward operands: weights and activations (3 mantissa bits)
e5m2    ``float8_e5m2``       57344     gradients dZ (2 mantissa bits, the range of float16)
======= ===================== ========= =====================================================

The casts saturate (CUDA's ``__NV_SATFINITE``): a finite value beyond the format's max becomes
``+-max``. A non-finite value becomes NaN (where the hardware cast would saturate an inf), so that it
reaches the gradients and the step is skipped, as an overflowing fp16 step is.

What cuBLASLt 12.8+ runs with FP8 operands on the H200 (measured 2026-12-01, ``nvmath-notes.md`` §10):
the forward epilogs BIAS, RELU_BIAS, RELU_AUX_BIAS and GELU(_AUX)_BIAS with e4m3 x e4m3; DRELU and
DRELU_BGRAD with e4m3 x e5m2. BGRADA and BGRADB are NOT_SUPPORTED: a weight gradient's bias gradient
comes from a separate reduction of the 16-bit dZ (on the GPU fused into the cast + transpose kernel of
dZ, as Transformer Engine's ``cast_transpose_dbias``). DGELU(_BGRAD) is in cuBLASLt's FP8 matrix but
not measured here yet (``tests/gpu/test_fp8_gpu.py`` checks it). e5m2 x e5m2 is refused, and so are
dimensions that are not multiples of 16.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from mlptrain.nn.epilogs import Epilog, apply_epilog, check_epilog_inputs

FORMATS: dict[str, Any] = {"e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "e5m2": np.dtype(ml_dtypes.float8_e5m2)}
FP8_MAX = {name: float(ml_dtypes.finfo(dtype).max) for name, dtype in FORMATS.items()}  # 448, 57344
# The epilogs an FP8 GEMM runs (None: a plain GEMM); BGRADA and BGRADB are not among them.
FP8_EPILOGS = (
    None,
    Epilog.BIAS,
    Epilog.RELU_BIAS,
    Epilog.RELU_AUX_BIAS,
    Epilog.GELU_BIAS,
    Epilog.GELU_AUX_BIAS,
    Epilog.DRELU,
    Epilog.DRELU_BGRAD,
    Epilog.DGELU,
    Epilog.DGELU_BGRAD,
)
FP8_MULTIPLE = 16  # every GEMM dimension of an FP8 GEMM is a multiple of this


def fits_fp8(m: int, n: int, k: int) -> bool:
    """Whether an ``(M, K) @ (K, N)`` GEMM can run in FP8: M, N and K all multiples of 16."""
    return m % FP8_MULTIPLE == 0 and n % FP8_MULTIPLE == 0 and k % FP8_MULTIPLE == 0


def format_of(dtype: Any) -> str:
    """``"e4m3"`` or ``"e5m2"`` for an FP8 dtype; ValueError for any other."""
    for name, fp8 in FORMATS.items():
        if np.dtype(dtype) == fp8:
            return name
    raise ValueError(f"dtype {np.dtype(dtype).name} is no FP8 format; expected float8_e4m3fn or float8_e5m2")


def quantize(x: Any, scale: Any, fmt: str) -> np.ndarray:
    """``fp8(scale * x)``, saturating, in x's shape and memory order (non-finite values become NaN).

    Args:
        x: float array (bfloat16, float32, ...).
        scale: the quantisation scale (float32, a number or a 0-d array): ``amax * scale`` should
            reach about the format's max (:mod:`mlptrain.nn.fp8` chooses it).
        fmt: ``"e4m3"`` or ``"e5m2"``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"FP8 format {fmt!r} is unknown; expected one of {', '.join(FORMATS)}")
    v = x.astype(np.float32) * np.float32(scale)  # the cast kernel's arithmetic: one float32 multiply
    top = np.float32(FP8_MAX[fmt])
    v = np.where(np.isfinite(x), np.clip(v, -top, top), np.float32(np.nan))
    return v.astype(FORMATS[fmt], order="K")


def dequantize(q: np.ndarray, scale_inv: Any) -> np.ndarray:
    """The float32 values an FP8 array stands for: ``q * scale_inv`` (``scale_inv = 1 / scale``)."""
    return q.astype(np.float32) * np.float32(scale_inv)


def amax(x: Any) -> Any:
    """``max |x|`` as a 0-d float32 array (NaN or inf when x holds one): what delayed scaling records."""
    return np.abs(x).max().astype(np.float32) if x.size else np.zeros((), np.float32)


def matmul_fp8(
    a: np.ndarray,
    b: np.ndarray,
    *,
    scale_a_inv: Any,
    scale_b_inv: Any,
    epilog: Epilog | None = None,
    epilog_inputs: dict[str, Any] | None = None,
    out_dtype: Any = ml_dtypes.bfloat16,
) -> Any:
    """``D = (A8 @ B8) * scale_a_inv * scale_b_inv`` with an optional epilog, as cuBLASLt's FP8 GEMM.

    Args:
        a: ``(M, K)`` FP8 array (either order: the GPU engine makes the TN copies it needs).
        b: ``(K, N)`` FP8 array; e5m2 x e5m2 is refused.
        scale_a_inv, scale_b_inv: the dequantisation scales (float32; ``1 / scale`` of :func:`quantize`).
        epilog: one of :data:`FP8_EPILOGS`.
        epilog_inputs: as :func:`mlptrain.nn.epilogs.matmul` (the bias in ``out_dtype``).
        out_dtype: D's dtype, bfloat16 (or float16).

    Returns:
        What :func:`mlptrain.nn.epilogs.matmul` returns: ``D`` (column-major with an epilog, else in A's
        order), or ``(D, aux)``. The product is accumulated in float32, multiplied by the two scales in
        float32 and rounded once to ``out_dtype``; the epilog then runs as in 16-bit (the bias added
        to the rounded product and rounded again).

    Raises:
        ValueError: what cuBLASLt refuses in FP8: dimensions not multiples of 16, e5m2 x e5m2, BGRADA
            or BGRADB, and the epilog input errors of the 16-bit contract.
    """
    epilog_inputs = dict(epilog_inputs or {})
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul_fp8 needs A (M, K) and B (K, N); got A {a.shape} and B {b.shape}")
    formats = format_of(a.dtype), format_of(b.dtype)
    if formats == ("e5m2", "e5m2"):
        raise ValueError("matmul_fp8 got e5m2 x e5m2, which cuBLASLt refuses; one operand must be e4m3")
    (m, k), n = a.shape, b.shape[1]
    if not fits_fp8(m, n, k):
        raise ValueError(f"matmul_fp8 needs M, N and K multiples of {FP8_MULTIPLE}; got M={m}, N={n}, K={k}")
    if epilog not in FP8_EPILOGS:
        raise ValueError(f"epilog {epilog.name} is NOT_SUPPORTED with FP8 operands on Hopper")  # type:
        # ignore[union-attr]
    check_epilog_inputs(epilog, epilog_inputs)

    col_major = epilog is not None or (a.flags.f_contiguous and not a.flags.c_contiguous)
    a32, b32 = a.astype(np.float32), b.astype(np.float32)  # exact: every FP8 value is a float32
    acc = (b32.T @ a32.T).T if col_major else a32 @ b32  # (M, K) @ (K, N) -> (M, N), float32 accumulator
    acc *= np.float32(scale_a_inv) * np.float32(scale_b_inv)  # cuBLASLt's alpha * scale_a * scale_b
    d = acc.astype(out_dtype, order="K")  # one rounding to D's dtype
    return apply_epilog(d, epilog, epilog_inputs, k)
