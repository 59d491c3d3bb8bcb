"""ONNX export of a ``data.normalize=quantile`` model (mlptrain.inference.onnx_quantile): the graph's interp against
``np.interp`` (ties, constant columns, values at and between quantiles, outside the range), its ndtri against SciPy's
and mlptrain's, its whole map against ``QuantileMap.apply_``, and exported models against ``mlptrain.predict``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from mlptrain.base.normal import ndtri as numpy_ndtri
from mlptrain.cli.export import ExportArgs, export
from mlptrain.data.files.column_stats import HIGH, LOW, QuantileMap
from mlptrain.inference import onnx_quantile
from mlptrain.inference.onnx_columns import feeds
from mlptrain.inference.predictor import Predictor
from tests.test_scaling import cli, table, write_table

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def _session(g: onnx_quantile.Nodes, inputs: dict[str, tuple[str | int, ...]], out: str) -> Any:
    """An ONNX Runtime session of ``g``'s nodes: double inputs of the given shapes (None: any size), one output."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        g.nodes,
        "test",
        [helper.make_tensor_value_info(n, TensorProto.DOUBLE, list(s)) for n, s in inputs.items()],
        [helper.make_tensor_value_info(out, TensorProto.DOUBLE, ["N", None][: len(next(iter(inputs.values())))])],
        g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 8)
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString())


