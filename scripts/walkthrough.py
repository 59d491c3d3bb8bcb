"""A runnable walk-through of mlptrain's fused layer, to read beside docs/tutorial.md.

    python scripts/walkthrough.py              # device auto: nvmath on a GPU, the NumPy engine on the CPU
    python scripts/walkthrough.py --device cpu

1. One fused layer, ``y = relu(x @ W^T + b)``: the GEMM and its RELU_AUX_BIAS epilog, the shapes,
   dtypes and strides of the result and of ``relu_aux``, the mask bits of one sample against the
   sign of its pre-activation, and the same layer done naively.
2. The backward through two layers with the epilogs DRELU_BGRAD, DRELU and BGRADB, against naive.
3. A two-layer MLP on the digits dataset: a few SGD steps, fused and naive side by side.

Every check is an assertion: the script exits non-zero if fused and naive disagree. Float32
throughout; on the CPU fused and naive issue the same BLAS calls and agree bit for bit.

Run with mlptrain installed (``make install``) or with ``PYTHONPATH=.`` at the repository's root.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from mlptrain.backend import Backend, get_backend
from mlptrain.config import DataConfig
from mlptrain.data import load_dataset
from mlptrain.epilogs import Epilog, relu_aux_shape, unpack_relu_mask
from mlptrain.execution import FusedExecution, NaiveExecution, NumpyGemm
from mlptrain.losses import softmax_cross_entropy
from mlptrain.network import MLP

TOL = 1e-5  # float32: largest difference between fused and naive, relative to the largest value


def layout(a: Any) -> str:
    """``shape dtype order strides`` of an array, the way the tutorial talks about it."""
    f, c = a.flags.f_contiguous, a.flags.c_contiguous
    order = "C- and F-contiguous" if f and c else "C-contiguous (row-major)" if c else "F-contiguous (column-major)"
    if not (f or c):
        order = "not contiguous"
    return f"shape {tuple(a.shape)} {a.dtype}, {order}, strides {tuple(a.strides)} bytes"


def max_rel_diff(be: Backend, a: Any, b: Any) -> float:
    """``max |a - b| / max |b|`` on the host (0 when both are zero)."""
    a, b = be.to_host(a).astype(np.float64), be.to_host(b).astype(np.float64)
    scale = max(float(np.abs(b).max()), 1e-30)
    return float(np.abs(a - b).max()) / scale


def check(be: Backend, what: str, fused: Any, naive: Any) -> None:
    d = max_rel_diff(be, fused, naive)
    print(f"  {what:<44} max |fused - naive| / max |naive| = {d:.3g}")
    assert d <= TOL, f"{what}: fused and naive differ by {d:.3g} (> {TOL})"


def make_gemm(be: Backend) -> Any:
    if be.is_gpu:
        from mlptrain.gpu.gemm import NvmathGemm

        return NvmathGemm()  # one planned nvmath Matmul per call site and operand signature
    return NumpyGemm()  # the epilog contract of mlptrain/epilogs.py, in NumPy


def one_layer(be: Backend, gemm: Any, rng: np.random.Generator) -> tuple[Any, ...]:
    xp = be.xp
    B, n_in, n_out = 4, 5, 12
    print(f"\n== 1. one fused layer: y = relu(x @ W^T + b), batch B={B}, in={n_in}, out={n_out}")
    x = xp.asarray(rng.standard_normal((B, n_in)), dtype=xp.float32)  # (B, in)
    W = xp.asarray(rng.standard_normal((n_out, n_in)) * np.sqrt(2 / n_in), dtype=xp.float32)  # (out, in)
    b = xp.asarray(rng.standard_normal(n_out) * 0.5, dtype=xp.float32)  # (out,)
    print(f"x: {layout(x)}")
    print(f"W: {layout(W)}")
    print(f"b: {layout(b)}")

    # What FusedExecution.forward does: the transposed product, so the epilog's bias runs along M = out.
    print("fused: one GEMM, Z^T (out, B) = W (out, in) @ X^T (in, B), epilog RELU_AUX_BIAS")
    print(f"  X^T is a free view of x: {layout(x.T)}")
    zt, aux = gemm("walk.fwd", W, x.T, Epilog.RELU_AUX_BIAS, bias=b)
    relu_aux = aux["relu_aux"]
    print(f"  result Z^T: {layout(zt)}")
    y = zt.T
    print(f"  y = Z^T.T:  {layout(y)}  <- the next layer's input, no copy")
    same = y.data.ptr == zt.data.ptr if be.is_gpu else np.shares_memory(y, zt)
    print(f"  y and Z^T share memory: {same}")
    mb, n = relu_aux_shape(n_out, B)
    print(f"  relu_aux:   {layout(relu_aux)}")
    print(f"  Mb = round_up(ceil(M / 8), 16) = round_up(ceil({n_out} / 8), 16) = {mb}; N = B = {n}")
    assert relu_aux.shape == (mb, n) and relu_aux.dtype == np.uint8

    # The bits of sample 0 (column 0) against the sign of its pre-activation.
    z = be.to_host(x @ W.T + b)  # (B, out) pre-activation, for the dump only
    col = be.to_host(relu_aux)[:, 0]
    print("  sample 0: element i of the column is bit i % 8 (LSB first) of byte i // 8")
    print(f"    bytes 0-1 of column 0: {col[0]:08b} {col[1]:08b} (bits printed MSB first); bytes 2-{mb - 1}: padding")
    print("      i    z[0, i]   z >= 0   byte  bit  relu_aux bit")
    for i in range(n_out):
        bit = (int(col[i // 8]) >> (i % 8)) & 1
        print(f"    {i:3d} {z[0, i]:+10.4f}   {str(bool(z[0, i] >= 0)):6}  {i // 8:4d} {i % 8:4d}  {bit:4d}")
        if abs(z[0, i]) > 1e-5:  # a value this close to 0 may round to either side
            assert bit == (z[0, i] >= 0), f"bit {i} of sample 0 does not match the sign of z"

    print("naive: Z = X @ W^T (plain GEMM); Z += b; mask = Z >= 0; Z = max(Z, 0): three more passes over Z")
    naive = NaiveExecution(gemm, xp)
    y_naive, mask = naive.forward("walk", W, b, x, activation="relu")
    print(f"  y: {layout(y_naive)}; mask: {layout(mask)}")
    check(be, "forward output y", y, y_naive)
    unpacked = be.to_host(unpack_relu_mask(relu_aux, n_out)).T  # (out, B) bool -> (B, out)
    near_zero = np.abs(z) <= 1e-5
    agree = (unpacked == be.to_host(mask)) | near_zero
    print(f"  unpack_relu_mask(relu_aux).T equals the naive bool mask: {bool(agree.all())}")
    assert agree.all()
    big_m, big_b = 4096, 8192
    aux_bytes = relu_aux_shape(big_m, big_b)[0] * big_b
    print(
        f"  memory per mask: relu_aux {relu_aux.nbytes} bytes here vs a bool mask of {mask.nbytes}; at out={big_m}, "
        f"B={big_b}: {aux_bytes / 2**20:.0f} MiB vs {big_m * big_b / 2**20:.0f} MiB (1 bit vs 1 byte per element)"
    )
    return x, W, b, y, relu_aux, y_naive, mask


def two_layer_backward(be: Backend, gemm: Any, rng: np.random.Generator, layer0: tuple[Any, ...]) -> None:
    xp = be.xp
    x, W0, b0, h, relu_aux0, h_naive, mask0 = layer0
    B, n_hidden, n_out = h.shape[0], h.shape[1], 3
    print(f"\n== 2. backward through two layers: in -> {n_hidden} (ReLU) -> {n_out}, batch {B}")
    W1 = xp.asarray(rng.standard_normal((n_out, n_hidden)) / np.sqrt(n_hidden), dtype=xp.float32)
    dz1 = xp.asarray(rng.standard_normal((B, n_out)), dtype=xp.float32)  # dL/dlogits, (B, out)
    fused, naive = FusedExecution(gemm), NaiveExecution(gemm, xp)
    print(f"dz1 = dL/dZ1 (the loss gradient of the logits): {layout(dz1)}")

    print("weight gradient of layer 1: dW1^T (hidden, out) = H^T (hidden, B) @ dZ1 (B, out), epilog BGRADB")
    dW1, db1 = fused.weight_grad("walk.l1", h, dz1, bias_grad=True)
    dW1_n, db1_n = naive.weight_grad("walk.l1", h_naive, dz1, bias_grad=True)
    print(f"  dW1 = result.T: {layout(dW1)} (W1's own layout); db1 = bgradb, dZ1 summed over the batch: {db1.shape}")
    check(be, "dW1", dW1, dW1_n)
    check(be, "db1 (BGRADB)", db1, db1_n)

    print("input gradient, strategy drelu_bgrad: dZ0^T (hidden, B) = W1^T @ dZ1^T, epilog DRELU_BGRAD(relu_aux0)")
    dz0, db0 = fused.input_grad("walk.l1", W1, dz1, relu_aux0, bias_grad_below=True)
    dz0_n, db0_n = naive.input_grad("walk.l1", W1, dz1, mask0, bias_grad_below=True)
    print(f"  dZ0 = result.T: {layout(dz0)}; db0 = drelu_bgrad, row sums over the batch: {db0.shape}")
    check(be, "dZ0 = (dZ1 @ W1) * relu'(Z0)", dz0, dz0_n)
    check(be, "db0 (DRELU_BGRAD)", db0, db0_n)

    print("input gradient, strategy bgradb: epilog DRELU, then layer 0's weight-gradient GEMM with BGRADB")
    dz0b, none = fused.input_grad("walk.l1b", W1, dz1, relu_aux0, bias_grad_below=False)
    assert none is None
    dW0, db0b = fused.weight_grad("walk.l0", x, dz0b, bias_grad=True)
    dW0_n, _ = naive.weight_grad("walk.l0", x, dz0_n, bias_grad=False)
    check(be, "dZ0 (DRELU)", dz0b, dz0_n)
    check(be, "db0 (BGRADB in the wgrad GEMM)", db0b, db0_n)
    check(be, "dW0", dW0, dW0_n)


def train_mlp(be: Backend, gemm: Any, steps: int = 30, lr: float = 0.1) -> None:
    xp = be.xp
    ds = load_dataset(DataConfig(), seed=0)  # digits: 64 features, 10 classes, shipped with mlptrain
    widths = [ds.num_features, 32, ds.num_classes]
    print(f"\n== 3. a two-layer MLP {'-'.join(map(str, widths))} on digits: {steps} SGD steps, batch 64, lr {lr}")
    nets = {}
    for mode, ex in (("fused", FusedExecution(gemm)), ("naive", NaiveExecution(gemm, xp))):
        nets[mode] = MLP(
            widths,
            execution=ex,
            xp=xp,
            rng=np.random.default_rng(0),  # the same initial weights for both
            param_dtype=xp.float32,
            compute_dtype=xp.float32,
        )
    x_all = xp.asarray(ds.x_train, dtype=xp.float32)
    y_all = xp.asarray(ds.y_train)
    losses: dict[str, list[float]] = {"fused": [], "naive": []}
    for step in range(steps):
        lo = (step * 64) % (len(ds.y_train) - 64)
        x, y = x_all[lo : lo + 64], y_all[lo : lo + 64]  # (64, 64), (64,)
        for mode, net in nets.items():
            logits = net.forward(x)  # fused: RELU_AUX_BIAS then BIAS
            loss, dlogits, _ = softmax_cross_entropy(logits, y)
            net.backward(dlogits)  # fused: BGRADB, DRELU, BGRADB
            for p in net.params:
                p.value -= lr * p.grad  # plain SGD; float32 weights are their own compute copy
            losses[mode].append(float(loss))  # float() reads the loss back (a device sync on the GPU)
        if step % 5 == 0 or step == steps - 1:
            f, n = losses["fused"][-1], losses["naive"][-1]
            print(f"  step {step:3d}  loss fused {f:.6f}  naive {n:.6f}  |diff| {abs(f - n):.2g}")
    f, n = np.array(losses["fused"]), np.array(losses["naive"])
    rel = float(np.max(np.abs(f - n) / np.abs(n)))
    print(f"  largest relative loss difference over {steps} steps: {rel:.3g}")
    assert rel <= (1e-4 if be.is_gpu else TOL), rel
    assert f[-5:].mean() < 0.5 * f[:5].mean(), "the loss should go down"
    for pf, pn in zip(nets["fused"].params, nets["naive"].params, strict=True):
        assert max_rel_diff(be, pf.value, pn.value) <= (1e-4 if be.is_gpu else TOL), pf.name
    print(f"  the loss went down from {f[:5].mean():.3f} to {f[-5:].mean():.3f} (mean of the first and last 5 steps)")
    if be.is_gpu:
        print(f"  nvmath plans made: {gemm.num_plans} (once per call site and shape; every later step reused them)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    args = parser.parse_args(argv)
    be = get_backend(args.device)
    gemm = make_gemm(be)
    engine = "NvmathGemm (planned nvmath Matmuls, cuBLASLt epilogs)" if be.is_gpu else "NumpyGemm (mlptrain/epilogs.py)"
    print(f"== 0. device: {be.describe()}; GEMM engine: {engine}")
    rng = np.random.default_rng(7)
    layer0 = one_layer(be, gemm, rng)
    two_layer_backward(be, gemm, rng, layer0)
    train_mlp(be, gemm)
    print("\nwalkthrough: all fused results matched naive")
    return 0


if __name__ == "__main__":
    sys.exit(main())
