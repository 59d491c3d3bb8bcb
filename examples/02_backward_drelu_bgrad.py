"""02: the backward of a fused ReLU layer with the DRELU_BGRAD epilog, and its weight gradient with BGRADB.

Layer 0 (in -> hidden, ReLU) feeds layer 1 (hidden -> out). Given dZ1 = dL/dZ1 (B, out):

    dZ0 = (dZ1 @ W1) * relu'(Z0)      one GEMM, epilog DRELU_BGRAD: the mask is relu_aux0 from the
    db0 = sum over the batch of dZ0   forward (01), and the bias gradient comes out of the same kernel
    dW1 = dZ1^T @ H                   one GEMM, epilog BGRADB: db1 = the batch sum of dZ1, fused

    python examples/02_backward_drelu_bgrad.py [--device cpu|gpu]
"""

from __future__ import annotations

import numpy as np
from _device import gemm_engine, parse_device

from mlptrain.nn.epilogs import Epilog
from mlptrain.nn.execution import FusedExecution

be = parse_device(__doc__.splitlines()[0])
xp, gemm = be.xp, gemm_engine(be)
rng = np.random.default_rng(0)
B, n_in, n_hidden, n_out = 8, 5, 12, 3


def dev(a: np.ndarray) -> object:
    return xp.asarray(a, dtype=xp.float32)


x, W0, b0 = rng.standard_normal((B, n_in)), rng.standard_normal((n_hidden, n_in)), rng.standard_normal(n_hidden)
W1, dZ1 = rng.standard_normal((n_out, n_hidden)), rng.standard_normal((B, n_out))  # (out, hidden), (B, out)

# Forward of layer 0 as in 01: RELU_AUX_BIAS gives H = relu(Z0) and the packed mask relu_aux0.
zt, aux = gemm("example.fwd0", dev(W0), dev(x).T, Epilog.RELU_AUX_BIAS, bias=dev(b0))
H, relu_aux0 = zt.T, aux["relu_aux"]  # (B, hidden), (Mb, B)

fused = FusedExecution(gemm)
# Input gradient: dZ0^T (hidden, B) = W1^T (hidden, out) @ dZ1^T (out, B), epilog DRELU_BGRAD(relu_aux0).
dZ0, db0 = fused.input_grad("example.l1", dev(W1), dev(dZ1), relu_aux0, bias_grad_below=True)
# Weight gradient: dW1^T (hidden, out) = H^T (hidden, B) @ dZ1 (B, out), epilog BGRADB (db1 along the batch).
dW1, db1 = fused.weight_grad("example.l1", H, dev(dZ1), bias_grad=True)

# The reference in float64: the chain rule written out.
z0 = x @ W0.T + b0  # (B, hidden)
h = np.maximum(z0, 0)
ref = {"dZ0": (dZ1 @ W1) * (z0 >= 0), "db0": ((dZ1 @ W1) * (z0 >= 0)).sum(0), "dW1": dZ1.T @ h, "db1": dZ1.sum(0)}
got = {"dZ0": dZ0, "db0": db0, "dW1": dW1, "db1": db1}
for name, want in ref.items():
    have = be.to_host(got[name]).astype(np.float64).reshape(want.shape)
    err = np.abs(have - want).max() / np.abs(want).max()
    print(f"{name:4} {str(tuple(want.shape)):8} max relative error against float64 {err:.2e}")
    assert err < 1e-5, (name, err)
print("02: DRELU_BGRAD and BGRADB matched the chain rule")
