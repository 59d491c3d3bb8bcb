"""06: ``FusedMLP`` inside an ordinary PyTorch training loop, checked against ``nn.Sequential``.

``mlptrain.torch.FusedMLP(widths)`` is an ``nn.Module`` whose hidden layers run as fused cuBLASLt GEMMs
on CUDA tensors (RELU_AUX_BIAS forward, DRELU / DRELU_BGRAD and BGRADB backward, through the same
engine as the trainer) and through the NumPy epilog contract on CPU tensors. Its parameters are
ordinary ``nn.Parameter``s: any torch optimizer, ``state_dict``, autocast and ``GradScaler`` work.
Needs the ``torch`` extra.

    python examples/06_torch_fusedmlp.py
"""

from __future__ import annotations

import torch
from torch import nn

from mlptrain.torch import FusedMLP

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
fused = FusedMLP([20, 64, 64, 3]).to(device)  # in, hidden, hidden, out

# The same network as nn.Sequential: FusedMLP's children sit where Sequential's do ("0", "2", "4"), so
# the state_dicts are interchangeable.
reference = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3)).to(device)
reference.load_state_dict(fused.state_dict())

x = torch.randn(256, 20, device=device)  # (B, in)
y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # (B,) three classes
loss_fn = nn.CrossEntropyLoss()

# One forward and backward of each: the same loss and the same gradients.
loss_fused, loss_ref = loss_fn(fused(x), y), loss_fn(reference(x), y)
loss_fused.backward()
loss_ref.backward()
print(f"loss FusedMLP {loss_fused.item():.6f}, nn.Sequential {loss_ref.item():.6f}")
assert torch.allclose(loss_fused, loss_ref, rtol=1e-5)
for (name, p), q in zip(fused.named_parameters(), reference.parameters(), strict=True):
    assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
print("gradients equal to nn.Sequential's")

# A plain PyTorch loop: zero_grad, forward, loss, backward, step.
opt = torch.optim.Adam(fused.parameters(), lr=1e-2)
for step in range(101):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(fused(x), y)
    loss.backward()
    opt.step()
    if step % 25 == 0:
        print(f"step {step:3d}  loss {loss.item():.4f}")  # .item() syncs the device
acc = (fused(x).argmax(1) == y).float().mean().item()
print(f"training accuracy {acc:.3f} on {device}")
assert acc > 0.9, acc
print("06: FusedMLP trained in a PyTorch loop")
