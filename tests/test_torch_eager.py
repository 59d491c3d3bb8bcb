"""mlptrain.torch's eager path on the CPU: the ops' bodies through a torch.autograd.Function, without the custom-op
dispatch, bit for bit the custom op."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from mlptrain.torch import FusedMLP  # noqa: E402


def _run(model: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[list, list]:
    """``([y, x grad, *param grads], [every tensor autograd saved])`` of ``(model(x) * dy).sum()``."""
    saved: list = []
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = model(x)
    y.backward(dy)
    return [y.detach(), x.grad, *(p.grad for p in model.parameters())], saved


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("widths", [[7, 13, 5, 3], [5, 6, 1]], ids=lambda w: "-".join(map(str, w)))
def test_the_eager_function_is_the_custom_op_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, widths: list[int], activation: str, bias: bool
) -> None:
    from mlptrain.torch import ops

    torch.manual_seed(9)
    fused = FusedMLP(widths, activation=activation, bias=bias, bgrad="drelu_bgrad")
    x, dy = torch.randn(10, widths[0]) * 2, torch.randn(10, widths[-1])
    calls: list = []
    op = ops.fused_mlp
    monkeypatch.setattr(ops, "fused_mlp", lambda *args: calls.append(args[3]) or op(*args))
    eager, saved_eager = _run(fused, x, dy)
    with torch.no_grad():
        y_inf = fused(x)
    assert calls == []  # neither training nor no_grad went through the operator
    monkeypatch.setattr(ops, "DIRECT", False)
    through_op, saved_op = _run(fused, x, dy)
    assert len(calls) == 1
    for i, (a, b) in enumerate(zip(eager, through_op, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} (y, dx, params...)"
    assert torch.equal(y_inf, eager[0])
    # the same tensors saved: x, the weights, each layer's input but the first, each aux
    assert len(saved_eager) == len(saved_op) == 1 + 2 * (len(widths) - 1) - 1 + (len(widths) - 2)
    for i, (a, b) in enumerate(zip(saved_eager, saved_op, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"saved tensor {i}"


def test_the_eager_function_under_autocast_and_an_unused_output() -> None:
    torch.manual_seed(10)
    fused = FusedMLP([6, 8, 4])
    x = torch.randn(5, 6, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):
        y = fused(x)
    assert y.dtype == torch.float16 and y.grad_fn is not None
    (x.sum() + 0 * y.sum()).backward()  # y's gradient is zeros: every parameter gradient is zero, in float32
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and not p.grad.any() for p in fused.parameters())
    z = fused(torch.randn(5, 6))  # only parameters require a gradient: no input gradient is computed
    z.sum().backward()
    assert fused.linears[0].weight.grad.abs().sum() > 0
