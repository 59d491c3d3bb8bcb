"""mlptrain.torch at its edges (issue #47): a second-order gradient, a pre-activation of exactly 0, a batch of
no rows and inputs of the wrong shape."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from mlptrain.base.errors import ConfigError  # noqa: E402
from mlptrain.torch import FusedLinear, FusedMLP, ops  # noqa: E402
from mlptrain.torch.ops import SecondOrderError  # noqa: E402


def _pair(widths: list[int], activation: str = "relu") -> tuple[FusedMLP, nn.Sequential]:
    torch.manual_seed(0)
    fused = FusedMLP(widths, activation=activation, dtype=torch.float64)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b, dtype=torch.float64))
        if i < len(widths) - 2:
            layers.append(nn.ReLU() if activation == "relu" else nn.GELU(approximate="tanh"))
    seq = nn.Sequential(*layers)
    seq.load_state_dict(fused.state_dict())
    return fused, seq


@pytest.mark.parametrize("direct", [True, False], ids=["eager-function", "custom-op"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_a_gradient_penalty_through_the_chain_is_an_error_not_a_dropped_term(
    monkeypatch: pytest.MonkeyPatch, direct: bool, activation: str
) -> None:
    """Before: ``grad(..., create_graph=True)`` gave a first-order gradient and the penalty's backward left
    the chain's second-order term out (nn.Sequential's parameters got it, FusedMLP's did not)."""
    monkeypatch.setattr(ops, "DIRECT", direct)
    fused, _ = _pair([3, 5, 2], activation)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    (dx,) = torch.autograd.grad(fused(x).sum(), x, create_graph=True)
    assert dx.requires_grad  # the first-order gradient itself is right and usable
    with pytest.raises(SecondOrderError, match=r"^FusedMLP/FusedLinear have no second-order gradient: their back"):
        (dx**2).sum().backward()
    assert all(p.grad is None for p in fused.parameters())  # nothing accumulated from a penalty without its term
    y = fused(x)  # the penalty beside the loss: before, backward gave the loss's gradients alone, without a word
    (dx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(SecondOrderError, match="use nn.Sequential of nn.Linear for that model"):
        (y.sum() + 0.1 * (dx**2).sum()).backward()


def test_first_order_gradients_are_unchanged_under_create_graph() -> None:
    fused, seq = _pair([3, 5, 2])
    x = torch.randn(4, 3, dtype=torch.float64)
    got = torch.autograd.grad(fused(x).sum(), list(fused.parameters()), create_graph=True)
    want = torch.autograd.grad(seq(x).sum(), list(seq.parameters()))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.detach(), w, rtol=1e-12, atol=1e-12)


def test_at_a_pre_activation_of_exactly_zero_relus_gradient_is_one_as_cublaslts() -> None:
    """docs/torch.md: the relu_aux mask is ``Z >= 0`` (cuBLASLt's, the NumPy contract's), so relu'(0) = 1,
    where nn.ReLU takes relu'(0) = 0. With zero biases an all-zero row has Z = 0 in the hidden layer: its
    gradient reaches the hidden bias and the input through FusedMLP and not through nn.Sequential."""
    fused, seq = _pair([2, 3, 1])
    with torch.no_grad():
        for model in (fused, seq):
            model.get_submodule("0").bias.zero_()  # children "0", "2": nn.Sequential's layout
    x = torch.tensor([[0.0, 0.0], [1.0, -2.0]], dtype=torch.float64)  # row 0: padding, Z = 0 exactly
    out = {}
    for name, model in (("fused", fused), ("seq", seq)):
        xi = x.clone().requires_grad_(True)
        model(xi).sum().backward()
        out[name] = (model.get_submodule("0").bias.grad.clone(), xi.grad.clone())
    W0, W1 = fused.linears[0].weight.detach(), fused.linears[1].weight.detach()  # (3, 2), (1, 3)
    z1 = x[1] @ W0.T  # (3,): row 1's pre-activations
    mask1 = (z1 >= 0).double()
    torch.testing.assert_close(out["fused"][0], W1[0] * (1.0 + mask1), rtol=0, atol=1e-15)  # row 0 counts fully
    torch.testing.assert_close(out["seq"][0], W1[0] * (z1 > 0).double(), rtol=0, atol=1e-15)  # row 0 counts 0
    torch.testing.assert_close(out["fused"][1][0], W0.T @ W1[0], rtol=0, atol=1e-15)
    assert out["seq"][1][0].abs().max().item() == 0.0
    torch.testing.assert_close(out["fused"][1][1], out["seq"][1][1])  # away from 0 the two agree


@pytest.mark.parametrize("shape", [(0, 3), (2, 0, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_batch_of_no_rows_gives_an_empty_output_and_zero_gradients(shape: tuple[int, ...], bias: bool) -> None:
    """Before: the forward ran, the backward raised the contract's raw relu_aux stride error."""
    torch.manual_seed(0)
    fused = FusedMLP([3, 4, 2], bias=bias)
    x = torch.zeros(shape, requires_grad=True)
    y = fused(x)
    assert y.shape == (*shape[:-1], 2) and y.dtype == torch.float32
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == shape
    for p in fused.parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.abs().max().item() == 0.0
    with torch.no_grad():
        assert fused(torch.zeros(0, 3)).shape == (0, 2)
    layer = FusedLinear(3, 2, activation="gelu")
    assert layer(torch.zeros(0, 3)).shape == (0, 2)


@pytest.mark.parametrize(
    ("x", "shape"),
    [(torch.tensor(1.0), r"\(\)"), (torch.zeros(4, 5), r"\(4, 5\)"), (torch.zeros(0, 2), r"\(0, 2\)")],
)
def test_a_0d_or_wrong_width_input_is_one_error_naming_its_shape_and_in_features(x: torch.Tensor, shape: str) -> None:
    """Before: a 0-d input raised IndexError: tuple index out of range."""
    with pytest.raises(ConfigError, match=rf"^FusedMLP got an input of shape {shape}; expected \(\.\.\., 3\), its in_"):
        FusedMLP([3, 4, 2])(x)
