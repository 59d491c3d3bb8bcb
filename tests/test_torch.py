"""mlptrain.torch on the CPU: FusedMLP and FusedLinear against nn.Sequential, through the NumPy epilog contract
(the cuBLASLt engine's host side: tests/test_torch_lt.py; the eager path: tests/test_torch_eager.py)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from mlptrain.base.errors import ConfigError, DeviceError  # noqa: E402
from mlptrain.nn.epilogs import Epilog, gelu_grad, unpack_relu_mask  # noqa: E402
from mlptrain.torch import FusedLinear, FusedMLP, engines  # noqa: E402

TOL = {torch.float64: 1e-12, torch.float32: 2e-6}
# odd widths; a hidden layer of 1 and an output of 1 (K = 1 in the input-gradient GEMM, N = 1 in BGRADB)
WIDTHS = [[7, 13, 5, 3], [9, 1, 4], [5, 6, 1], [3, 2]]


def act_module(activation: str | None) -> nn.Module:
    return {"relu": nn.ReLU(), "gelu": nn.GELU(approximate="tanh"), None: nn.Identity()}[activation]


def sequential(widths: list[int], activation: str, bias: bool, dtype: torch.dtype) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b, bias=bias, dtype=dtype))
        if i < len(widths) - 2:
            layers.append(act_module(activation))
    return nn.Sequential(*layers)


def grads(model: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, list, torch.Tensor]:
    """``(y, [param grads], x grad)`` of ``(model(x) * dy).sum()``."""
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.backward(dy)
    return y.detach(), [p.grad for p in model.parameters()], x.grad


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    scale = max(expected.abs().max().item(), 1e-6)
    err = (actual.double() - expected.double()).abs().max().item() / scale
    assert err <= tol, f"{what}: max error {err:.3g} relative to max |ref| {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: "-".join(map(str, w)))
def test_fused_mlp_matches_nn_sequential(widths: list[int], activation: str, bias: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    fused = FusedMLP(widths, activation=activation, bias=bias, dtype=dtype)
    torch.manual_seed(0)  # the same draws: FusedMLP initialises as nn.Linear does, layer by layer
    ref = sequential(widths, activation, bias, dtype)
    for (k, a), (kr, b) in zip(fused.state_dict().items(), ref.state_dict().items(), strict=True):
        assert k == kr and torch.equal(a, b), k
    x = torch.randn(11, widths[0], dtype=dtype) * 2  # many pre-activations on each side of zero
    dy = torch.randn(11, widths[-1], dtype=dtype)
    y, g, gx = grads(fused, x, dy)
    y_ref, g_ref, gx_ref = grads(ref, x, dy)
    assert y.dtype == dtype and y.shape == y_ref.shape
    assert_close(y, y_ref, TOL[dtype], "output")
    assert_close(gx, gx_ref, TOL[dtype], "input gradient")
    assert len(g) == len(g_ref) == (2 if bias else 1) * (len(widths) - 1)
    for i, (a, b) in enumerate(zip(g, g_ref, strict=True)):
        assert a.dtype == dtype and a.shape == b.shape
        assert_close(a, b, TOL[dtype], f"gradient of parameter {i}")


@pytest.mark.parametrize("bgrad", ["bgradb", "drelu_bgrad", ["drelu_bgrad", "bgradb"], ["bgradb", "drelu_bgrad"]])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_every_bgrad_strategy_gives_the_bias_gradients(bgrad: object, activation: str) -> None:
    torch.manual_seed(1)
    fused = FusedMLP([6, 10, 9, 4], activation=activation, bgrad=bgrad, dtype=torch.float64)
    ref = sequential([6, 10, 9, 4], activation, True, torch.float64)
    ref.load_state_dict(fused.state_dict())
    x, dy = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    _, g, _ = grads(fused, x, dy)
    _, g_ref, _ = grads(ref, x, dy)
    for i, (a, b) in enumerate(zip(g, g_ref, strict=True)):
        assert_close(a, b, 1e-12, f"gradient of parameter {i}")


class EpilogLog:
    """The CPU engine's GEMMs, recorded: every call goes on to the contract's matmul."""

    def __init__(self, gemm: object) -> None:
        self.inner, self.calls = gemm, []

    def __call__(self, key: str, a: object, b: object, epilog: object = None, **inputs: object) -> object:
        self.calls.append((key, epilog))
        return self.inner(key, a, b, epilog, **inputs)

    def release_operands(self, prefix: object = None) -> None:
        self.inner.release_operands(prefix)


@pytest.fixture
def epilog_log(monkeypatch: pytest.MonkeyPatch) -> EpilogLog:
    rec = EpilogLog(engines._NUMPY.gemm)
    monkeypatch.setattr(engines._NUMPY, "gemm", rec)
    return rec


def test_training_and_inference_run_the_epilogs_of_the_contract(epilog_log: EpilogLog) -> None:
    fused = FusedMLP([5, 8, 8, 3], bgrad=["bgradb", "drelu_bgrad"], dtype=torch.float64)
    x = torch.randn(4, 5, dtype=torch.float64)
    with torch.no_grad():
        fused(x)
    assert epilog_log.calls == [("0.fwd", Epilog.RELU_BIAS), ("1.fwd", Epilog.RELU_BIAS), ("2.fwd", Epilog.BIAS)]
    epilog_log.calls.clear()
    fused(x).sum().backward()
    assert epilog_log.calls == [
        ("0.fwd", Epilog.RELU_AUX_BIAS),
        ("1.fwd", Epilog.RELU_AUX_BIAS),
        ("2.fwd", Epilog.BIAS),
        ("2.wgrad", Epilog.BGRADB),  # the top layer's bias gradient
        ("2.dgrad", Epilog.DRELU_BGRAD),  # layer 1 takes its bias gradient from above (drelu_bgrad)
        ("1.wgrad", None),
        ("1.dgrad", Epilog.DRELU),
        ("0.wgrad", Epilog.BGRADB),  # layer 0 reduces its own (bgradb); no input gradient was asked for
    ]


def test_no_bias_and_gelu_use_the_epilogs_without_bias(epilog_log: EpilogLog) -> None:
    FusedMLP([5, 8, 3], activation="gelu", bias=False, dtype=torch.float64)(torch.randn(4, 5, dtype=torch.float64))
    with torch.no_grad():
        FusedLinear(5, 8, bias=False, activation="relu", dtype=torch.float64)(torch.randn(4, 5, dtype=torch.float64))
    assert epilog_log.calls == [("0.fwd", Epilog.GELU_AUX), ("1.fwd", None), ("0.fwd", Epilog.RELU_BIAS)]


def test_no_grad_keeps_nothing_and_gives_the_training_output() -> None:
    fused = FusedMLP([5, 8, 3], dtype=torch.float64)
    x = torch.randn(4, 5, dtype=torch.float64)
    weights = [fused.linears[0].weight, fused.linears[1].weight]
    biases = [fused.linears[0].bias, fused.linears[1].bias]
    kept = torch.ops.mlptrain.fused_mlp(x, weights, biases, "relu,none", True, "auto")
    bare = torch.ops.mlptrain.fused_mlp(x, weights, biases, "relu,none", False, "auto")
    assert [t.shape for t in kept] == [(4, 3), (4, 8), (4, 16)]  # y, layer 1's input, relu_aux (B, Mb) uint8
    assert kept[2].dtype == torch.uint8 and len(bare) == 1
    assert torch.equal(kept[0], bare[0])
    with torch.no_grad():
        y = fused(x)
    assert y.grad_fn is None and torch.equal(y, kept[0])


@pytest.mark.parametrize("activation", ["relu", "gelu", None])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_linear_matches_nn_linear_with_its_activation(activation: str | None, bias: bool) -> None:
    torch.manual_seed(2)
    fused = FusedLinear(6, 9, bias=bias, activation=activation, dtype=torch.float64)
    torch.manual_seed(2)
    ref = nn.Sequential(nn.Linear(6, 9, bias=bias, dtype=torch.float64), act_module(activation))
    assert torch.equal(fused.weight, ref[0].weight)
    x = torch.randn(2, 5, 6, dtype=torch.float64) * 2  # leading dimensions, as nn.Linear takes them
    dy = torch.randn(2, 5, 9, dtype=torch.float64)
    y, g, gx = grads(fused, x, dy)
    y_ref, g_ref, gx_ref = grads(ref, x, dy)
    assert y.shape == (2, 5, 9)
    pairs = [(y, y_ref, "output"), (gx, gx_ref, "input gradient")]
    pairs += list(zip(g, g_ref, ["dW", "db"][: len(g)], strict=True))
    for a, b, what in pairs:
        assert_close(a, b, 1e-12, what)


def test_state_dict_loads_either_way() -> None:
    fused = FusedMLP([4, 6, 6, 2], activation="gelu")
    ref = sequential([4, 6, 6, 2], "gelu", True, torch.float32)
    assert list(fused.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    fused.load_state_dict(ref.state_dict())  # strict: the same keys and shapes
    x = torch.randn(3, 4)
    assert_close(fused(x).detach(), ref(x).detach(), 2e-6, "after loading nn.Sequential's")
    other = FusedMLP([4, 6, 6, 2], activation="gelu")
    ref.load_state_dict(other.state_dict())
    assert_close(ref(x).detach(), other(x).detach(), 2e-6, "nn.Sequential after loading FusedMLP's")


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_autocast_float16_runs_in_half_with_float32_parameters(activation: str) -> None:
    torch.manual_seed(3)
    fused = FusedMLP([16, 32, 8], activation=activation)
    ref = sequential([16, 32, 8], activation, True, torch.float32)
    ref.load_state_dict(fused.state_dict())
    exact = sequential([16, 32, 8], activation, True, torch.float64)
    exact.load_state_dict(fused.state_dict())
    x, dy = torch.randn(12, 16), torch.randn(12, 8)
    _, g64, _ = grads(exact, x.double(), dy.double())
    errors = {}
    for name, model in (("fused", fused), ("torch", ref)):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            y = model(x)
        assert y.dtype == torch.float16
        (y.float() * dy).sum().backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        errors[name] = max(
            (p.grad.double() - g).abs().max().item() / g.abs().max().item()
            for p, g in zip(model.parameters(), g64, strict=True)
        )
    # at torch's own error against float64. (A pre-activation that rounds across zero flips a ReLU's
    # mask for both, an O(1) error in one element; GELU's derivative is smooth: half's rounding only.)
    assert errors["fused"] <= 2 * errors["torch"] + 2e-3, errors
    if activation == "gelu":
        assert errors["fused"] < 2e-2, errors


def test_a_training_loop_with_sgd_momentum_and_grad_scaler_matches_nn_sequential() -> None:
    torch.manual_seed(4)
    fused = FusedMLP([10, 12, 12, 3], dtype=torch.float64)
    ref = sequential([10, 12, 12, 3], "relu", True, torch.float64)
    ref.load_state_dict(fused.state_dict())
    x, labels = torch.randn(32, 10, dtype=torch.float64), torch.randint(0, 3, (32,))
    for model in (fused, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            scaler.scale(nn.functional.cross_entropy(model(x), labels)).backward()
            scaler.step(opt)
            scaler.update()
    for (k, a), b in zip(fused.state_dict().items(), ref.state_dict().values(), strict=True):
        assert_close(a, b, 1e-10, k)
    assert not torch.equal(fused.state_dict()["0.weight"], FusedMLP([10, 12, 12, 3]).state_dict()["0.weight"])


def test_torch_compile_fullgraph_gives_the_eager_outputs_and_gradients() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(FusedMLP([7, 13, 5, 3], activation="gelu"), nn.LogSoftmax(dim=-1))
    compiled = torch.compile(model, fullgraph=True)  # a graph break would raise
    x = torch.randn(11, 7)
    y = compiled(x)
    y.sum().backward()
    g = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    y_eager = model(x)
    y_eager.sum().backward()
    assert torch.equal(y, y_eager)
    for a, p in zip(g, model.parameters(), strict=True):
        assert_close(a, p.grad, 1e-6, "gradient")
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
    with torch.autocast("cpu", dtype=torch.float16):  # autocast's dtype read inside the traced forward
        y_half, y_half_eager = compiled(x[:5]), model(x[:5])  # and another batch size
    assert y_half.dtype == torch.float16  # (the compiled log-softmax rounds its own way: half's error apart)
    assert_close(y_half, y_half_eager, 2e-3, "compiled output under autocast")


def test_the_torch_fallbacks_compute_what_the_contract_computes() -> None:
    rng = np.random.default_rng(0)
    z = (rng.standard_normal((6, 21)) * 3).astype(np.float64)  # (B, m), pre-activations
    dy = rng.standard_normal((6, 21))
    gelu_aux_t = np.zeros((6, 24))
    gelu_aux_t[:, :21] = z
    relu_aux_t = engines.NumpyEngine().gemm("k", np.eye(21), z.T, Epilog.RELU_AUX_BIAS, bias=np.zeros(21))[1]
    relu_aux_t = relu_aux_t["relu_aux"].T  # (B, Mb)
    eng = engines.TorchEngine(gemm=None)
    relu_aux_tensor = torch.from_numpy(np.ascontiguousarray(relu_aux_t))
    assert torch.equal(engines.relu_mask(relu_aux_tensor, 21), torch.from_numpy(z >= 0))
    np.testing.assert_array_equal(unpack_relu_mask(relu_aux_t.T, 21).T, z >= 0)
    got = eng.act_grad(torch.from_numpy(dy), torch.from_numpy(gelu_aux_t), 21, "gelu").numpy()
    np.testing.assert_allclose(got, dy * gelu_grad(z), rtol=1e-12)
    got = eng.act_grad(torch.from_numpy(dy), relu_aux_tensor, 21, "relu").numpy()
    np.testing.assert_array_equal(got, dy * (z >= 0))
    half = torch.full((4096, 1), 1.0, dtype=torch.float16)
    assert eng.col_sum(half).item() == 4096  # a float16 running sum would stop at 2048


class ContractOnTensors:
    """The epilog contract with torch tensors in and out, in the layouts nvmath returns for torch operands
    (results column-major, relu_aux ``(Mb, N)`` with strides ``(1, Mb)``): the GPU engine's code path,
    :class:`~mlptrain.torch.engines.TorchEngine` and its torch fallbacks, run on the CPU."""

    def __init__(self) -> None:
        self.numpy = engines.NumpyEngine().gemm

    def __call__(self, key: str, a: object, b: object, epilog: object = None, **inputs: object) -> tuple:
        arrays = {name: v.numpy() for name, v in inputs.items() if v is not None}  # type: ignore[attr-defined]
        out, aux = self.numpy(key, a.numpy(), b.numpy(), epilog, **arrays)  # type: ignore[attr-defined]
        return torch.from_numpy(out), {name: torch.from_numpy(v) for name, v in aux.items()}

    def release_operands(self, prefix: object = None) -> None:
        pass


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: "-".join(map(str, w)))
def test_the_torch_engine_path_matches_nn_sequential(
    monkeypatch: pytest.MonkeyPatch, widths: list[int], activation: str, bias: bool
) -> None:
    from mlptrain.torch import ops

    eng = engines.TorchEngine(ContractOnTensors())
    monkeypatch.setattr(ops, "engine_for", lambda x: eng)
    torch.manual_seed(7)
    fused = FusedMLP(widths, activation=activation, bias=bias, dtype=torch.float64)
    torch.manual_seed(7)
    ref = sequential(widths, activation, bias, torch.float64)
    x, dy = torch.randn(11, widths[0], dtype=torch.float64) * 2, torch.randn(11, widths[-1], dtype=torch.float64)
    for a, b in zip(grads(fused, x, dy)[1], grads(ref, x, dy)[1], strict=True):
        assert_close(a, b, 1e-12, "parameter gradient")
    single = FusedLinear(widths[0], widths[1], bias=bias, activation=activation, dtype=torch.float64)
    ref1 = nn.Sequential(nn.Linear(widths[0], widths[1], bias=bias, dtype=torch.float64), act_module(activation))
    ref1[0].load_state_dict(single.state_dict())
    dy1 = torch.randn(11, widths[1], dtype=torch.float64)
    for a, b in zip(grads(single, x, dy1)[1], grads(ref1, x, dy1)[1], strict=True):
        assert_close(a, b, 1e-12, "FusedLinear's parameter gradient")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: FusedMLP([784]), "FusedMLP widths [784] are not valid; expected at least two positive integers"),
        (lambda: FusedMLP([4, 0, 2]), "FusedMLP widths [4, 0, 2] are not valid"),
        (lambda: FusedMLP([4, 2], activation="tanh"), "FusedMLP activation 'tanh' is not known"),
        (lambda: FusedLinear(4, 2, activation="swish"), "FusedLinear activation 'swish' is not known"),
        (lambda: FusedMLP([4, 3, 2], bgrad="fast"), "FusedMLP bgrad 'fast' is not valid"),
        (lambda: FusedMLP([4, 3, 2], bgrad=["bgradb"] * 2), "one entry per hidden layer (1)"),
        (lambda: FusedMLP([4, 3, 2])(torch.randn(2, 5)), "FusedMLP got an input of shape (2, 5); expected (..., 4)"),
        (lambda: FusedMLP([4, 2])(torch.randn(2, 4).double()), "got an input of dtype torch.float64; expected torch"),
    ],
)
def test_user_mistakes_are_config_errors_that_say_what_was_expected(make: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        make()  # type: ignore[operator]
    assert message in str(err.value)
    assert str(err.value).count(". ") == 0  # one sentence


def test_bfloat16_on_the_cpu_is_a_device_error_that_says_where_it_runs() -> None:
    model = FusedMLP([4, 3, 2], dtype=torch.bfloat16)
    with pytest.raises(DeviceError, match="got a torch.bfloat16 tensor .run the module on a CUDA device"):
        model(torch.randn(2, 4, dtype=torch.bfloat16))


def test_ddp_of_one_process_takes_the_fused_parameters(tmp_path: object) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        torch.manual_seed(6)
        fused = FusedMLP([5, 7, 2], dtype=torch.float64)
        ref = sequential([5, 7, 2], "relu", True, torch.float64)
        ref.load_state_dict(fused.state_dict())
        ddp = nn.parallel.DistributedDataParallel(fused)
        x, dy = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
        _, g, _ = grads(ddp, x, dy)  # DDP's hooks reduce each gradient as the fused backward returns it
        _, g_ref, _ = grads(ref, x, dy)
        for a, b in zip(g, g_ref, strict=True):
            assert_close(a, b, 1e-12, "gradient through DDP")
    finally:
        dist.destroy_process_group()


def test_importing_mlptrain_does_not_import_torch() -> None:
    code = "import sys, mlptrain, mlptrain.nn.epilogs, mlptrain.nn.execution; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
