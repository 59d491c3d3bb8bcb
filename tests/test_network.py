"""Finite-difference gradient checks (float64) of layers and whole networks, fused and naive."""

import numpy as np
import pytest
from gpu_helpers import close, cp, gpu_trainer

from mlptrain.nn.execution import FusedExecution, NaiveExecution, NumpyGemm
from mlptrain.nn.head import OutputHead
from mlptrain.nn.losses import mse, softmax_cross_entropy
from mlptrain.nn.network import MLP


def make_execution(mode):
    gemm = NumpyGemm()
    return FusedExecution(gemm) if mode == "fused" else NaiveExecution(gemm, np)


def numerical_grads(net, loss_of, eps=1e-6):
    grads = []
    for p in net.params:
        g = np.zeros_like(p.value)
        for i in np.ndindex(p.value.shape):
            old = p.value[i]
            p.value[i] = old + eps
            lp = loss_of()
            p.value[i] = old - eps
            lm = loss_of()
            p.value[i] = old
            g[i] = (lp - lm) / (2 * eps)
        grads.append(g)
    return grads


def check_gradients(widths, mode, bgrad, loss_fn, activation="relu", batch=5, seed=0):
    rng = np.random.default_rng(seed)
    net = MLP(
        widths,
        execution=make_execution(mode),
        xp=np,
        rng=rng,
        param_dtype=np.float64,
        compute_dtype=np.float64,
        activation=activation,
        bgrad=bgrad,
    )
    for layer in net.layers:  # non-zero biases, so a missing bias gradient is visible
        layer.bias.value[...] = rng.standard_normal(layer.out_features) * 0.1
    x = rng.standard_normal((batch, widths[0]))
    y = rng.integers(0, widths[-1], size=batch)

    def loss_of():
        return float(loss_fn(net.forward(x), y)[0])

    _, dlogits, _ = loss_fn(net.forward(x), y)
    net.backward(dlogits)
    for p, g in zip(net.params, numerical_grads(net, loss_of), strict=True):
        np.testing.assert_allclose(p.grad, g, rtol=1e-6, atol=1e-8, err_msg=p.name)


@pytest.mark.parametrize("mode", ["fused", "naive"])
def test_output_layer_alone(mode):
    check_gradients([6, 4], mode, "bgradb", softmax_cross_entropy)


@pytest.mark.parametrize("mode", ["fused", "naive"])
@pytest.mark.parametrize("bgrad", ["bgradb", "drelu_bgrad"])
def test_one_relu_layer(mode, bgrad):
    check_gradients([5, 7, 3], mode, bgrad, softmax_cross_entropy)


@pytest.mark.parametrize("mode", ["fused", "naive"])
@pytest.mark.parametrize("bgrad", ["bgradb", "drelu_bgrad", ["drelu_bgrad", "bgradb", "drelu_bgrad"]])
@pytest.mark.parametrize("loss_fn", [softmax_cross_entropy, mse])
def test_whole_network(mode, bgrad, loss_fn):
    check_gradients([9, 17, 8, 12, 4], mode, bgrad, loss_fn, batch=6)


@pytest.mark.parametrize("mode", ["fused", "naive"])
def test_linear_network_without_relu(mode):
    check_gradients([4, 6, 3], mode, "bgradb", softmax_cross_entropy, activation="none")


@pytest.mark.parametrize("bgrad", ["bgradb", "drelu_bgrad"])
def test_fused_and_naive_agree_exactly_on_the_cpu(bgrad):
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((16, 10)), rng.integers(0, 5, 16)
    grads = {}
    for mode in ("fused", "naive"):
        net = MLP(
            [10, 32, 32, 5],
            execution=make_execution(mode),
            xp=np,
            rng=np.random.default_rng(1),
            param_dtype=np.float32,
            compute_dtype=np.float32,
            bgrad=bgrad,
        )
        _, d, _ = softmax_cross_entropy(net.forward(x.astype(np.float32)), y)
        net.backward(d)
        grads[mode] = [p.grad.copy() for p in net.params]
    for gf, gn in zip(grads["fused"], grads["naive"], strict=True):
        np.testing.assert_array_equal(gf, gn)


