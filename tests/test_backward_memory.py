"""What the backward keeps alive, and when it lets go: a layer's input and dZ freed once read, the step's peak
against expected_step_peak to the byte (one stream and two), each GEMM call site released after its last call,
and the all-reduce of each weight gradient as the side stream makes it."""

import numpy as np
import pytest
from test_network import make_execution

from mlptrain.nn.execution import FusedExecution, NumpyGemm
from mlptrain.nn.losses import softmax_cross_entropy
from mlptrain.nn.network import MLP


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
    net = MLP(
        [6, 8, 7, 5, 3],
        execution=spy,
        xp=np,
        rng=np.random.default_rng(0),
        param_dtype=np.float64,
        compute_dtype=np.float64,
    )
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
    net = MLP(
        widths, execution=ex, xp=np, rng=np.random.default_rng(0), param_dtype=np.float32, compute_dtype=np.float32
    )
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

    net = MLP(
        [6, 9, 8, 7, 3],
        execution=FusedExecution(Recording()),
        xp=np,
        rng=np.random.default_rng(0),
        param_dtype=np.float64,
        compute_dtype=np.float64,
    )
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

    net = MLP(
        [6, 9, 8, 7, 3],
        execution=make_execution("fused"),
        xp=np,
        rng=np.random.default_rng(0),
        param_dtype=np.float64,
        compute_dtype=np.float64,
    )
    net._side = Side()
    net.on_weight_grad = lambda w: order.append(("all-reduce", w.name))
    x, y = np.random.default_rng(1).standard_normal((5, 6)), np.array([0, 1, 2, 0, 1])
    net.backward([softmax_cross_entropy(net.forward(x), y, inplace=True)[1]])
    assert [e for e in order if e[0] != "retire"] == [
        ("dW", 3),
        ("all-reduce", "layer3.weight"),
        ("dW", 2),
        ("all-reduce", "layer2.weight"),
        ("dW", 1),
        ("all-reduce", "layer1.weight"),
    ]
    assert [e[1] for e in order if e[0] == "retire"] == [3, 2, 1, 0]
