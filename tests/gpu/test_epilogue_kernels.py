"""mlptrain's epilogue kernels (mlptrain.nn.cuda.epilogue_kernels) finishing bf16 GEMMs: DRELU, DRELU_BGRAD and
BGRADB as the plain GEMM and the mask-and-sum kernels, against the NumPy (batched) contract and cuBLASLt's own
epilogues; an ensemble's and one model's bf16 step with them against the same step without; and the default's
choice of a single GEMM by its size.
Written on a CPU machine: the GPU issue runs it."""

from typing import Any

import numpy as np
import pytest
from gpu_helpers import HAS_GPU, cp, f64, np_dtype

from mlptrain.nn.batched import BatchedNumpyGemm, stack_members
from mlptrain.nn.epilogs import Epilog, pack_relu_mask, unpack_relu_mask

pytestmark = pytest.mark.gpu

if HAS_GPU:
    from mlptrain.nn.cuda import epilogue_kernels
    from mlptrain.nn.cuda.gemm import NvmathGemm

BF16 = np_dtype("bfloat16")
K = 3


def bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(BF16)


def on_gpu(x: np.ndarray) -> Any:
    """``x`` on the device with each member's matrix in the same order (column-major members stay column-major)."""
    if x.ndim == 3 and x.strides[-2] < x.strides[-1]:
        return cp.ascontiguousarray(cp.asarray(x.swapaxes(-1, -2))).swapaxes(-1, -2)
    return cp.asarray(x)


