"""mlptrain.torch on a GPU: nvmath's fused GEMMs on torch tensors against nn.Sequential and a float64 reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from mlptrain.torch import FusedLinear, FusedMLP  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = "cuda"
WIDTHS = [[784, 1024, 1024, 10], [37, 129, 65, 3], [9, 1, 4], [33, 17, 1]]


def sequential(widths: list[int], activation: str, bias: bool, **factory: object) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b, bias=bias, **factory))
        if i < len(widths) - 2:
            layers.append(nn.ReLU() if activation == "relu" else nn.GELU(approximate="tanh"))
    return nn.Sequential(*layers)


def grads(model: nn.Module, x: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype | None = None) -> list:
    """``[y, x grad, *param grads]`` of ``(model(x) * dy).sum()``, under autocast to ``dtype`` when given."""
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    with torch.autocast(CUDA, dtype=dtype or torch.float16, enabled=dtype is not None):
        y = model(x)
    (y.float() * dy.float()).sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in model.parameters())]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error (a ReLU mask flipped by rounding moves one element, not the norm)."""
    return ((a.double() - b.double()).norm() / max(b.double().norm().item(), 1e-30)).item()


def models(widths: list[int], activation: str, bias: bool, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    fused = FusedMLP(widths, activation=activation, bias=bias, device=CUDA, dtype=dtype)
    ref = sequential(widths, activation, bias, device=CUDA, dtype=dtype)
    ref.load_state_dict(fused.state_dict())
    return fused, ref


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: "-".join(map(str, w)))
def test_fused_mlp_on_the_gpu_matches_nn_sequential(widths: list, activation: str, bias: bool, dtype: object) -> None:
    fused, ref = models(widths, activation, bias, dtype)
    x = torch.randn(67, widths[0], device=CUDA, dtype=dtype)
    dy = torch.randn(67, widths[-1], device=CUDA, dtype=dtype)
    # float64: cuBLASLt's GELU epilog evaluates tanh to about 4e-10, 1.0e-9 through a width-1 layer where
    # nothing averages the error (H200, 2026-12-02); a wrong GELU is off by 1e-3 or more. ReLU is exact.
    tol = (1e-12 if activation == "relu" else 1e-8) if dtype == torch.float64 else 1e-5
    for i, (a, b) in enumerate(zip(grads(fused, x, dy), grads(ref, x, dy), strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel(a, b) < tol, f"tensor {i} (y, dx, params...): {rel(a, b):.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: "-".join(map(str, w)))
def test_autocast_half_precision_is_at_torchs_own_error(
    widths: list, activation: str, bias: bool, dtype: object
) -> None:
    """fp32 parameters under autocast, both models against the same model in float64."""
    fused, ref = models(widths, activation, bias, torch.float32)
    exact = sequential(widths, activation, bias, device=CUDA, dtype=torch.float64)
    exact.load_state_dict(fused.state_dict())
    x = torch.randn(67, widths[0], device=CUDA)
    dy = torch.randn(67, widths[-1], device=CUDA)
    g64 = grads(exact, x.double(), dy.double())
    got, theirs = grads(fused, x, dy, dtype), grads(ref, x, dy, dtype)
    assert got[0].dtype == dtype and all(g.dtype == torch.float32 for g in got[2:])
    # the floor: two roundings of the half type (a width-1 layer's bias gradient is one element, so its
    # norm-wise error is one rounding of the fused DGELU_BGRAD's sum, not an average over many)
    floor = 2 * torch.finfo(dtype).eps
    for i, (a, b, e) in enumerate(zip(got, theirs, g64, strict=True)):
        assert rel(a, e) <= 2 * rel(b, e) + floor, f"tensor {i}: fused {rel(a, e):.3g}, torch {rel(b, e):.3g}"


def test_no_grad_gives_the_training_forward() -> None:
    fused = FusedMLP([100, 200, 50], device=CUDA)
    x = torch.randn(33, 100, device=CUDA)
    y = fused(x)
    with torch.no_grad():
        y_inf = fused(x)
    assert torch.equal(y.detach(), y_inf)


def test_fused_linear_with_its_activation_on_the_gpu() -> None:
    torch.manual_seed(1)
    fused = FusedLinear(40, 24, activation="gelu", device=CUDA, dtype=torch.float64)
    ref = nn.Sequential(nn.Linear(40, 24, device=CUDA, dtype=torch.float64), nn.GELU(approximate="tanh"))
    ref.load_state_dict({"0.weight": fused.weight, "0.bias": fused.bias})
    x, dy = torch.randn(3, 5, 40, device=CUDA, dtype=torch.float64), torch.randn(3, 5, 24, device=CUDA).double()
    for a, b in zip(grads(fused, x, dy), grads(ref, x, dy), strict=True):
        assert rel(a, b) < 1e-8  # cuBLASLt's GELU epilog in float64 (see above)


def test_torch_compile_fullgraph_on_the_gpu_gives_the_eager_outputs() -> None:
    fused, _ = models([784, 1024, 1024, 10], "relu", True, torch.float32)
    compiled = torch.compile(fused, fullgraph=True)
    x, dy = torch.randn(256, 784, device=CUDA), torch.randn(256, 10, device=CUDA)
    with torch.autocast(CUDA, dtype=torch.bfloat16):
        y_c, y_e = compiled(x), fused(x)
    assert torch.equal(y_c, y_e)  # the same op on the same tensors
    for a, b in zip(grads(compiled, x, dy, torch.bfloat16), grads(fused, x, dy, torch.bfloat16), strict=True):
        assert rel(a, b) < 1e-6


def test_a_captured_cuda_graph_replays_the_fused_step() -> None:
    fused, ref = models([64, 96, 96, 8], "relu", True, torch.float32)
    static_x = torch.randn(32, 64, device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: plans and workspaces, outside the capture
        for _ in range(3):
            fused.zero_grad(set_to_none=False)
            fused(static_x).square().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    fused.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        static_y = fused(static_x)
        static_y.square().sum().backward()
    new_x = torch.randn(32, 64, device=CUDA)
    static_x.copy_(new_x)
    fused.zero_grad(set_to_none=False)  # in place: the graph writes the same .grad tensors
    graph.replay()
    torch.cuda.synchronize()
    expected = grads(ref, new_x, 2 * ref(new_x).detach())  # d sum(y^2) / dy = 2y
    assert rel(static_y, expected[0]) < 1e-5
    for i, (p, e) in enumerate(zip(fused.parameters(), expected[2:], strict=True)):
        assert rel(p.grad, e) < 1e-5, f"parameter {i}"


def test_a_training_loop_with_grad_scaler_in_fp16_follows_nn_sequential() -> None:
    fused, ref = models([128, 256, 256, 10], "relu", True, torch.float32)
    x, labels = torch.randn(512, 128, device=CUDA), torch.randint(0, 10, (512,), device=CUDA)
    losses = {}
    for name, model in (("fused", fused), ("torch", ref)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler(CUDA)
        losses[name] = []
        for _ in range(10):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(CUDA, dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), labels)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses[name].append(loss.item())
    first, last = losses["fused"][0], losses["fused"][-1]
    assert last < first and abs(last - losses["torch"][-1]) < 0.02 * losses["torch"][-1], losses


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_bgrad_auto_measures_a_large_shape_and_stays_exact(activation: str) -> None:
    from mlptrain.torch.engines import engine_for

    fused, ref = models([1024, 2048, 2048, 10], activation, True, torch.float32)
    x, dy = torch.randn(4096, 1024, device=CUDA), torch.randn(4096, 10, device=CUDA)
    for i, (a, b) in enumerate(zip(grads(fused, x, dy), grads(ref, x, dy), strict=True)):
        assert rel(a, b) < 1e-5, f"tensor {i}"
    gemm = engine_for(x).gemm
    choices = [v for k, v in gemm.bgrad_choices.items() if k[0] == (1024, 2048, 2048, 10) and k[3] == activation]
    assert len(choices) == 1 and len(choices[0]) == 2 and set(choices[0]) <= {"bgradb", "drelu_bgrad"}


def _ddp_rank(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    torch.manual_seed(0)  # the same initial parameters on every rank (drawn on the CPU), and the same global batch
    fused = FusedMLP([64, 128, 128, 8]).cuda()
    x, dy = torch.randn(8 * world, 64).cuda(), torch.randn(8 * world, 8).cuda()
    ddp = nn.parallel.DistributedDataParallel(fused, device_ids=[rank])
    rows = slice(8 * rank, 8 * (rank + 1))
    (ddp(x[rows]) * dy[rows]).sum().backward()  # DDP averages: the gradient of the mean over ranks
    torch.save({"grads": [p.grad.cpu() for p in fused.parameters()], "x": x.cpu(), "dy": dy.cpu()}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ddp_on_two_gpus_averages_the_fused_gradients(tmp_path: Path) -> None:
    torch.multiprocessing.spawn(_ddp_rank, args=(2, str(tmp_path)), nprocs=2, join=True)
    torch.manual_seed(0)
    seq = sequential([64, 128, 128, 8], "relu", True).double()  # the ranks' draws: FusedMLP initialises as nn.Linear
    saved = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    x, dy = saved[0]["x"].double(), saved[0]["dy"].double()
    (seq(x) * dy).sum().div(2).backward()  # the mean over the two ranks of each shard's sum
    for r in range(2):
        for a, p in zip(saved[r]["grads"], seq.parameters(), strict=True):
            assert rel(a, p.grad) < 1e-5, f"rank {r}"


# --- the raw cuBLASLt engine against nvmath's Matmul (the oracle, torch_nvmath_oracle.py), bit for bit ---

GEMM_SHAPES = [(37, 129, 65), (129, 33, 67), (1024, 784, 256), (8, 16, 3)]  # (M, K, N), odd ones first
FORWARD = ["BIAS", "RELU_BIAS", "RELU_AUX_BIAS", "GELU_BIAS", "GELU_AUX_BIAS", "GELU", "GELU_AUX", None]
BACKWARD = ["DRELU", "DRELU_BGRAD", "DGELU", "DGELU_BGRAD", None]


def both_gemms() -> tuple:
    from torch_nvmath_oracle import TorchNvmathGemm

    from mlptrain.torch.torch_gemm import TorchCublasLtGemm

    return TorchCublasLtGemm(0), TorchNvmathGemm(0)


def assert_same_gemm(lt_out: tuple, nv_out: tuple, m: int, what: str) -> None:
    """D and every aux output equal bit for bit (relu_aux: its M valid bits; gelu_aux: its M valid rows)."""
    from mlptrain.torch.engines import relu_mask

    (d, aux), (d_nv, aux_nv) = lt_out, nv_out
    assert d.shape == d_nv.shape and d.stride() == d_nv.stride() and d.dtype == d_nv.dtype, what
    assert torch.equal(d, d_nv), f"{what}: D differs in {(d != d_nv).sum().item()} elements"
    assert set(aux) == set(aux_nv), (what, set(aux), set(aux_nv))
    for name, t in aux.items():
        ref = aux_nv[name]
        assert t.shape == ref.shape and t.stride() == ref.stride() and t.dtype == ref.dtype, (what, name)
        if name == "relu_aux":
            assert torch.equal(relu_mask(t.T, m), relu_mask(ref.T, m)), f"{what}: relu_aux"
        else:
            assert torch.equal(t[:m] if t.dim() == 2 else t, ref[:m] if ref.dim() == 2 else ref), f"{what}: {name}"


@pytest.mark.parametrize("tf32", [False, True], ids=["fp32", "tf32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_cublaslt_engine_is_nvmath_bit_for_bit(shape: tuple, dtype: torch.dtype, tf32: bool) -> None:
    """Every GEMM of the chain, laid out as the chain lays it out: forward ``W @ h^T`` (and ``h @ W^T``),
    input gradient ``W^T @ dZ^T`` with the aux of a forward of that shape, weight gradient ``h^T @ dZ``."""
    from mlptrain.nn.epilogs import Epilog

    if tf32 and dtype != torch.float32:
        pytest.skip("TF32 is float32's")
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        m, k, n = shape
        lt, nv = both_gemms()
        rand = lambda *s: torch.randn(s, device=CUDA).to(dtype)
        W, h, b = rand(m, k), rand(n, k), rand(m)  # (out, in), (B, in), (out,)
        for name in FORWARD:
            epilog = Epilog[name] if name else None
            inputs = {"bias": b} if name and "BIAS" in name else {}
            what = f"forward {name}"
            assert_same_gemm(lt("f", W, h.T, epilog, **inputs), nv("f", W, h.T, epilog, **inputs), m, what)
        assert_same_gemm(lt("p", h, W.T), nv("p", h, W.T), n, "forward h @ W^T")
        W2, dz = rand(k, m), rand(n, k)  # the layer above: (out=k, in=m); its dZ (B, k)
        aux = nv("aux", W, h.T, Epilog.RELU_AUX_BIAS, bias=b)[1]["relu_aux"]  # (Mb, B) for M = m
        gaux = nv("gaux", W, h.T, Epilog.GELU_AUX_BIAS, bias=b)[1]["gelu_aux"]  # (Mp, B)
        for name in BACKWARD if k > 1 else [None]:
            epilog = Epilog[name] if name else None
            inputs = {"relu_aux": aux} if name and "RELU" in name else ({"gelu_aux": gaux} if name else {})
            got, ref = lt("d", W2.T, dz.T, epilog, **inputs), nv("d", W2.T, dz.T, epilog, **inputs)
            assert_same_gemm(got, ref, m, f"input gradient {name}")
        dzw = rand(n, m)  # (B, out) of this layer
        for epilog in (Epilog.BGRADB, None):
            assert_same_gemm(lt("w", h.T, dzw, epilog), nv("w", h.T, dzw, epilog), k, f"weight gradient {epilog}")
        assert lt.num_plans > 0
        lt.free()
        nv.free()
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.fixture
def gemm_engine(monkeypatch: pytest.MonkeyPatch) -> object:
    """Runs the test body's FusedMLPs on the library's engine (``"cublaslt"``) or on the oracle (``"nvmath"``)."""
    from torch_nvmath_oracle import TorchNvmathGemm

    from mlptrain.torch import engines, ops

    oracle = engines.TorchEngine(TorchNvmathGemm(0))
    on = {"cublaslt": engines.engine_for, "nvmath": lambda x: oracle}
    return lambda name: monkeypatch.setattr(ops, "engine_for", on[name])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("bgrad", ["bgradb", "drelu_bgrad"])
@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: "-".join(map(str, w)))
def test_fused_mlp_is_the_nvmath_oracles_bit_for_bit(
    gemm_engine: object, widths: list, activation: str, bias: bool, bgrad: str, dtype: torch.dtype
) -> None:
    """Forward and backward of FusedMLP, fp32 parameters under autocast for the half types."""
    half = dtype in (torch.float16, torch.bfloat16)
    torch.manual_seed(0)
    fused = FusedMLP(widths, activation, bias, bgrad, device=CUDA, dtype=torch.float32 if half else dtype)
    x, dy = torch.randn(67, widths[0], device=CUDA), torch.randn(67, widths[-1], device=CUDA)
    x = x if half else x.to(dtype)
    out = {}
    for name in ("nvmath", "cublaslt"):
        gemm_engine(name)  # type: ignore[operator]
        out[name] = grads(fused, x, dy, dtype if half else None)
    assert out["cublaslt"][0].dtype == dtype
    for i, (a, b) in enumerate(zip(out["cublaslt"], out["nvmath"], strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} (y, dx, params...): {rel(a, b):.3g}"


def test_a_captured_graph_replays_the_cublaslt_engine_bit_for_bit() -> None:
    """torch.cuda.graph captures the raw cuBLASLt calls (their D and aux from the graph's pool); a replay on
    new inputs gives the eager step's output and gradients exactly."""
    fused, _ = models([256, 512, 512, 10], "gelu", True, torch.float32)
    static_x = torch.randn(64, 256, device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # plans and workspaces, outside the capture
            fused.zero_grad(set_to_none=False)
            with torch.autocast(CUDA, dtype=torch.bfloat16):
                y = fused(static_x)
            y.float().square().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    fused.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        with torch.autocast(CUDA, dtype=torch.bfloat16):
            static_y = fused(static_x)
        static_y.float().square().sum().backward()
    new_x = torch.randn(64, 256, device=CUDA)
    static_x.copy_(new_x)
    fused.zero_grad(set_to_none=False)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [static_y.clone(), *(p.grad.clone() for p in fused.parameters())]
    fused.zero_grad(set_to_none=True)
    with torch.autocast(CUDA, dtype=torch.bfloat16):
        y = fused(new_x)
    y.float().square().sum().backward()
    for i, (a, b) in enumerate(zip(replayed, [y.detach(), *(p.grad for p in fused.parameters())], strict=True)):
        assert torch.equal(a, b), f"tensor {i} (y, params...)"


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_the_eager_path_and_torch_compile_give_the_same_bits(activation: str) -> None:
    """Eagerly the autograd.Function, compiled the registered ops: the same bodies, so the same outputs and
    gradients (the loss is computed outside the compiled module, so the op sees the eager dY)."""
    fused, _ = models([784, 1024, 1024, 10], activation, True, torch.float32)
    compiled = torch.compile(fused, fullgraph=True)
    x, dy = torch.randn(256, 784, device=CUDA), torch.randn(256, 10, device=CUDA)
    for dtype in (torch.bfloat16, None):
        got, ref = grads(compiled, x, dy, dtype), grads(fused, x, dy, dtype)
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert torch.equal(a, b), f"{dtype} tensor {i} (y, dx, params...): {rel(a, b):.3g}"
    with torch.no_grad():
        assert torch.equal(compiled(x), fused(x))
