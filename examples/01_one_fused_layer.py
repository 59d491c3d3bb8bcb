"""01: one fused layer forward, ``y = relu(x @ W^T + b)``, as ONE GEMM with the RELU_AUX_BIAS epilog.

cuBLASLt computes ``D = epilog(A @ B)`` in one kernel: here A = W (out, in), B = X^T (in, B), and the
epilog RELU_AUX_BIAS adds the bias along the rows (M = out), applies ReLU, and writes a second output,
``relu_aux``: one bit per element of D saying whether the pre-activation was >= 0 (the backward needs
it). The naive way is a plain GEMM and three more passes over Z (bias, mask, ReLU).

    python examples/01_one_fused_layer.py [--device cpu|gpu]
"""

from __future__ import annotations

import numpy as np
from _device import gemm_engine, parse_device

from mlptrain.nn.epilogs import Epilog, relu_aux_shape, unpack_relu_mask

be = parse_device(__doc__.splitlines()[0])
xp, gemm = be.xp, gemm_engine(be)
rng = np.random.default_rng(0)
B, n_in, n_out = 4, 5, 12

x = xp.asarray(rng.standard_normal((B, n_in)), dtype=xp.float32)  # (B, in)
W = xp.asarray(rng.standard_normal((n_out, n_in)) * np.sqrt(2 / n_in), dtype=xp.float32)  # (out, in)
b = xp.asarray(rng.standard_normal(n_out) * 0.5, dtype=xp.float32)  # (out,)

# The fused layer: Z^T (out, B) = W (out, in) @ X^T (in, B), epilog RELU_AUX_BIAS with bias b (out,).
# X^T is a free view of the row-major x; the result is column-major, so y = Z^T.T is row-major (B, out).
zt, aux = gemm("example.fwd", W, x.T, Epilog.RELU_AUX_BIAS, bias=b)
y, relu_aux = zt.T, aux["relu_aux"]
print(f"device {be.describe()}: y {tuple(y.shape)} {y.dtype}, relu_aux {tuple(relu_aux.shape)} {relu_aux.dtype}")

# relu_aux is bit-packed: rows Mb = round_up(ceil(M / 8), 16) bytes per column, one column per sample.
mb, n = relu_aux_shape(n_out, B)
assert relu_aux.shape == (mb, n) == (16, B) and relu_aux.dtype == np.uint8
print(f"relu_aux: Mb = round_up(ceil({n_out} / 8), 16) = {mb} bytes per sample, {B} samples")

# The naive layer, pass by pass, on the host in float64: the reference the fused result must match.
z = be.to_host(x).astype(np.float64) @ be.to_host(W).astype(np.float64).T + be.to_host(b)  # (B, out)
y_ref = np.maximum(z, 0.0)
err = np.abs(be.to_host(y) - y_ref).max() / np.abs(y_ref).max()
print(f"max |y - relu(x W^T + b)| / max |y| = {err:.2e}")
assert err < 1e-5, err

# Bit i of sample s is bit i % 8 (least significant first) of byte i // 8 of column s: z[s, i] >= 0.
mask = be.to_host(unpack_relu_mask(relu_aux, n_out)).T  # (out, B) -> (B, out) bool
clear = np.abs(z) > 1e-5  # a pre-activation this close to 0 may round either way in float32
assert (mask == (z >= 0))[clear].all()
col = be.to_host(relu_aux)[:, 0]
print(f"sample 0: bytes 0-1 of its column {col[0]:08b} {col[1]:08b} (MSB first), signs of z[0]:", end=" ")
print("".join("1" if v >= 0 else "0" for v in z[0, ::-1]))
print(f"relu_aux: {relu_aux.nbytes} bytes here (padded to 16 a sample); a bool mask takes 8x more at out=4096")
print("01: the fused forward matched the float64 reference")