def dgrad_operands(rng: np.random.Generator, m: int, kd: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The input-gradient GEMM of an ensemble's layer: ``A = W^T (K, M, Kd)`` and ``B = dZ^T (K, Kd, N)``, both
    column-major per member (views of C-order ``W (K, Kd, M)`` and ``dZ (K, N, Kd)``), and the layer below's
    ``relu_aux (K, Mb, N)``, each member's column-major and the members one after the other."""
    a = bf16(rng, (K, kd, m), 0.1).swapaxes(-1, -2)
    b = bf16(rng, (K, n, kd)).swapaxes(-1, -2)
    mask = rng.random((K, m, n)) > 0.4
    return a, b, stack_members([pack_relu_mask(mk) for mk in mask])


@pytest.mark.parametrize("epilog", [Epilog.DRELU, Epilog.DRELU_BGRAD])
@pytest.mark.parametrize(("m", "kd", "n"), [(96, 64, 48), (1024, 256, 200), (8, 16, 1000)])
def test_the_mask_kernel_finishes_a_batched_dgrad_as_the_contract(epilog: Epilog, m: int, kd: int, n: int) -> None:
    """D masked exactly where relu_aux is 0, within a bf16 rounding of the contract (and of cuBLASLt's epilogue);
    each member's bias gradient within a float32 sum and one bf16 rounding of its own D's float64 sum."""
    rng = np.random.default_rng(m + kd + n)
    a, b, aux = dgrad_operands(rng, m, kd, n)
    ga, gb, gaux = on_gpu(a), on_gpu(b), on_gpu(aux)
    d, out = NvmathGemm(epilogue_kernels=True)("l.dgrad", ga, gb, epilog, relu_aux=gaux)
    d_lt, out_lt = NvmathGemm(epilogue_kernels=False)("l.dgrad", ga, gb, epilog, relu_aux=gaux)
    d_ref, out_ref = BatchedNumpyGemm()("l.dgrad", a, b, epilog, relu_aux=aux)
    ours, ref = f64(d), f64(d_ref)
    kept = np.stack([unpack_relu_mask(x, m) for x in aux]).astype(bool)  # (K, M, N)
    assert np.all(ours[~kept] == 0), "DRELU: an element whose relu_aux bit is 0 must be 0"
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 2.0**-7 * scale, "D: beyond a bf16 rounding of the contract"
    assert np.abs(ours - f64(d_lt)).max() <= 2.0**-7 * scale, "D: beyond a bf16 rounding of cuBLASLt's epilogue"
    assert sorted(out) == sorted(out_lt) == sorted(out_ref)
    if epilog is Epilog.DRELU_BGRAD:
        db = out["drelu_bgrad"]
        assert db.shape == out_lt["drelu_bgrad"].shape == (K, m, 1) and db.dtype == d.dtype
        exact = ours.sum(axis=-1, keepdims=True)  # (K, M, 1): each member's own rows
        bound = 2.0**-8 * np.abs(exact) + n * 2.0**-24 * np.abs(ours).sum(axis=-1, keepdims=True) + 1e-30
        assert np.all(np.abs(f64(db) - exact) <= bound)


@pytest.mark.parametrize("out", [48, 10])  # 10: no 16-byte rows, a warp a row
def test_the_sum_kernel_gives_a_batched_wgrads_bgradb(out: int) -> None:
    """The weight-gradient GEMM: ``X^T (K, in, B)`` column-major, ``dZ (K, B, out)`` C-order; BGRADB's ``(K, out, 1)``
    the sum of each member's dZ over its B rows, dZ left as it was, and D the plain GEMM's."""
    rng = np.random.default_rng(out)
    kin, b_rows = 64, 130
    a = bf16(rng, (K, b_rows, kin)).swapaxes(-1, -2)
    b = bf16(rng, (K, b_rows, out))
    gb = on_gpu(b)
    d, aux = NvmathGemm(epilogue_kernels=True)("l.wgrad", on_gpu(a), gb, Epilog.BGRADB)
    d_ref, aux_ref = BatchedNumpyGemm()("l.wgrad", a, b, Epilog.BGRADB)
    np.testing.assert_array_equal(f64(gb), f64(b))
    assert aux["bgradb"].shape == aux_ref["bgradb"].shape == (K, out, 1)
    exact = f64(b).sum(axis=1)[..., None]
    bound = 2.0**-8 * np.abs(exact) + b_rows * 2.0**-24 * np.abs(f64(b)).sum(axis=1)[..., None] + 1e-30
    assert np.all(np.abs(f64(aux["bgradb"]) - exact) <= bound)
    assert np.abs(f64(d) - f64(d_ref)).max() <= 2.0**-7 * np.abs(f64(d_ref)).max()


def test_a_layout_the_kernels_do_not_take_is_refused() -> None:
    rng = np.random.default_rng(0)
    d = cp.asarray(bf16(rng, (16, 8)))  # C order: not a column-major (M, N)
    aux = cp.zeros((16, 8), dtype=cp.uint8, order="F")
    with pytest.raises(ValueError, match="column-major"):
        epilogue_kernels.drelu(d, aux)


def _count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of ``epilogue_kernels.drelu`` and ``.bgradb`` from here on, by name."""
    calls = {"drelu": 0, "bgradb": 0}
    for name in calls:
        original = getattr(epilogue_kernels, name)

        def counted(*args: Any, _original: Any = original, _name: str = name, **kw: Any) -> Any:
            calls[_name] += 1
            return _original(*args, **kw)

        monkeypatch.setattr(epilogue_kernels, name, counted)
    return calls


@pytest.mark.parametrize("bgrad", ["drelu_bgrad", "bgradb"])
def test_an_ensembles_bf16_step_with_the_kernels_follows_the_step_without(
    monkeypatch: pytest.MonkeyPatch, bgrad: str
) -> None:
    """Graphed, 10 steps of 4 members in bf16: the kernels run (counted), and the losses follow cuBLASLt's
    epilogues' within bf16's rounding (the same data, initialisation and order; only the roundings differ). With
    ``bgradb`` the weight gradients' GEMMs on the second stream end in the bias-gradient kernel, whose scratch once
    came from the main stream's free lists and was overwritten there before the kernel had read it (a replay's
    losses went to NaN)."""
    from test_ensemble_gpu import ensemble_cfg

    from mlptrain.run.ensemble import EnsembleTrainer

    calls = _count_kernel_calls(monkeypatch)
    losses = {}
    for own in (None, False):
        cfg = ensemble_cfg("gpu", graph=True)
        cfg.precision.name = "bf16"
        cfg.execution.epilogue_kernels = own
        cfg.execution.bgrad = type(cfg.execution.bgrad)(bgrad)
        tr = EnsembleTrainer(cfg)
        with tr.stream:
            losses[own] = np.array([cp.asnumpy(tr.step(x, y)[0]) for x, y in tr.train_batches(0)][:10])
        if own is None:  # (the output layer's own bias gradient is BGRADB's with either strategy)
            assert calls["drelu"] > 0 and calls["bgradb"] > 0, f"the kernels did not run: {calls}"
    np.testing.assert_allclose(losses[None], losses[False], rtol=2e-2)


@pytest.mark.parametrize("bgrad", ["drelu_bgrad", "bgradb"])
def test_one_models_bf16_step_with_the_kernels_follows_cublaslt(monkeypatch: pytest.MonkeyPatch, bgrad: str) -> None:
    """One model (64-256-256-256-10, batch 256, bf16), graphed on two streams: with ``epilogue_kernels=true`` its
    backward GEMMs end in mlptrain's kernels (counted: DRELU_BGRAD's or BGRADB's), and 10 steps' losses follow
    cuBLASLt's epilogues' (false) within bf16's rounding, from the same weights on the same batch. (With ``bgradb``
    the bias-gradient kernel runs on the second stream: its scratch from the main stream's lists made NaN.)"""
    from mlptrain.cli.main import compose_config
    from mlptrain.step.trainer import Trainer
    from mlptrain.tools.bench.step_trainer import random_dataset, step_overrides

    widths, batch = [64, 256, 256, 256, 10], 256
    calls = _count_kernel_calls(monkeypatch)
    losses = {}
    for own in (True, False):
        setting = str(own).lower()
        cfg = compose_config(
            [*step_overrides(widths, batch, "bf16", bgrad=bgrad), f"execution.epilogue_kernels={setting}"]
        )
        tr = Trainer(cfg, dataset=random_dataset(widths, batch))
        assert tr.model.uses_wgrad_stream  # (where the bias-gradient kernel's scratch once raced the main stream)
        with tr.stream:
            xb, yb = next(iter(tr.train_loader.epoch(0, out=tr.batch_buffers)))
            losses[own] = np.array([float(tr.step(xb, yb)[0]) for _ in range(10)])
        if own:
            assert calls["drelu"] > 0, f"the mask kernel did not run: {calls}"
            assert (calls["bgradb"] > 0) == (bgrad == "bgradb"), f"bgrad={bgrad}: {calls}"
            seen = dict(calls)
    assert calls == seen, f"epilogue_kernels=false ran mlptrain's kernels: {seen} then {calls}"
    assert losses[False][-1] < 0.9 * losses[False][0]  # it trains: a wrong mask would not follow it
    np.testing.assert_allclose(losses[True], losses[False], rtol=2e-2)


