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
        return MLP([5, 7, 3], execution=make_execution("fused"), xp=np, rng=np.random.default_rng(seed),
                   param_dtype=np.float32, compute_dtype=np.float16)  # fmt: skip

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
        net = MLP(widths, execution=make_execution(mode), xp=np, rng=np.random.default_rng(1),
                  param_dtype=np.float64, compute_dtype=np.float64, activation="gelu", bgrad=bgrad)  # fmt: skip
        outs[mode] = net.forward(x)
        _, d = mse(outs[mode], y)[:2]
        net.backward(d)
        grads[mode] = [p.grad.copy() for p in net.params]
    np.testing.assert_allclose(outs["fused"], outs["naive"], rtol=1e-10, atol=1e-10)
    for gf, gn in zip(grads["fused"], grads["naive"], strict=True):
        np.testing.assert_allclose(gf, gn, rtol=1e-10, atol=1e-10)


def test_backward_frees_what_each_layer_read_before_the_next_input_gradient():
    """The backward lets go of a layer's saved input and dZ (and the handed-over dlogits) once their
    GEMMs have read them, before the layer below allocates anything: at most two dZ alive."""
    import weakref

    class Spy(FusedExecution):
        """Weak references to every activation and input gradient; which are alive at each input-gradient GEMM."""

        def __init__(self):
            super().__init__(NumpyGemm())
            self.refs, self.alive_at = {}, {}

        def forward(self, key, W, b, x, activation, mask=True):
            y, m = super().forward(key, W, b, x, activation, mask)
            self.refs[f"{key} out"] = weakref.ref(y)
            return y, m

        def input_grad(self, key, W, dz, *args, **kwargs):
            self.alive_at[key] = sorted(name for name, r in self.refs.items() if r() is not None)
            dz_below, db = super().input_grad(key, W, dz, *args, **kwargs)
            self.refs[f"{key} dZ below"] = weakref.ref(dz_below)
            return dz_below, db

    spy = Spy()
    net = MLP([6, 8, 7, 5, 3], execution=spy, xp=np, rng=np.random.default_rng(0),
              param_dtype=np.float64, compute_dtype=np.float64)  # fmt: skip
    x, y = np.random.default_rng(1).standard_normal((4, 6)), np.array([0, 1, 2, 0])
    dlogits = softmax_cross_entropy(net.forward(x), y, inplace=True)[1]  # the logits' array ("layer3 out")
    handoff = [dlogits]
    del dlogits
    net.backward(handoff)
    assert handoff == []
    # One stream (the CPU): a layer's input goes once its weight gradient is computed, before its
    # input gradient; the layer above's dZ once that input gradient is computed.
    assert spy.alive_at == {
        "layer3": ["layer0 out", "layer1 out", "layer3 out"],  # X_1, X_2, dlogits (X_3 read by dW_3: gone)
        "layer2": ["layer0 out", "layer3 dZ below"],  # X_1, dZ_2
        "layer1": ["layer2 dZ below"],  # dZ_1
    }
    assert all(r() is None for r in spy.refs.values()), "the step's activations outlive its backward"
    assert all(p.grad is not None for p in net.params)


class _LiveBytes(FusedExecution):
    """The NumPy engine, following every array a step makes (outputs, masks, dZ, gradients) by weak
    reference, and the most bytes alive at once, sampled after each GEMM (where the GPU allocates)."""

    def __init__(self):
        super().__init__(NumpyGemm())
        self.refs, self.peak = [], 0

    def _follow(self, *arrays):
        import weakref

        self.refs += [weakref.ref(a) for a in arrays if a is not None]
        self.peak = max(self.peak, sum(r().nbytes for r in self.refs if r() is not None))

    def forward(self, key, W, b, x, activation, mask=True):
        y, m = super().forward(key, W, b, x, activation, mask)
        self._follow(y, m)
        return y, m

    def input_grad(self, key, W, dz, *args, **kwargs):
        dz_below, db = super().input_grad(key, W, dz, *args, **kwargs)
        self._follow(dz_below, db)
        return dz_below, db

    def weight_grad(self, key, x, dz, bias_grad):
        dw, db = super().weight_grad(key, x, dz, bias_grad)
        self._follow(dw, db)
        return dw, db


