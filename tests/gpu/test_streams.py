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
