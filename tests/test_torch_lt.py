"""The cuBLASLt engine's host side (mlptrain.torch.torch_lt, torch_gemm.TorchCublasLtGemm), without a GPU: operand
layouts, GEMM specs, the inputs refused, one plan per signature, and outputs that carry the chain."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from test_torch import WIDTHS, assert_close, grads, sequential  # noqa: E402

from mlptrain.nn.epilogs import Epilog  # noqa: E402
from mlptrain.torch import FusedMLP, engines  # noqa: E402


def test_operand_layouts_follow_nvmaths_rules() -> None:
    from mlptrain.torch.torch_lt import Layout, operand_layout, transposed

    w = torch.empty(5, 7)  # (out, in) C-order: ORDER_ROW, rows 7 apart
    assert operand_layout(w.shape, w.stride()) == Layout(5, 7, 7, True)
    assert operand_layout(w.T.shape, w.T.stride()) == Layout(7, 5, 7, False)  # its transpose: the same memory, COL
    rows = torch.empty(6, 10)[:, :7]  # a slice: rows still 10 apart
    assert operand_layout(rows.shape, rows.stride()) == Layout(6, 7, 10, True)
    assert operand_layout((4, 1), (1, 1)) == Layout(4, 1, 4, False)  # the first stride is checked first
    assert operand_layout((1, 4), (4, 1)) == Layout(1, 4, 4, True)
    assert operand_layout((1, 4), (8, 2)) == Layout(1, 4, 2, False)  # one row: COL whatever its stride
    with pytest.raises(ValueError, match="has no unit stride"):
        operand_layout((3, 4), (8, 2))
    # BGRADB's B, transposed for TRANSB = T: a (B, out) C-order dZ is the column-major (out, B)
    assert transposed(Layout(9, 4, 4, True), (4, 1)) == Layout(4, 9, 4, False)
    assert transposed(Layout(4, 9, 4, False), (1, 4)) == Layout(9, 4, 4, True)


def test_gemm_spec_of_the_chains_gemms() -> None:
    from mlptrain.torch.torch_lt import gemm_spec

    W, h, dz = torch.empty(30, 20), torch.empty(11, 20), torch.empty(11, 30)  # (out, in), (B, in), (B, out)
    fwd = gemm_spec(W.shape, W.stride(), h.T.shape, h.T.stride(), Epilog.RELU_AUX_BIAS)  # (30, 20) @ (20, 11)
    assert (fwd.m, fwd.n, fwd.k, fwd.a.row, fwd.b.row, fwd.transb) == (30, 11, 20, True, False, False)
    assert fwd.d_strides == (1, 30) and not fwd.d.row and fwd.d.ld == 30  # D column-major (out, B)
    (aux,) = fwd.outputs  # M = 30 bits a column -> Mb = 16 bytes; LD and batch stride in bits
    assert (aux.name, aux.shape, aux.strides, aux.mask, aux.pointer) == ("relu_aux", (16, 11), (1, 16), True, "aux")
    assert (fwd.aux_ld, fwd.aux_batch_stride, fwd.bias_batch_stride) == (128, 128 * 11, 0)
    dgrad = gemm_spec(W.T.shape, W.T.stride(), dz.T.shape, dz.T.stride(), Epilog.DRELU_BGRAD)  # (20, 30) @ (30, 11)
    assert (dgrad.m, dgrad.n, dgrad.aux_ld, dgrad.aux_batch_stride, dgrad.bias_batch_stride) == (20, 11, 128, 0, 20)
    assert [(o.name, o.shape, o.pointer) for o in dgrad.outputs] == [("drelu_bgrad", (20,), "bias")]
    wgrad = gemm_spec(h.T.shape, h.T.stride(), dz.shape, dz.stride(), Epilog.BGRADB)  # (20, 11) @ (11, 30)
    assert wgrad.transb and wgrad.b.rows == 30 and wgrad.b.cols == 11 and not wgrad.b.row and wgrad.b.ld == 30
    assert [(o.name, o.shape) for o in wgrad.outputs] == [("bgradb", (30,))] and wgrad.bias_batch_stride == 30
    gelu = gemm_spec(W.shape, W.stride(), h.T.shape, h.T.stride(), Epilog.GELU_AUX_BIAS)
    assert [(o.name, o.shape, o.strides, o.mask) for o in gelu.outputs] == [("gelu_aux", (32, 11), (1, 32), False)]
    assert (gelu.aux_ld, gelu.aux_batch_stride) == (32, 32 * 11)
    plain = gemm_spec(h.shape, h.stride(), W.T.shape, W.T.stride(), None)  # no epilog: D follows A (ROW)
    assert plain.d.row and plain.d_strides == (30, 1) and plain.d.ld == 30 and plain.outputs == ()
    assert gemm_spec(W.T.shape, W.T.stride(), dz.T.shape, dz.T.stride(), Epilog.GELU).d_strides == (20, 1)[::-1]
    with pytest.raises(ValueError, match="K = 1 is not supported for the DRELU epilog"):
        gemm_spec((20, 1), (1, 20), (1, 11), (11, 1), Epilog.DRELU)


def test_check_inputs_refuses_what_nvmath_refuses() -> None:
    from mlptrain.torch.torch_lt import check_inputs, gemm_spec

    spec = gemm_spec((20, 30), (1, 20), (30, 11), (1, 30), Epilog.DRELU)  # M = 20 -> relu_aux (16, 11)
    check_inputs(spec, Epilog.DRELU, {"relu_aux": torch.empty(11, 16, dtype=torch.uint8).T}, torch.float32)
    with pytest.raises(ValueError, match="reads the epilog inputs \\['relu_aux'\\]; got \\['bias'\\]"):
        check_inputs(spec, Epilog.DRELU, {"bias": torch.empty(20)}, torch.float32)
    with pytest.raises(ValueError, match="relu_aux is \\(16, 11\\) torch.uint8 \\(11, 1\\)"):  # row-major
        check_inputs(spec, Epilog.DRELU, {"relu_aux": torch.empty(16, 11, dtype=torch.uint8)}, torch.float32)
    fwd = gemm_spec((20, 30), (30, 1), (30, 11), (1, 30), Epilog.BIAS)
    with pytest.raises(ValueError, match="bias is \\(19,\\)"):
        check_inputs(fwd, Epilog.BIAS, {"bias": torch.empty(19)}, torch.float32)


class ContractPlan:
    """A stand-in for :class:`mlptrain.torch.torch_lt.LtPlan` on the CPU: the engine's outputs allocated as the
    real plan allocates them (:func:`~mlptrain.torch.torch_lt.allocate`), then filled with the NumPy contract."""

    made: list = []

    def __init__(
        self, key: str, spec: object, a: object, b: object, epilog: object, inputs: dict, **kw: object
    ) -> None:
        from mlptrain.torch.torch_lt import check_inputs

        check_inputs(spec, epilog, inputs, a.dtype)  # type: ignore[arg-type, attr-defined]
        self.spec, self.epilog = spec, epilog
        ContractPlan.made.append((key, epilog, kw))

    def __call__(self, a: torch.Tensor, b: torch.Tensor, inputs: dict) -> tuple:
        from mlptrain.nn.execution import NumpyGemm
        from mlptrain.torch.torch_lt import allocate

        d, aux = allocate(self.spec, a.dtype, a.device)  # type: ignore[arg-type]
        out, ref = NumpyGemm()("k", a.numpy(), b.numpy(), self.epilog, **{k: v.numpy() for k, v in inputs.items()})
        d.copy_(torch.from_numpy(out))  # into D's own strides
        assert set(aux) == set(ref), (self.epilog, set(aux), set(ref))  # the aux keys nvmath returns
        for name, t in aux.items():
            assert t.shape == ref[name].shape, name
            t.copy_(torch.from_numpy(ref[name]))
        return d, aux


@pytest.fixture
def lt_engine(monkeypatch: pytest.MonkeyPatch) -> object:
    from mlptrain.torch.torch_gemm import TorchCublasLtGemm

    gemm = TorchCublasLtGemm(0)
    gemm.make_plan = ContractPlan
    ContractPlan.made = []
    return gemm


def aligned(*shape: int, dtype: torch.dtype = torch.float64, offset: int = 0) -> torch.Tensor:
    """A random C-order tensor whose data starts ``offset`` elements past a 256-byte boundary."""
    size = int(np.prod(shape)) + offset
    raw = torch.empty(size * dtype.itemsize + 256, dtype=torch.uint8)
    skip = -raw.data_ptr() % 256
    t = raw[skip : skip + size * dtype.itemsize].view(dtype)[offset:].view(shape)
    return t.copy_(torch.randn(shape, dtype=torch.float64))


def test_the_cublaslt_engine_plans_once_per_signature(lt_engine: object, monkeypatch: pytest.MonkeyPatch) -> None:
    gemm = lt_engine
    W, b, h = aligned(8, 5), aligned(8), aligned(6, 5)
    z, aux = gemm("0.fwd", W, h.T, Epilog.RELU_AUX_BIAS, bias=b)  # type: ignore[operator]
    assert z.stride() == (1, 8) and aux["relu_aux"].shape == (16, 6) and aux["relu_aux"].stride() == (1, 16)
    np.testing.assert_array_equal(z.T.numpy(), np.maximum(h.numpy() @ W.numpy().T + b.numpy(), 0))
    gemm("0.fwd", aligned(8, 5), aligned(6, 5).T, Epilog.RELU_AUX_BIAS, bias=aligned(8))
    assert gemm.num_plans == 1 and len(ContractPlan.made) == 1  # new tensors, the same signature: one plan
    gemm("0.fwd", W, aligned(7, 5).T, Epilog.RELU_AUX_BIAS, bias=b)  # another batch
    gemm("0.fwd", W, h.T, Epilog.RELU_BIAS, bias=b)  # another epilog
    gemm("0.fwd", W, aligned(5, 6), Epilog.RELU_AUX_BIAS, bias=b)  # another layout of B
    gemm("0.fwd", W, aligned(6, 5, offset=1).T, Epilog.RELU_AUX_BIAS, bias=b)  # B 8 bytes past the boundary
    gemm("0.fwd", W, h.T, Epilog.RELU_AUX_BIAS, bias=aligned(8, offset=2))  # the bias 16 bytes past
    gemm("1.fwd", W, h.T, Epilog.RELU_AUX_BIAS, bias=b)  # another call site
    assert gemm.num_plans == 7
    thread = __import__("threading").Thread(target=lambda: gemm("0.fwd", W, h.T, Epilog.RELU_AUX_BIAS, bias=b))
    thread.start()
    thread.join()
    assert gemm.num_plans == 8  # each thread plans its own (the backward runs on autograd's thread)
    x32, w32 = aligned(6, 5, dtype=torch.float32), aligned(5, 3, dtype=torch.float32)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    gemm("p", x32, w32)
    gemm("p", x32, w32)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    gemm("p", x32, w32)
    assert [kw["tf32"] for _, _, kw in ContractPlan.made[-2:]] == [True, False]  # TF32 or not: two plans
    assert gemm.num_plans == 10
    with pytest.raises(ValueError, match="got torch.float32 @ torch.float64 with epilog None at call site 'q'"):
        gemm("q", x32, aligned(5, 3))  # two dtypes: the chain never runs them
    with pytest.raises(ValueError, match="with epilog Epilog.BGRADA at call site 'q'"):
        gemm("q", W, h.T, Epilog.BGRADA)  # an epilog it does not plan
    assert gemm.num_plans == 10


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: "-".join(map(str, w)))
def test_the_cublaslt_engines_outputs_carry_the_chain(
    lt_engine: object, monkeypatch: pytest.MonkeyPatch, widths: list[int], activation: str, bias: bool
) -> None:
    """The whole chain on the engine's layouts (D, relu_aux, gelu_aux, bias gradients as it allocates them)."""
    from mlptrain.torch import ops

    eng = engines.TorchEngine(lt_engine)
    monkeypatch.setattr(ops, "engine_for", lambda x: eng)
    torch.manual_seed(8)
    fused = FusedMLP(widths, activation=activation, bias=bias, bgrad="drelu_bgrad", dtype=torch.float64)
    ref = sequential(widths, activation, bias, torch.float64)
    ref.load_state_dict(fused.state_dict())
    x, dy = torch.randn(11, widths[0], dtype=torch.float64) * 2, torch.randn(11, widths[-1], dtype=torch.float64)
    (y, g, gx), (y_ref, g_ref, gx_ref) = grads(fused, x, dy), grads(ref, x, dy)
    for a, b, what in [
        (y, y_ref, "output"),
        (gx, gx_ref, "input gradient"),
        *zip(g, g_ref, ["param"] * len(g), strict=True),
    ]:
        assert_close(a, b, 1e-12, what)
    planned = {epilog for _, epilog, _ in ContractPlan.made}
    forward = {("relu", True): Epilog.RELU_AUX_BIAS, ("relu", False): Epilog.RELU_AUX_BIAS}
    forward |= {("gelu", True): Epilog.GELU_AUX_BIAS, ("gelu", False): Epilog.GELU_AUX}
    # the engine's own layouts (not the contract's) were chained, through each epilog
    assert (forward[(activation, bias)] in planned) == (len(widths) > 2)
    assert (Epilog.BGRADB in planned) == (bias and widths[-1] > 1)  # the top layer's bias gradient (N = 1: a sum)
