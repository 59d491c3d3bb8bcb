"""The weight gradients on a second stream (mlptrain.nn.cuda.streams): the same bits as one stream."""

import re
from collections import Counter

import numpy as np
import pytest
from gpu_helpers import cp, graph_run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("graph", "bgrad"), [(True, "bgradb"), (True, "drelu_bgrad"), (False, "bgradb")])
def test_two_stream_backward_equals_one_stream(graph, bgrad):
    """Weight gradients on a side stream: the same kernels on the same operands, so the same bits.

    A missing fork or join, or memory reused while the other stream still reads it, changes the
    gradients of some step; 84 steps span two epochs, a last short batch and its own graph.
    """
    cfg = {"precision.name": "fp16", "execution.bgrad": bgrad}
    t2, l2 = graph_run(graph, 84, **cfg)
    t1, l1 = graph_run(graph, 84, **cfg, **{"execution.wgrad_stream": False})
    assert t2.model.uses_wgrad_stream and not t1.model.uses_wgrad_stream
    np.testing.assert_array_equal(l2, l1)
    for p2, p1 in zip(t2.model.params, t1.model.params, strict=True):
        cp.testing.assert_array_equal(p2.value, p1.value)
    if graph:  # the captured step forks: some node has two successors (dX and dW of the same dZ)
        graph2 = next(iter(t2.graphed.graphs().values()))
        graph1 = next(iter(t1.graphed.graphs().values()))
        assert _max_out_degree(graph2) >= 2 and _max_out_degree(graph1) == 1


def _max_out_degree(graph):
    edges = re.findall(r'"[^"]*?(\d+)"\s*->\s*"', graph.debug_dot_str())
    return max(Counter(edges).values())


def _steps(tr, steps: int, beside: bool) -> np.ndarray:
    """``steps`` losses of ``tr`` as graph_run takes them; ``beside=False``: every parameter updated at the end."""
    if not beside:
        tr.early_groups = {}
    losses = []
    with cp.cuda.Stream(non_blocking=True):
        for epoch in range(4):
            for x, y in tr.train_loader.epoch(epoch, out=tr.batch_buffers):
                losses.append(tr.step(x, y)[0].copy())
                if len(losses) == steps:
                    break
            if len(losses) == steps:
                break
        cp.cuda.get_current_stream().synchronize()
    return np.array([float(v) for v in losses])


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("graph", [True, False])
def test_each_layers_update_beside_the_backward_equals_the_update_at_the_end(graph, optimizer):
    """bf16 (no loss scaler): each layer above the first is updated on the side stream once its backward is done
    (mlptrain.step.cuda.update), by the same arithmetic on the same gradients: the same bits as every parameter
    updated at the end. An update that overwrote a weight before the input-gradient GEMM read it, or read a gradient
    before it was made, changes some step's loss; Adam's bias correction reads t, which the step's own launch
    advances after the layers' updates. 84 steps span two epochs, a last short batch and its own graph."""
    from gpu_helpers import gpu_trainer

    cfg = {"precision.name": "bf16", "optimizer.name": optimizer, "optimizer.lr": 1e-3 if optimizer == "adam" else 0.05}
    cfg.update({"data.batch_size": 64, "epochs": 4, "execution.bgrad": "bgradb", "graph": graph})
    beside, end = gpu_trainer(**cfg), gpu_trainer(**cfg)
    layers = len(beside.model.layers)
    assert beside.model.uses_wgrad_stream and sorted(beside.early_groups) == list(range(1, layers))
    lb, le = _steps(beside, 84, True), _steps(end, 84, False)
    np.testing.assert_array_equal(lb, le)
    for pb, pe in zip(beside.model.params, end.model.params, strict=True):
        cp.testing.assert_array_equal(pb.value, pe.value)
    if graph:  # each layer's update is a kernel of its own in the captured step; none where they run at the end
        early = f"mlptrain_{optimizer}_step_early"
        assert next(iter(beside.graphed.graphs().values())).debug_dot_str().count(early) == layers - 1
        assert early not in next(iter(end.graphed.graphs().values())).debug_dot_str()
