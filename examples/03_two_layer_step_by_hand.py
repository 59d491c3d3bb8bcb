"""03: one training step of a two-layer MLP written out by hand, against mlptrain's own step.

The framework's step (``Trainer.step``) runs the fused chain: layer 0's GEMM with RELU_AUX_BIAS, the
head's GEMM with BIAS, softmax cross-entropy, the head's weight gradient (BGRADB), the input gradient
through layer 0's mask (DRELU, or DRELU_BGRAD), layer 0's weight gradient, and one SGD update of every
parameter. Here the same step is written in float64 NumPy from the same weights and batch, and the
updated weights are compared.

    python examples/03_two_layer_step_by_hand.py [--device cpu|gpu]
"""

from __future__ import annotations

import numpy as np
from _device import parse_device

from mlptrain import Trainer
from mlptrain.config.schema import Device, Schedule, TrainConfig

be = parse_device(__doc__.splitlines()[0])
cfg = TrainConfig()  # the default dataset: digits, 64 features, 10 classes, shipped with mlptrain
cfg.device = Device.gpu if be.is_gpu else Device.cpu
cfg.model.hidden = [32]  # 64 -> 32 (ReLU) -> 10
cfg.optimizer.momentum = 0.0  # plain SGD: W <- W - lr * dW
cfg.optimizer.schedule = Schedule.constant
cfg.graph = False  # the GPU step run as written, not replayed from a CUDA graph
tr = Trainer(cfg)
lr = cfg.optimizer.lr

params = {k: be.to_host(v).astype(np.float64) for k, v in tr.model.state_dict().items()}
print("parameters:", ", ".join(f"{k} {v.shape}" for k, v in params.items()))
W0, b0, W1, b1 = (params[k] for k in ("layer0.weight", "layer0.bias", "layer1.weight", "layer1.bias"))

rng = np.random.default_rng(0)
x = rng.standard_normal((64, 64)).astype(np.float32)  # (B, in): a batch of already normalised features
y = rng.integers(0, 10, 64)  # (B,) class labels
B = len(y)

# Forward.
z0 = x @ W0.T + b0  # (B, 64) @ (64, 32) -> (B, 32)          fused: RELU_AUX_BIAS, which also keeps z0 >= 0
h = np.maximum(z0, 0)
logits = h @ W1.T + b1  # (B, 32) @ (32, 10) -> (B, 10)      fused: BIAS
p = np.exp(logits - logits.max(1, keepdims=True))
p /= p.sum(1, keepdims=True)
loss = -np.log(p[np.arange(B), y]).mean()

# Backward.
dlogits = (p - np.eye(10)[y]) / B  # (B, 10)                 dL/dlogits of the mean cross-entropy
dW1, db1 = dlogits.T @ h, dlogits.sum(0)  # (10, 32), (10,)    fused: BGRADB
dz0 = (dlogits @ W1) * (z0 >= 0)  # (B, 32)                   fused: DRELU from relu_aux (or DRELU_BGRAD)
dW0, db0 = dz0.T @ x, dz0.sum(0)  # (32, 64), (32,)            fused: BGRADB (or db0 from DRELU_BGRAD)

# SGD.
want = {
    "layer0.weight": W0 - lr * dW0,
    "layer0.bias": b0 - lr * db0,
    "layer1.weight": W1 - lr * dW1,
    "layer1.bias": b1 - lr * db1,
}
step_loss, _ = tr.step(tr.xp.asarray(x), tr.xp.asarray(y))  # the framework's step on the same batch
print(f"loss by hand {loss:.6f}, mlptrain {float(step_loss):.6f}")  # float() reads the loss back (a sync)
assert abs(float(step_loss) - loss) < 1e-5 * loss
for name, value in tr.model.state_dict().items():
    err = np.abs(be.to_host(value) - want[name]).max() / np.abs(want[name]).max()
    print(f"{name:13} after the step: max relative difference from the hand-written step {err:.1e}")
    assert err < 1e-5, (name, err)
if be.is_gpu:  # each GEMM call site planned once (nvmath Matmul.plan), then only executed
    plans = tr.gemm.num_plans
    tr.step(tr.xp.asarray(x), tr.xp.asarray(y))
    print(f"nvmath plans made: {plans} by the first step, {tr.gemm.num_plans - plans} more by the second")
print("03: mlptrain's fused step is the hand-written step")