@pytest.mark.parametrize("big", [False, True])
def test_by_default_a_single_gemm_from_its_size_on_ends_in_the_kernels(
    monkeypatch: pytest.MonkeyPatch, big: bool
) -> None:
    """``epilogue_kernels`` null: a single (unbatched) bf16 DRELU_BGRAD GEMM of at least ``OWN_EPILOGUE_MIN_MACS``
    multiply-adds runs plain and then the mask kernel, a smaller one keeps cuBLASLt's epilogue; both give the
    contract's D within a bf16 rounding."""
    from mlptrain.nn.cuda.gemm import OWN_EPILOGUE_MIN_MACS
    from mlptrain.nn.execution import NumpyGemm

    m, n = 256, 1024
    kd = -(-OWN_EPILOGUE_MIN_MACS // (m * n)) if big else 64  # M N K at the threshold, or far below
    rng = np.random.default_rng(kd)
    a = bf16(rng, (kd, m), 0.1).T  # W^T (M, Kd) column-major
    b = bf16(rng, (n, kd)).T  # dZ^T (Kd, N) column-major
    aux = pack_relu_mask(rng.random((m, n)) > 0.4)
    calls = _count_kernel_calls(monkeypatch)
    d, out = NvmathGemm()("l.dgrad", cp.asarray(a), cp.asarray(b), Epilog.DRELU_BGRAD, relu_aux=cp.asarray(aux))
    assert (calls["drelu"] == 1) == big, f"M N K = {m * n * kd} against {OWN_EPILOGUE_MIN_MACS}: {calls}"
    d_ref, out_ref = NumpyGemm()("l.dgrad", a, b, Epilog.DRELU_BGRAD, relu_aux=aux)
    assert np.abs(f64(d) - f64(d_ref)).max() <= 2.0**-7 * np.abs(f64(d_ref)).max()
    db, exact = f64(out["drelu_bgrad"]), f64(d).sum(axis=1)  # (M,): D's own rows, summed in float64
    assert db.shape == out_ref["drelu_bgrad"].shape == (m,)
    # D's own row sums: one bf16 rounding of the sum, and (cuBLASLt may sum D before rounding it) one of each term
    bound = 2.0**-8 * np.abs(exact) + 2.0**-8 * np.abs(f64(d)).sum(axis=1) + 1e-30
    assert np.all(np.abs(db - exact) <= bound)


def test_the_kernels_compile_ahead_where_a_step_runs_them() -> None:
    """``precompile_jobs``: bf16 steps whose largest GEMM reaches ``OWN_EPILOGUE_MIN_MACS``, or batched, or with
    ``epilogue_kernels=true``; never fp16 or with ``false``."""
    from mlptrain.nn.cuda.gemm import OWN_EPILOGUE_MIN_MACS as AT

    assert len(NvmathGemm().precompile_jobs("bfloat16", False, AT)) == 1
    assert NvmathGemm().precompile_jobs("bfloat16", False, AT - 1) == []
    assert len(NvmathGemm().precompile_jobs("bfloat16", True, 1)) == 1
    assert len(NvmathGemm(epilogue_kernels=True).precompile_jobs("bfloat16", False, 1)) == 1
    assert NvmathGemm(epilogue_kernels=False).precompile_jobs("bfloat16", True, AT) == []
    assert NvmathGemm().precompile_jobs("float16", True, AT) == []
