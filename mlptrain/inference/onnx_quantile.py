"""``data.normalize=quantile``'s map as ONNX nodes: the exported graph maps raw columns to a standard normal as
:meth:`mlptrain.data.files.column_stats.QuantileMap.apply_` does, in float64, before the shift and scale::

    x64 (N, F) double -> Gather(columns) -> x (N, K)                    the K mapped columns
        u = 0.5 * (interp(x, q, r) - interp(-x, -q[::-1], -r[::-1]))    (N, K), r = linspace(0, 1, Q)
        u = Where(x + 1e-7 > q[-1], 1, u); u = Where(x - 1e-7 < q[0], 0, u)   (the lower bound wins)
        z = Min(Max(ndtri(u), LOW), HIGH)                              (N, K)
    Gather(Concat(x64, z), inverse permutation, axis=1) -> (N, F)       z in the mapped columns' places

**interp** (``np.interp`` with an ascending ``xp``, ties allowed) for all K columns at once, without an
``(N, K, Q)`` comparison: ``count = #{i: xp[i] <= x}`` by a bisection unrolled into ``m = ceil(log2(Q + 1))``
steps (``pos += step`` where ``xp[pos + step - 1] <= x``, for ``step = 2**(m-1) ... 1``; each column's ``xp``
padded with ``+inf`` to ``2**m - 1`` entries), each step a ``Gather`` of ``(N, K)`` values from the flat
``(K * L,)`` table, so the graph holds ``O(N K)`` values and does ``O(N K log Q)`` work. Then NumPy's rule
(``numpy/core/src/multiarray/compiled_base.c``, ``arr_interp``), with ``j = count - 1``, the last ``xp[j] <= x``:

    x < xp[0]: fp[0]      x > xp[-1]: fp[-1]      x == xp[j] (j = Q - 1 included): fp[j]
    else: slope[j] * (x - xp[j]) + fp[j],   slope[j] = (fp[j+1] - fp[j]) / (xp[j+1] - xp[j])

``xp[j] <= x < xp[j + 1]`` makes the segment's width positive: a run of tied quantiles is never
interpolated across, and a value equal to the run takes the ``fp`` of its last member (its first, in the
backward interpolation of ``-x``: hence the average, the middle of the run). The slopes are NumPy's, computed
on the host in the same order (a zero-width segment's, never used, is 0).

**ndtri** has no ONNX operator: Wichura's AS241 (:mod:`mlptrain.base.normal`, the same coefficients, the same
Horner order), its three regions each evaluated on every value and picked by ``Where``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlptrain.base.normal import CENTRAL, FAR, NEAR
from mlptrain.data.files.column_stats import BOUNDS_THRESHOLD, HIGH, LOW, QuantileMap


class Nodes:
    """ONNX nodes and initializers under one name prefix: :meth:`op` appends a node and returns its output's
    name, :meth:`const` an initializer's (float64 unless the value is an integer array)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.count = 0  # nodes so far: each output's name is unique

    def const(self, name: str, value: Any) -> str:
        from onnx import numpy_helper

        a = np.asarray(value)
        a = a if a.dtype == np.int64 else a.astype(np.float64)
        self.inits.append(numpy_helper.from_array(a, self.prefix + name))
        return self.prefix + name

    def op(self, kind: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        from onnx import helper

        self.count += 1
        name = out if out is not None else f"{self.prefix}{kind.lower()}{self.count}"
        self.nodes.append(helper.make_node(kind, list(inputs), [name], **attrs))
        return name


def interp(g: Nodes, x: str, xp: np.ndarray, fp: np.ndarray, tag: str) -> str:
    """``np.interp`` of each column: ``x (N, K)`` double against ``xp (K, Q)`` ascending (ties allowed) and
    ``fp (K, Q)``; returns the name of the ``(N, K)`` result (see the module for the rule)."""
    k, q = xp.shape
    bits = q.bit_length()  # m: the fewest with 2**m - 1 >= Q
    width = 2**bits - 1  # L: each column's table padded to it, so every probe lands in its own column
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = (fp[:, 1:] - fp[:, :-1]) / (xp[:, 1:] - xp[:, :-1])  # (K, Q-1) NumPy's slopes[j]
    slope = np.where(xp[:, 1:] > xp[:, :-1], slope, 0.0)  # a zero-width segment's is never used

    def table(a: np.ndarray, pad: float) -> np.ndarray:
        return np.concatenate([a, np.full((k, width - a.shape[1]), pad)], axis=1).reshape(-1)  # (K * L,)

    offsets = np.arange(k, dtype=np.int64) * width  # (K,) where each column's table starts
    xs = g.const(tag + "xp", table(xp, np.inf))
    pos = g.const(tag + "start", offsets)  # (K,), then (N, K): a flat index, its column's offset + count so far
    for step in (2**b for b in reversed(range(bits))):
        probe = g.op("Add", pos, g.const(f"{tag}probe{step}", np.int64(step - 1)))
        take = g.op("LessOrEqual", g.op("Gather", xs, probe), x)  # (N, K) xp[pos + step - 1] <= x
        pos = g.op("Where", take, g.op("Add", pos, g.const(f"{tag}step{step}", np.int64(step))), pos)
    count = g.op("Sub", pos, g.const(tag + "offsets", offsets))  # (N, K) #{i: xp[i] <= x}, + padding if x = inf
    j = g.op("Sub", count, g.const(tag + "one", np.int64(1)))  # (N, K) the last xp[j] <= x; -1 below xp[0]
    j = g.op("Clip", j, g.const(tag + "zero", np.int64(0)), g.const(tag + "last", np.int64(q - 1)))  # in [0, Q-1]
    at = g.op("Add", j, g.const(tag + "offsets_j", offsets))
    xj = g.op("Gather", xs, at)
    fj = g.op("Gather", g.const(tag + "fp", table(fp, 0.0)), at)
    sj = g.op("Gather", g.const(tag + "slope", table(slope, 0.0)), at)
    f = g.op("Add", g.op("Mul", sj, g.op("Sub", x, xj)), fj)  # slope[j] * (x - xp[j]) + fp[j], NumPy's order
    f = g.op("Where", g.op("Equal", x, xj), fj, f)  # x == xp[j]: fp[j] (also x == xp[-1])
    f = g.op("Where", g.op("Greater", x, g.const(tag + "xp_last", xp[:, -1])), g.const(tag + "fp_last", fp[:, -1]), f)
    return g.op("Where", g.op("Less", x, g.const(tag + "xp_first", xp[:, 0])), g.const(tag + "fp_first", fp[:, 0]), f)


def _rational(g: Nodes, coefficients: tuple[tuple[float, ...], tuple[float, ...]], t: str, tag: str) -> str:
    """``num(t) / den(t)`` by Horner's rule, multiplied and added in :mod:`mlptrain.base.normal`'s order."""
    num, den = g.const(tag + "num0", coefficients[0][0]), g.const(tag + "den0", coefficients[1][0])
    for i, (a, b) in enumerate(zip(coefficients[0][1:], coefficients[1][1:], strict=True), start=1):
        num = g.op("Add", g.op("Mul", num, t), g.const(f"{tag}num{i}", a))
        den = g.op("Add", g.op("Mul", den, t), g.const(f"{tag}den{i}", b))
    return g.op("Div", num, den)


def ndtri(g: Nodes, p: str) -> str:
    """The standard normal's quantile function of ``p`` (any shape, double, in ``[0, 1]``): AS241's three regions
    (:func:`mlptrain.base.normal.ndtri`), ``-inf`` at 0 and ``+inf`` at 1; returns the result's name."""
    q = g.op("Sub", p, g.const("half", 0.5))
    central = g.op("LessOrEqual", g.op("Abs", q), g.const("central_edge", 0.425))  # |p - 0.5| <= 0.425
    r_central = g.op("Sub", g.const("central_r", 0.180625), g.op("Mul", q, q))
    x_central = g.op("Mul", q, _rational(g, CENTRAL, r_central, "central_"))
    lower = g.op("LessOrEqual", q, g.const("zero", 0.0))
    tail_p = g.op("Where", lower, p, g.op("Sub", g.const("one", 1.0), p))  # min(p, 1 - p)
    r = g.op("Sqrt", g.op("Neg", g.op("Log", tail_p)))  # inf at p = 0 or 1
    x_near = _rational(g, NEAR, g.op("Sub", r, g.const("near_shift", 1.6)), "near_")
    x_far = _rational(g, FAR, g.op("Sub", r, g.const("far_shift", 5.0)), "far_")
    x = g.op("Where", g.op("LessOrEqual", r, g.const("near_edge", 5.0)), x_near, x_far)
    x = g.op("Where", g.op("IsInf", r), g.const("inf", np.inf), x)  # the tails' limits (inf / inf above)
    x = g.op("Where", g.op("Less", q, g.const("zero_sign", 0.0)), g.op("Neg", x), x)
    return g.op("Where", central, x_central, x)


def quantile_graph(qmap: QuantileMap, features: int, x64: str, out: str) -> tuple[list[Any], list[Any]]:
    """``(nodes, initializers)`` that map ``x64 (N, F)`` double's columns ``qmap.columns`` into ``out (N, F)``
    double as ``qmap.apply_`` does (the other columns unchanged); see the module."""
    g = Nodes("quantile_")
    q = qmap.quantiles.T.astype(np.float64)  # (K, Q) each mapped column's quantiles, ascending
    k, n_q = q.shape
    refs = np.broadcast_to(np.linspace(0.0, 1.0, n_q), (k, n_q))  # (K, Q)
    x = g.op("Gather", x64, g.const("columns", qmap.columns.astype(np.int64)), axis=1)  # (N, K)
    forward = interp(g, x, q, refs, "forward_")
    backward = interp(g, g.op("Neg", x), -q[:, ::-1], -refs[:, ::-1], "backward_")
    u = g.op("Mul", g.const("u_half", 0.5), g.op("Sub", forward, backward))  # (N, K) in [0, 1]
    bound = g.const("bound", BOUNDS_THRESHOLD)
    above = g.op("Greater", g.op("Add", x, bound), g.const("q_last", q[:, -1]))
    below = g.op("Less", g.op("Sub", x, bound), g.const("q_first", q[:, 0]))
    u = g.op("Where", above, g.const("u_one", 1.0), u)
    u = g.op("Where", below, g.const("u_zero", 0.0), u)  # after: the lower bound wins
    z = g.op("Min", g.op("Max", ndtri(g, u), g.const("low", LOW)), g.const("high", HIGH))  # (N, K)
    # (N, F + K) -> (N, F): column j from x64, or the k-th mapped one from z
    places = np.arange(features, dtype=np.int64)
    places[qmap.columns] = features + np.arange(k, dtype=np.int64)
    g.op("Gather", g.op("Concat", x64, z, axis=1), g.const("places", places), axis=1, out=out)
    return g.nodes, g.inits