def _onnx_interp(x: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    """``x (N, K)`` through :func:`onnx_quantile.interp` of ``xp, fp (K, Q)``, run by ONNX Runtime."""
    g = onnx_quantile.Nodes("t_")
    out = g.op("Identity", onnx_quantile.interp(g, "x", xp, fp, "i_"), out="y")
    return _session(g, {"x": ("N", xp.shape[0])}, out).run(["y"], {"x": x})[0]


# Each column its own case (K = 5, Q = 9): ties inside, ties at both ends, a constant column, steps of 1e-300
TABLES = np.array(
    [
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
        [0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 5.0, 5.0],
        [-2.0, -2.0, -2.0, -1.0, 0.5, 0.5, 0.5, 0.5, 9.0],
        [4.0] * 9,
        [1.0, 1.0 + 1e-12, 1.0 + 2e-12, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0],
    ]
)


def _probes(xp: np.ndarray) -> np.ndarray:
    """``(M,)`` values for one column's table: each quantile, its neighbours in float64, midpoints, outside."""
    at = np.unique(xp)
    mids = (at[1:] + at[:-1]) / 2
    near = np.concatenate([np.nextafter(at, -np.inf), np.nextafter(at, np.inf)])
    far = [xp[0] - 1e6, xp[0] - 1.0, xp[-1] + 1.0, xp[-1] + 1e6, -1e300, 1e300]
    return np.concatenate([at, mids, near, far, np.linspace(xp[0] - 0.5, xp[-1] + 0.5, 101)])


@pytest.mark.parametrize("fp_kind", ["refs", "backward", "random"])
def test_interp_is_numpys_on_ties_ends_and_constant_columns(fp_kind: str) -> None:
    """Bit for bit np.interp's: a tie rule that took the first of a run, interpolated across a zero-width segment,
    or clamped wrongly outside the range would differ in these columns."""
    k, q = TABLES.shape
    refs = np.linspace(0.0, 1.0, q)
    xp = -TABLES[:, ::-1] if fp_kind == "backward" else TABLES
    fp = {"refs": np.broadcast_to(refs, (k, q)), "backward": np.broadcast_to(-refs[::-1], (k, q))}.get(
        fp_kind, np.random.default_rng(0).normal(size=(k, q))
    )
    columns = [_probes(xp[c]) for c in range(k)]
    m = max(len(c) for c in columns)
    x = np.stack([np.resize(c, m) for c in columns], axis=1)  # (M, K) each column its own probes
    got = _onnx_interp(x, np.ascontiguousarray(xp), np.ascontiguousarray(fp))
    want = np.stack([np.interp(x[:, c], xp[c], fp[c]) for c in range(k)], axis=1)
    assert_array_equal(got, want)
    if fp_kind != "backward":  # the cases that tell tie rules apart: a value on a run takes its last member's fp
        assert got[np.flatnonzero(x[:, 1] == 1.0)[0], 1] == fp[1, 3]
        assert got[np.flatnonzero(x[:, 3] == 4.0)[0], 3] == fp[3, -1]
        assert got[np.flatnonzero(x[:, 2] == 0.5)[0], 2] == fp[2, 7]


@pytest.mark.parametrize("q", [1, 2, 3, 7, 8, 1000, 1023, 1024])
def test_interp_searches_every_table_length(q: int) -> None:
    """The unrolled bisection for Q around powers of two (its padding) and one of a single quantile."""
    rng = np.random.default_rng(q)
    xp = np.sort(np.round(rng.normal(size=(3, q)), 1), axis=1)  # rounded: many ties
    fp = np.broadcast_to(np.linspace(0.0, 1.0, q), (3, q)).copy()
    x = np.concatenate([xp.T, rng.normal(size=(200, 3)) * 2])  # (Q + 200, 3)
    want = np.stack([np.interp(x[:, c], xp[c], fp[c]) for c in range(3)], axis=1)
    assert_array_equal(_onnx_interp(x, xp, fp), want)


def test_ndtri_is_scipys_and_mlptrains() -> None:
    special = pytest.importorskip("scipy.special")
    tiny = np.array([0.0, 1e-300, 1e-20, 1e-7, 1e-7 - np.spacing(1), 0.02425, 0.075, 0.5 - 1e-12, 0.5])
    p = np.concatenate([tiny, 1 - tiny, np.linspace(0.0, 1.0, 100_001), np.logspace(-16, -1, 1000)])
    g = onnx_quantile.Nodes("t_")
    out = g.op("Identity", onnx_quantile.ndtri(g, "p"), out="y")
    got = _session(g, {"p": ("N",)}, out).run(["y"], {"p": p})[0]
    ours = numpy_ndtri(p)
    central = np.abs(p - 0.5) <= 0.425
    assert_array_equal(got[central], ours[central])  # the same coefficients, multiplied and added in the same order
    tails = ~central & np.isfinite(ours)  # ONNX Runtime's Log and Sqrt may differ from NumPy's in the last bit
    assert_allclose(got[tails], ours[tails], rtol=4e-16 * 8, atol=0)
    want = special.ndtri(p)
    assert got[np.flatnonzero(p == 0.0)[0]] == -np.inf and got[np.flatnonzero(p == 1.0)[0]] == np.inf
    assert got[np.flatnonzero(p == 0.5)[0]] == 0.0
    finite = np.isfinite(want)
    assert_allclose(got[finite], want[finite], rtol=1e-14, atol=1e-15)


def test_the_whole_map_is_quantile_maps() -> None:
    """quantile_graph on a table of F = 7 columns, 5 mapped (ties, a spike, skew): QuantileMap.apply_'s values,
    the other columns untouched, values at, between and beyond the quantiles and within 1e-7 of the ends."""
    rng = np.random.default_rng(3)
    n = 500
    train = np.stack(
        [
            rng.lognormal(size=n),
            np.round(rng.normal(size=n)),  # ties
            rng.integers(0, 2, n).astype(float),  # 0/1: left out of the map
            np.where(rng.random(n) < 0.03, 50.0, 1.0),  # a spike: most quantiles tied at 1
            rng.exponential(size=n) * 1e-4,
            np.full(n, 3.0),  # constant: left out
            2.0 + rng.random(n) * 1e-8,  # narrower than 2e-7: both bounds hold everywhere, the lower wins
        ],
        axis=1,
    )
    qmap = QuantileMap.fit(train, None, np.array([0, 1, 3, 4, 6]), seed=0)
    lo, hi = qmap.quantiles[0], qmap.quantiles[-1]  # (K,)
    edges = np.zeros((8, 7))
    edges[:, [0, 1, 3, 4, 6]] = np.stack([lo, hi, lo + 1e-7, hi - 1e-7, lo + 2e-7, hi - 2e-7, lo - 5, hi + 5])
    x = np.concatenate([train, rng.normal(size=(100, 7)) * 20, edges])
    g = onnx_quantile.Nodes("q_")
    g.nodes, g.inits = onnx_quantile.quantile_graph(qmap, 7, "x", "y")
    got = _session(g, {"x": ("N", 7)}, "y").run(["y"], {"x": x})[0]
    want = qmap.apply_(x.copy())
    assert_allclose(got, want, rtol=1e-15, atol=1e-15)  # ndtri's tails: Log and Sqrt within an ulp or two
    assert_array_equal(got == LOW, want == LOW)
    assert_array_equal(got[:, [2, 5]], x[:, [2, 5]])
    mapped = got[:, [0, 1, 3, 4, 6]]
    assert mapped.min() == LOW and mapped.max() == HIGH  # at or beyond the ends: clipped
    assert (got[:n, 6] == LOW).all()


@pytest.fixture(scope="module")
def quantile_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model and one ensemble of 3 trained with data.normalize=quantile on a CSV with skewed columns, ties, a
    constant, empty cells and a text column (tests.test_scaling.write_table), and the rows to score."""
    tmp = tmp_path_factory.mktemp("onnx_quantile")
    write_table(tmp / "train.csv", 400, 0)
    x = table(400, 2).astype(np.float32)  # numbers only: no column plan, the graph's input is x (N, 7)
    np.savez(tmp / "numeric.npz", x=x, y=(np.log(x[:, 0]) + x[:, 2] > 1.5).astype(np.int64))
    args = ["data=file", "data.normalize=quantile", "epochs=3", "device=cpu", "progress=false"]
    for name, extra in (
        ("single", ["data.path=train.csv", "data.target=label"]),
        ("ensemble", ["data.path=train.csv", "data.target=label", "ensemble.size=3"]),
        ("numeric", ["data.path=numeric.npz"]),
    ):
        cli("mlptrain", *args, *extra, f"hydra.run.dir={name}", cwd=tmp)
    return tmp


def _outside(frame: Any) -> Any:
    """Rows beyond the training range: every numeric column far below and far above its training values."""
    out = frame.copy()
    for c in ("skew", "outlier", "ties", "spike"):
        values = frame[c].replace("", np.nan).astype(float)
        half = len(out) // 2
        out.loc[: half - 1, c] = (values.min() - 10.0 * (values.std() + 1)).astype(str)
        out.loc[half:, c] = (values.max() + 10.0 * (values.std() + 1)).astype(str)
    out["constant"] = "-7.5"  # a constant column's other value: shifted, not mapped
    return out


@pytest.mark.parametrize("name", ["single", "ensemble"])
def test_a_quantile_model_exports_to_onnx_equal_to_predict(quantile_runs: Path, name: str) -> None:
    import pandas as pd

    ckpt = quantile_runs / name / "checkpoints" / "best.npz"
    p = Predictor(ckpt, device="cpu", precision="fp32")
    assert p.normalization.quantile is not None and p.plan is not None
    assert (p.model.members == 3) == (name == "ensemble")
    mapped = [p.feature_names[j] for j in p.normalization.quantile.columns] if p.feature_names else []
    assert mapped == ["skew", "outlier", "ties", "spike"]  # not the constant, the indicator or the one-hots
    out = export(ExportArgs(ckpt=str(ckpt), format="onnx", output=str(quantile_runs / f"{name}.onnx")))
    session = ort.InferenceSession(str(out))
    train = pd.read_csv(quantile_runs / "train.csv", keep_default_na=False, dtype=str)
    for frame in (train, _outside(train)):
        probs, class_id = session.run(["probabilities", "class_id"], feeds(p.plan, frame))
        cells = {c: np.char.strip(frame[c].to_numpy().astype(str)) for c in p.plan.names}
        want = p.run(p.encode(cells, "raw", str), probabilities=True)
        assert want.probabilities is not None
        assert_allclose(probs, want.probabilities, rtol=0, atol=1e-5)
        assert_array_equal(class_id, want.class_id)


def test_a_quantile_model_of_numbers_alone_exports_to_onnx_equal_to_predict(quantile_runs: Path) -> None:
    ckpt = quantile_runs / "numeric" / "checkpoints" / "best.npz"
    p = Predictor(ckpt, device="cpu", precision="fp32")
    assert p.plan is None and p.normalization.quantile is not None
    assert p.normalization.quantile.columns.tolist() == [0, 1, 2, 4, 5, 6]  # all but the constant
    out = export(ExportArgs(ckpt=str(ckpt), format="onnx", output=str(quantile_runs / "numeric.onnx")))
    session = ort.InferenceSession(str(out))
    x = np.load(quantile_runs / "numeric.npz")["x"]  # (400, 7) float32
    beyond = np.concatenate([x.min(axis=0) - 1e3, x.max(axis=0) + 1e3]).reshape(2, -1).astype(np.float32)
    for rows in (x, beyond, x * 1.5):
        probs, class_id = session.run(["probabilities", "class_id"], {"x": rows})
        want = p.run(rows, probabilities=True)
        assert want.probabilities is not None
        assert_allclose(probs, want.probabilities, rtol=0, atol=1e-5)
        assert_array_equal(class_id, want.class_id)
