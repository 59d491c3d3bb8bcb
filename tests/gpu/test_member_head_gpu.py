"""The members' head kernel (mlptrain.nn.cuda.member_head.member_input_grad): member k's output-layer input gradient is
the single head kernel's on member k's slices, bit for bit, at every block width; an ensemble's graphed bf16 step
with it follows the step without (``execution.head_kernel=false``). Written on a CPU machine: the GPU issue runs it."""

import threading
from typing import Any

import numpy as np
import pytest
from gpu_helpers import HAS_GPU, cp, np_dtype, rand

from mlptrain.nn.epilogs import pack_relu_mask

pytestmark = pytest.mark.gpu

if HAS_GPU:
    from mlptrain.nn.cuda import head as head_module
    from mlptrain.nn.cuda import member_head


def member_operands(k: int, b: int, c: int, h: int, dtype: str) -> tuple[Any, Any, Any]:
    """``dlogits (K, B, C)``, ``W (K, C, H)`` on the device, and ``relu_aux (K, Mb, B)`` as a batched RELU_AUX_BIAS
    leaves it (each member's column-major ``(Mb, B)``, the members one after the other); each member its own draw."""
    rng = np.random.default_rng(1000 * k + 10 * b + c + h)
    d = (rand(rng, (k, b, c), "float32") / b).astype(np_dtype(dtype))  # a loss gradient's size: (p - onehot) / B
    w = rand(rng, (k, c, h), dtype)
    masks = [pack_relu_mask(rng.random((h, b)) > 0.2 + 0.2 * m / k) for m in range(k)]  # (Mb, B) column-major
    aux = cp.asarray(np.stack([a.T for a in masks])).swapaxes(1, 2)  # (K, B, Mb) C-order seen as (K, Mb, B)
    return cp.asarray(d), cp.asarray(w), aux


def bits(a: Any) -> np.ndarray:
    return cp.asnumpy(a).view(np.uint8)


@pytest.mark.parametrize("want_db", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("h", [64, 256])
@pytest.mark.parametrize("c", [2, 10])
@pytest.mark.parametrize("b", [64, 256, 200])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_the_members_kernel_is_the_single_kernel_member_by_member(
    k: int, b: int, c: int, h: int, dtype: str, want_db: bool, lanes: Any = None
) -> None:
    """The block width this GPU gives the shape (member_head.member_lanes), or ``lanes`` where a test sets it."""
    d, w, aux = member_operands(k, b, c, h, dtype)
    assert aux.strides[1:] == (1, aux.shape[1])  # each member column-major, as cuBLASLt lays a batch out
    dz, db = member_head.member_input_grad(d, w, aux, bias_grad_below=want_db, lanes=lanes)
    assert dz.shape == (k, b, h) and dz.dtype == d.dtype and dz.flags.c_contiguous
    assert (db is None) != want_db and (db is None or (db.shape == (k, h) and db.dtype == d.dtype))
    for m in range(k):
        one_dz, one_db = head_module.head_input_grad(d[m], w[m], aux[m], bias_grad_below=want_db)
        np.testing.assert_array_equal(bits(dz[m]), bits(one_dz), err_msg=f"dZ_below of member {m}")
        if want_db:
            np.testing.assert_array_equal(bits(db[m]), bits(one_db), err_msg=f"db_below of member {m}")
    assert cp.asnumpy(dz).astype(np.float64).any()  # not a kernel that wrote nothing on both sides


@pytest.mark.parametrize("want_db", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("lanes", [1, 2, 4, 8])
def test_every_block_width_is_the_single_kernel_member_by_member(lanes: int, dtype: str, want_db: bool) -> None:
    """Blocks of 8, 16, 32 and 64 columns (each thread keeping 1 to 8 of a column's 64 row lanes), whichever
    this GPU's size would pick, on a batch that is no multiple of 64 and a width that is no multiple of 64."""
    test_the_members_kernel_is_the_single_kernel_member_by_member(3, 200, 10, 200, dtype, want_db, lanes)


def test_the_members_kernel_refuses_operands_that_do_not_fit() -> None:
    d, w, aux = member_operands(3, 64, 10, 100, "float16")
    with pytest.raises(ValueError, match=r"relu_aux must be uint8 \(3, 16, 64\) with each member column-major"):
        member_head.member_input_grad(d, w, cp.ascontiguousarray(aux))  # C-order members: the bits misplaced
    with pytest.raises(ValueError, match=r"output weights must be C-contiguous \(3, 10, hidden\) float16"):
        member_head.member_input_grad(d, w[:2], aux)
    with pytest.raises(ValueError, match=r"dlogits must be a C-contiguous \(members, batch, classes\)"):
        member_head.member_input_grad(d[0], w, aux)


@pytest.mark.parametrize("bgrad", ["bgradb", "drelu_bgrad"])
def test_an_ensembles_bf16_step_with_the_head_kernel_follows_the_step_without(
    monkeypatch: pytest.MonkeyPatch, bgrad: str
) -> None:
    """Graphed, 10 steps of 4 members in bf16, with the members' head kernel and with the batched GEMM
    (``execution.head_kernel=false``): the kernel runs in the step (its calls counted, precompile's left out), and
    the losses agree within bf16's rounding (the same data, initialisation and order; only the roundings differ)."""
    from test_ensemble_gpu import ensemble_cfg

    from mlptrain.run.ensemble import EnsembleTrainer

    calls = []
    original = member_head.member_input_grad

    def counted(*args: Any, **kw: Any) -> Any:
        if not threading.current_thread().name.startswith("mlptrain-precompile"):  # the step's calls only
            calls.append(args[0].shape)
        return original(*args, **kw)

    monkeypatch.setattr(member_head, "member_input_grad", counted)
    losses = {}
    for kernel in (True, False):
        cfg = ensemble_cfg("gpu", graph=True)
        cfg.precision.name = "bf16"
        cfg.execution.head_kernel = kernel
        cfg.execution.bgrad = type(cfg.execution.bgrad)(bgrad)
        tr = EnsembleTrainer(cfg)
        assert tr.head.mode == ("kernel" if kernel else "gemm")
        with tr.stream:
            losses[kernel] = np.array([cp.asnumpy(tr.step(x, y)[0]) for x, y in tr.train_batches(0)][:10])
        if kernel:
            assert calls and all(s[0] == cfg.ensemble.size for s in calls), f"the kernel did not run: {calls}"
            ran = len(calls)
    assert len(calls) == ran, "the step with execution.head_kernel=false ran the head kernel"
    np.testing.assert_allclose(losses[True], losses[False], rtol=2e-2)