class _InlineSide:
    """Stands in for mlptrain.nn.cuda.streams.SideStream on the CPU: runs the work at once, and holds what it
    read until retired or joined, as the real one does (which arrays are alive does not depend on when
    the GPU runs the work)."""

    def __init__(self):
        self.reads = {}

    def run(self, fork, fn, reads, then=None):
        fn()
        if then is not None:
            then()
        self.reads[fork] = reads

    def retire(self, fork):
        self.reads.pop(fork, None)

    def join(self):
        self.reads.clear()

    def allocating_on_main(self):
        import contextlib

        return contextlib.nullcontext()


@pytest.mark.parametrize("two_streams", [False, True])
@pytest.mark.parametrize("widths", [[6, 40, 24, 32, 5], [9, 16, 48, 12], [5, 33, 3], [7, 4]])
def test_the_steps_peak_is_the_formulas(widths, two_streams):
    """expected_step_peak (the figure the GPU tests hold a real step to) is the peak of the arrays the
    backward's schedule keeps alive, for one stream and for two, to the byte."""
    from mlptrain.step.memory import expected_step_peak

    ex = _LiveBytes()
    net = MLP(widths, execution=ex, xp=np, rng=np.random.default_rng(0), param_dtype=np.float32,
              compute_dtype=np.float32)  # fmt: skip
    if two_streams:
        net._side = _InlineSide()
    B = 11
    x, y = np.random.default_rng(1).standard_normal((B, widths[0])).astype(np.float32), np.arange(B) % widths[-1]
    handoff = [softmax_cross_entropy(net.forward(x), y, inplace=True)[1]]
    net.backward(handoff)
    assert ex.peak == expected_step_peak(widths, B, np.float32, two_streams=two_streams)
    alive = {id(r()) for r in ex.refs if r() is not None}
    assert alive == {id(p.grad) for p in net.params}, "after the backward only the gradients stay"


@pytest.mark.parametrize("two_streams", [False, True])
def test_every_gemm_call_site_is_released_after_its_last_call(two_streams):
    """The backward asks the GEMM engine to forget each layer's operands (nvmath's plans keep their last
    ones) after that layer's last GEMM of the step: the prefixes it names match the call sites' keys."""
    events = []

    class Recording(NumpyGemm):
        def __call__(self, key, a, b, epilog=None, **inputs):
            events.append(("call", key))
            return super().__call__(key, a, b, epilog, **inputs)

        def release_operands(self, prefix=None):
            events.append(("release", prefix))

    net = MLP([6, 9, 8, 7, 3], execution=FusedExecution(Recording()), xp=np, rng=np.random.default_rng(0),
              param_dtype=np.float64, compute_dtype=np.float64)  # fmt: skip
    if two_streams:
        net._side = _InlineSide()
    x, y = np.random.default_rng(1).standard_normal((5, 6)), np.array([0, 1, 2, 0, 1])
    net.backward([softmax_cross_entropy(net.forward(x), y, inplace=True)[1]])
    keys = {key for kind, key in events if kind == "call"}
    assert {k.split(".")[1] for k in keys} == {"fwd", "wgrad", "dgrad"}
    for key in keys:
        last_call = max(n for n, e in enumerate(events) if e == ("call", key))
        assert any(kind == "release" and key.startswith(p) for kind, p in events[last_call + 1 :]), key


def test_on_weight_grad_follows_each_side_stream_weight_gradient():
    """Data parallel: each layer's all-reduce hook runs after its weight gradient on the side stream (as
    ``then``, outside what the main stream waits for before freeing), top layer first, the bottom
    layer's (on the main stream) left to the end of the step."""
    order = []

    class Side(_InlineSide):
        def run(self, fork, fn, reads, then=None):
            super().run(fork, lambda: (fn(), order.append(("dW", fork))), reads, then)

        def retire(self, fork):
            order.append(("retire", fork))
            super().retire(fork)

    net = MLP([6, 9, 8, 7, 3], execution=make_execution("fused"), xp=np, rng=np.random.default_rng(0),
              param_dtype=np.float64, compute_dtype=np.float64)  # fmt: skip
    net._side = Side()
    net.on_weight_grad = lambda w: order.append(("all-reduce", w.name))
    x, y = np.random.default_rng(1).standard_normal((5, 6)), np.array([0, 1, 2, 0, 1])
    net.backward([softmax_cross_entropy(net.forward(x), y, inplace=True)[1]])
    assert [e for e in order if e[0] != "retire"] == [
        ("dW", 3), ("all-reduce", "layer3.weight"), ("dW", 2), ("all-reduce", "layer2.weight"),
        ("dW", 1), ("all-reduce", "layer1.weight"),
    ]  # fmt: skip
    assert [e[1] for e in order if e[0] == "retire"] == [3, 2, 1, 0]


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