def test_layout_chains_without_copies():
    net = MLP(
        [6, 8, 3],
        execution=make_execution("fused"),
        xp=np,
        rng=np.random.default_rng(0),
        param_dtype=np.float64,
        compute_dtype=np.float64,
    )
    x = np.random.default_rng(1).standard_normal((4, 6))
    h = net.layers[0].forward(net.execution, x)
    assert h.shape == (4, 8) and h.flags.c_contiguous  # (B, out), the F-order epilog result seen as .T
    assert net.layers[0].mask.shape == (16, 4) and net.layers[0].mask.dtype == np.uint8
    logits = net.layers[1].forward(net.execution, h)
    assert logits.shape == (4, 3) and logits.flags.c_contiguous
    net.backward(softmax_cross_entropy(logits, np.array([0, 1, 2, 0]))[1])
    for p in net.params:
        assert p.grad.shape == p.value.shape and p.grad.flags.c_contiguous, p.name
    # the backward let go of what it read: saved inputs and masks (their memory can go mid-step)
    assert all(layer.x is None and layer.mask is None for layer in net.layers)
    kept = net.step_arrays()  # what a CUDA graph keeps after capturing the step
    net.release_step_arrays()  # after the bgrad probe: nothing of its step is kept alive
    assert all(p.grad is None for p in net.params)
    net.restore_step_arrays(kept)  # what a replay re-attaches
    assert all(p.grad is g for p, g in zip(net.params, kept, strict=True))


def test_state_dict_round_trip_copies_and_refreshes_compute_copies():
    def make(seed):
        return MLP(
            [5, 7, 3],
            execution=make_execution("fused"),
            xp=np,
            rng=np.random.default_rng(seed),
            param_dtype=np.float32,
            compute_dtype=np.float16,
        )

    a, b = make(0), make(1)
    state = a.state_dict()
    assert sorted(state) == ["layer0.bias", "layer0.weight", "layer1.bias", "layer1.weight"]
    a.params[0].value[0, 0] += 1.0  # the state dict is a copy: later changes do not reach it
    assert state["layer0.weight"][0, 0] != a.params[0].value[0, 0]
    b.load_state_dict(state)
    for p in b.params:
        np.testing.assert_array_equal(p.value, state[p.name])
        np.testing.assert_array_equal(p.compute, state[p.name].astype(np.float16))  # the GEMMs read this


def test_bad_bgrad_is_rejected():
    with pytest.raises(ValueError, match="bgrad must be one of"):
        MLP(
            [3, 4, 2],
            execution=make_execution("fused"),
            xp=np,
            rng=np.random.default_rng(0),
            param_dtype=np.float64,
            compute_dtype=np.float64,
            bgrad="sideways",
        )


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("mode", ["fused", "naive"])
def test_output_bias_gradient_from_the_loss_equals_bgradb(loss, mode):
    """The head's loss_bias mode: the loss's summed dlogits stand in for the output layer's BGRADB."""
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((9, 6)), rng.integers(0, 4, 9)
    grads = []
    for head_mode in ("gemm", "loss_bias"):
        net = MLP(
            [6, 7, 5, 4],
            execution=make_execution(mode),
            xp=np,
            rng=np.random.default_rng(1),
            param_dtype=np.float64,
            compute_dtype=np.float64,
        )
        head = OutputHead(loss, head_mode)
        logits = net.forward(x)
        _, _, d, given = head.grads(net, logits, y, 1.0)
        net.backward(d, given)
        if head_mode == "loss_bias":
            np.testing.assert_allclose(given.bias_grad, d.sum(axis=0), rtol=1e-12)
            assert net.layers[-1].bias.grad is given.bias_grad, "the loss's sums are the output bias gradient"
        else:
            assert given.bias_grad is None
        grads.append([p.grad.copy() for p in net.params])
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("mode", "head"), [("fused", "gemm"), ("naive", "gemm"), ("fused", "loss_bias"), ("fused", "kernel")]
)
@pytest.mark.parametrize("bgrad", ["bgradb", "drelu_bgrad"])
def test_whole_network_gradients_against_float64_cpu(mode, head, bgrad):
    widths, B = [45, 130, 77, 10], 61
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((B, widths[0])).astype(np.float32), rng.integers(0, 10, B)
    tr = gpu_trainer(**{"execution.mode": mode, "execution.bgrad": bgrad})
    net = MLP(
        widths,
        execution=tr.execution,
        xp=cp,
        rng=np.random.default_rng(5),
        param_dtype=cp.float32,
        compute_dtype=cp.float32,
        bgrad=bgrad,
    )
    ref = MLP(
        widths,
        execution=FusedExecution(NumpyGemm()),
        xp=np,
        rng=np.random.default_rng(5),
        param_dtype=np.float64,
        compute_dtype=np.float64,
        bgrad=bgrad,
    )
    for lg, lr in zip(net.layers, ref.layers, strict=True):  # non-zero biases
        b = rng.standard_normal(lr.out_features) * 0.1
        lr.bias.value[...] = b
        lg.bias.value[...] = cp.asarray(b, cp.float32)
    logits = net.forward(cp.asarray(x))
    OutputHead("cross_entropy", head).backward(net, logits, cp.asarray(y), 1.0)
    _, d, _ = softmax_cross_entropy(ref.forward(x.astype(np.float64)), y)
    ref.backward(d)
    for pg, pr in zip(net.params, ref.params, strict=True):
        close(pg.grad, pr.grad, "float32", pg.name)


@pytest.mark.parametrize("mode", ["fused", "naive"])
@pytest.mark.parametrize("bgrad", ["bgradb", "drelu_bgrad", ["drelu_bgrad", "bgradb", "drelu_bgrad"]])
@pytest.mark.parametrize("loss_fn", [softmax_cross_entropy, mse])
def test_gelu_network_gradients_against_finite_differences(mode, bgrad, loss_fn):
    """GELU hidden layers: GELU_AUX_BIAS forward, DGELU / DGELU_BGRAD backward (fused), or separate ops (naive)."""
    check_gradients([9, 17, 8, 12, 4], mode, bgrad, loss_fn, activation="gelu", batch=6)


@pytest.mark.parametrize("bgrad", ["bgradb", "drelu_bgrad"])
@pytest.mark.parametrize("widths", [[10, 32, 32, 5], [7, 13, 1]])  # [.., 1]: the K=1 input-gradient path
def test_gelu_fused_and_naive_agree_in_fp64(bgrad, widths):
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((16, widths[0])), rng.standard_normal((16, widths[-1]))
    grads, outs = {}, {}
    for mode in ("fused", "naive"):
        net = MLP(
            widths,
            execution=make_execution(mode),
            xp=np,
            rng=np.random.default_rng(1),
            param_dtype=np.float64,
            compute_dtype=np.float64,
            activation="gelu",
            bgrad=bgrad,
        )
        outs[mode] = net.forward(x)
        _, d = mse(outs[mode], y)[:2]
        net.backward(d)
        grads[mode] = [p.grad.copy() for p in net.params]
    np.testing.assert_allclose(outs["fused"], outs["naive"], rtol=1e-10, atol=1e-10)
    for gf, gn in zip(grads["fused"], grads["naive"], strict=True):
        np.testing.assert_allclose(gf, gn, rtol=1e-10, atol=1e-10)


def test_torch_init_draws_as_nn_linear_does_every_layer_and_its_bias():
    """model.init=torch: U(-1/sqrt(in), 1/sqrt(in)) for the weights and biases of every layer, output included."""
    from mlptrain.nn.layers import initial

    rng = np.random.default_rng(0)
    w, b = initial("torch", 400, 300, rng)
    bound = 1 / np.sqrt(400)
    assert w.shape == (300, 400) and b.shape == (300,)
    assert np.abs(w).max() <= bound and np.abs(b).max() <= bound and np.abs(b).max() > 0.9 * bound
    np.testing.assert_allclose(w.var(), bound**2 / 3, rtol=0.02)  # a uniform's variance, not He's 2/in
    net = MLP(
        [6, 5, 3],
        execution=FusedExecution(NumpyGemm()),
        xp=np,
        rng=np.random.default_rng(1),
        init="torch",
        param_dtype=np.float64,
        compute_dtype=np.float64,
    )
    out = net.layers[-1]
    assert np.abs(out.weight.value).max() <= 1 / np.sqrt(5) and np.any(out.bias.value != 0)
    w_he, b_he = initial("he", 400, 300, np.random.default_rng(0))
    np.testing.assert_allclose(w_he.var(), 2 / 400, rtol=0.02)
    assert not b_he.any()
