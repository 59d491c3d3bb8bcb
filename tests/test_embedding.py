"""Learned embeddings of categorical columns (mlptrain.nn.embedding, #49): the blocks against the column plan,
gradients against finite differences (float64) and against an explicit lookup, fused equal to naive, the folded
network equal to the unfolded forward (0/1 blocks, and blocks a normalisation shifted and scaled), a checkpoint's
round trip and resume, the checkpoints of the day's ``model.embedding_inputs``, the refusals, and ``E``'s start
(a level's first pre-activation at one-hot's scale under each ``model.init``)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg, records
from numpy.testing import assert_allclose, assert_array_equal
from test_checkpoint import assert_same_state, interrupt_at

from mlptrain.base.errors import CheckpointError, ConfigError, TrainingInterrupted
from mlptrain.config.schema import DatasetName
from mlptrain.data import load_dataset
from mlptrain.data.files.plan import fit_plan
from mlptrain.inference.predictor import Predictor
from mlptrain.nn.embedding import Block, ColumnEmbedding, blocks, fold, fold_checkpoint
from mlptrain.nn.execution import FusedExecution, NaiveExecution, NumpyGemm
from mlptrain.nn.network import MLP
from mlptrain.run import checkpoint
from mlptrain.run.run import train
from mlptrain.step.checks import validate

# X's columns: a numeric column, a 3-level block (stays one-hot), a numeric, a 7-level block (embedded)
LAYOUT = [("a", 1), ("small", 3), ("b", 1), ("big", 7)]


def table_x(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``X (n, 12)`` of LAYOUT as data.normalize leaves it (numbers standard normal, one-hot columns 0/1) and the
    big column's levels."""
    cols = []
    big = rng.integers(0, 7, n)
    big[:7] = np.arange(7)  # every level present
    small = rng.integers(0, 3, n)
    small[:3] = np.arange(3)
    for _, width in LAYOUT:
        cols.append(rng.standard_normal((n, 1)) if width == 1 else np.eye(width)[big if width == 7 else small])
    return np.hstack(cols), big


BIG = [Block("big", 5, 12)]


def make_net(mode: str, dtype: Any = np.float64, seed: int = 0):
    gemm = NumpyGemm()
    ex = FusedExecution(gemm) if mode == "fused" else NaiveExecution(gemm, np)
    rng = np.random.default_rng(seed)
    kw = {"rng": rng, "xp": np, "param_dtype": dtype, "compute_dtype": dtype}
    emb = ColumnEmbedding(BIG, 12, 3, **kw)
    net = MLP([12, 6, 4], execution=ex, embedding=emb, **kw)
    for layer in net.layers:  # non-zero biases: a bias folded wrongly shows
        layer.bias.value[...] = rng.standard_normal(layer.out_features) * 0.1
    return net


def test_the_blocks_are_the_plans_one_hot_columns_and_a_column_under_the_threshold_stays_one_hot() -> None:
    rng = np.random.default_rng(0)
    n = 400
    cells = {
        "num": np.array([f"{v:.3f}" if i % 9 else "" for i, v in enumerate(rng.normal(size=n))]),
        "few": rng.choice(["x", "y", "z"], n),
        "many": np.array([f"id{v}" for v in rng.integers(0, 40, n)]),
        "tail": np.array([f"t{v}" for v in rng.zipf(1.5, n) % 60]),  # rare levels grouped into <rare>
    }
    plan = fit_plan(cells, np.arange(n), [], min_frequency=3)
    names = plan.feature_names
    got = blocks(plan.to_meta(), 10)
    assert [b.name for b in got] == ["many", "tail"]  # "few" (3 levels) stays one-hot
    for b in got:
        block = names[b.start : b.stop]
        assert all(s.startswith(f"{b.name}=") for s in block) and len(block) == b.levels >= 10
        assert b.stop == len(names) or not names[b.stop].startswith(f"{b.name}=")
    assert "tail=<rare>" in names[got[1].start : got[1].stop]
    assert blocks(plan.to_meta(), 10_000) == [] and blocks(None, 2) == []


@pytest.mark.parametrize("mode", ["fused", "naive"])
def test_gradients_match_finite_differences_in_float64(mode: str) -> None:
    rng = np.random.default_rng(1)
    x, _ = table_x(rng, 16)
    net = make_net(mode)
    r = rng.standard_normal((16, 4))  # loss = sum(logits * r): dlogits = r

    def loss() -> float:
        return float((net.forward(x, keep=False) * r).sum())

    net.forward(x)
    net.backward(r)
    eps = 1e-6
    for p in net.params:
        for i in list(np.ndindex(p.value.shape))[:: max(1, p.value.size // 25)]:
            old = p.value[i]
            p.value[i] = old + eps
            up = loss()
            p.value[i] = old - eps
            down = loss()
            p.value[i] = old
            assert_allclose(p.grad[i], (up - down) / (2 * eps), rtol=1e-6, atol=1e-8, err_msg=f"{p.name}{i}")
    assert {p.name for p in net.params} >= {"embed0.weight", "layer0.weight"}


def test_onehot_is_a_lookup_and_its_gradient_the_scattered_rows() -> None:
    """The first layer reads ``[x_other | E[level]]``; ``dE[l]`` is the sum of ``dH`` over the rows of level ``l``."""
    rng = np.random.default_rng(2)
    x, big = table_x(rng, 20)
    net = make_net("fused")
    E = net.embedding.tables[0].value  # (7, 3)
    w0, b0 = net.layers[0].weight.value, net.layers[0].bias.value
    xp = np.hstack([x[:, :5], E[big]])  # (20, 8): the lookup, written out
    h = np.maximum(xp @ w0.T + b0, 0)
    want = h @ net.layers[1].weight.value.T + net.layers[1].bias.value
    assert_allclose(net.forward(x), want, rtol=1e-12)
    r = rng.standard_normal((20, 4))
    net.backward(r)
    dz0 = (r @ net.layers[1].weight.value) * (h > 0)  # (20, 6)
    dh = dz0 @ w0[:, 5:]  # (20, 3)
    scattered = np.zeros_like(E)
    np.add.at(scattered, big, dh)
    assert_allclose(net.embedding.tables[0].grad, scattered, rtol=1e-12)


def test_fused_and_naive_agree() -> None:
    rng = np.random.default_rng(3)
    x, _ = table_x(rng, 32)
    x = x.astype(np.float32)
    nets = [make_net(mode, np.float32) for mode in ("fused", "naive")]
    r = rng.standard_normal((32, 4)).astype(np.float32)
    out = []
    for net in nets:
        logits = net.forward(x)
        net.backward(r.copy())
        out.append((logits, [p.grad for p in net.params]))
    assert_allclose(out[0][0], out[1][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(out[0][1], out[1][1], strict=True):
        assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("blocks_as", ["0/1", "shifted and scaled"])
def test_the_folded_network_predicts_as_the_unfolded_forward(blocks_as: str) -> None:
    """On 0/1 blocks (a level never seen in training: all zeros) and on blocks a normalisation moved off 0/1 (the
    fold reads no normalisation: the embedding reads the block as it is, as the folded layer does)."""
    rng = np.random.default_rng(4)
    x, _ = table_x(rng, 50)
    x[-1, 5:] = 0.0  # a level never seen in training
    if blocks_as != "0/1":
        x = (x - rng.uniform(0.1, 0.5, 12)) / rng.uniform(0.2, 2.0, 12)
    x = x.astype(np.float32)
    net = make_net("fused", np.float32)
    params = {k: np.asarray(v) for k, v in net.state_dict().items()}
    plain = MLP([12, 6, 4], execution=FusedExecution(NumpyGemm()), xp=np, rng=np.random.default_rng(9), **F32)
    folded = fold(params, BIG, 12)
    assert sorted(folded) == [f"layer{i}.{k}" for i in (0, 1) for k in ("bias", "weight")]
    assert_array_equal(folded["layer0.bias"], params["layer0.bias"])
    plain.load_state_dict(folded)
    assert_allclose(plain.forward(x, keep=False), net.forward(x, keep=False), rtol=1e-5, atol=1e-5)


F32 = {"param_dtype": np.float32, "compute_dtype": np.float32}


def test_a_checkpoint_whose_embedding_does_not_fit_its_parameters_is_refused() -> None:
    params = make_net("fused").state_dict()
    meta = {"widths": [12, 6, 4], "embedding": {"dim": 3, "blocks": [["big", 5, 12]]}}
    assert fold_checkpoint(params, meta, {}, "x.npz")["layer0.weight"].shape == (6, 12)
    with pytest.raises(CheckpointError, match=r"x\.npz: its embeddings .* need parameters"):
        fold_checkpoint(params, {**meta, "embedding": {**meta["embedding"], "dim": 4}}, {}, "x.npz")
    with pytest.raises(CheckpointError, match="x.npz: its embedding meta"):
        fold_checkpoint(params, {**meta, "embedding": {"dim": 3}}, {}, "x.npz")


def test_a_checkpoint_of_model_embedding_inputs_folds_where_its_blocks_were_read_as_they_are() -> None:
    """The day's checkpoints said what a block read: ``standardized`` (as it is) and ``onehot`` over 0/1 blocks
    (the read-back compare a no-op) fold as now; ``onehot`` over standardised blocks is refused, naming them."""
    params = make_net("fused").state_dict()
    rng = np.random.default_rng(5)
    zero_one = {
        "data/shift": np.r_[rng.normal(size=5), np.zeros(7)],
        "data/scale": np.r_[rng.uniform(1, 2, 5), np.ones(7)],
    }
    standardised = {"data/shift": np.full(12, 1 / 7), "data/scale": np.full(12, 0.35)}
    want = fold(params, BIG, 12)["layer0.weight"]
    for inputs, arrays in [("standardized", standardised), ("onehot", zero_one), ("onehot", {})]:
        meta = {"widths": [12, 6, 4], "embedding": {"dim": 3, "inputs": inputs, "blocks": [["big", 5, 12]]}}
        assert_array_equal(fold_checkpoint(params, meta, arrays, "x.npz")["layer0.weight"], want)
    for inputs, arrays in [("onehot", standardised), ("dense", zero_one)]:
        meta = {"widths": [12, 6, 4], "embedding": {"dim": 3, "inputs": inputs, "blocks": [["big", 5, 12]]}}
        with pytest.raises(CheckpointError, match=rf"x\.npz: .* as '{inputs}' .*train it again"):
            fold_checkpoint(params, meta, arrays, "x.npz")


# --- through a run: the checkpoint, resume, predict ---------------------------------------------------


def write_table(path: Path, n: int = 300, seed: int = 0) -> None:
    """A label from a 40-level id (each level an effect), a 3-level text column and a number."""
    rng = np.random.default_rng(seed)
    effect = rng.normal(0, 1.5, 40)
    rows = []
    for _ in range(n):
        code, x = int(rng.integers(0, 40)), rng.normal()
        color = str(rng.choice(["red", "green", "blue"]))
        rows.append([f"p{code}", color, f"{x:.4f}", "yes" if effect[code] + x + rng.normal(0, 0.5) > 0 else "no"])
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["product", "color", "x", "label"], *rows])


def table_cfg(path: Path, **kw: Any) -> Any:
    over = {"data__name": DatasetName.file, "data__path": str(path), "data__cache": False, "data__features": None}
    over |= {"data__batch_size": 32, "model__embedding_dim": 4, "model__embedding_min_levels": 10}
    return make_cfg(**(over | kw))


def test_a_checkpoint_keeps_the_embedding_resumes_exactly_and_predicts_through_the_fold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_table(tmp_path / "t.csv")
    cfg = table_cfg(tmp_path / "t.csv")
    train(cfg, tmp_path / "straight")
    ckpt = checkpoint.load(tmp_path / "straight" / "checkpoints" / "last.npz")
    product = ckpt.meta["data"]["columns"]["columns"][0]
    n = len(product["levels"]) + bool(product["rare"])  # its one-hot columns, 30 to 40
    assert 30 <= n <= 40 and ckpt.meta["widths"] == [n + 3 + 1, 32, 2]
    assert ckpt.arrays["param/embed0.weight"].shape == (n, 4)  # product embedded, color (3 levels) one-hot
    assert ckpt.arrays["param/layer0.weight"].shape == (32, 3 + 1 + 4)
    assert ckpt.meta["embedding"]["blocks"] == [["product", 0, n]]
    assert "optim/embed0.weight/momentum" in ckpt.arrays  # the optimizer keeps its state

    interrupt_at(monkeypatch, 10)  # mid-epoch: 7 steps each
    with pytest.raises(TrainingInterrupted):
        train(table_cfg(tmp_path / "t.csv"), tmp_path / "resumed")
    monkeypatch.undo()
    train(table_cfg(tmp_path / "t.csv", resume="last"), tmp_path / "resumed")
    assert records(tmp_path / "resumed") == records(tmp_path / "straight")
    assert_same_state(tmp_path / "resumed" / "checkpoints" / "last.npz", ckpt.path)

    p = Predictor(ckpt.path)  # the folded plain MLP: the first layer reads every column
    assert p.model.embedding is None and p.model.layers[0].weight.value.shape == (32, n + 4)
    x = load_dataset(cfg.data).x_test  # (N, n + 4) normalised as in training
    assert_array_equal(x[:, :n], x[:, :n] > 0.5)  # the product's block reaches the network 0/1
    kw = {"rng": np.random.default_rng(0), "xp": np, **F32}
    emb = ColumnEmbedding([Block("product", 0, n)], n + 4, 4, **kw)
    net = MLP([n + 4, 32, 2], execution=FusedExecution(NumpyGemm()), embedding=emb, **kw)
    net.load_state_dict({k[6:]: v for k, v in ckpt.arrays.items() if k.startswith("param/")})
    assert_allclose(p.model.forward(x, keep=False), net.forward(x, keep=False), rtol=1e-5, atol=1e-5)


def test_refusals_name_the_value() -> None:
    for over, text in [
        ({"model__embedding_dim": -2}, "model.embedding_dim=-2 must be a positive width"),
        ({"model__embedding_dim": 8, "model__embedding_min_levels": 1}, "model.embedding_min_levels=1"),
        (
            {"model__embedding_dim": 8, "precision__name": "fp8"},
            "model.embedding_dim=8 does not run with precision=fp8",
        ),
        ({"model__embedding_dim": 8, "ensemble__size": 2}, "does not run with an ensemble"),
    ]:
        with pytest.raises(ConfigError, match=text.replace("(", r"\(").replace(".", r"\.")):
            validate(make_cfg(**over))
    validate(make_cfg(model__embedding_dim=0))  # off: nothing to refuse
    validate(make_cfg(model__embedding_dim=8))


def test_a_run_without_a_column_of_enough_levels_trains_one_hot(tmp_path: Path) -> None:
    write_table(tmp_path / "t.csv", n=120)
    train(table_cfg(tmp_path / "t.csv", model__embedding_min_levels=1000, epochs=1), tmp_path / "r")
    ckpt = checkpoint.load(tmp_path / "r" / "checkpoints" / "last.npz")
    assert "embedding" not in ckpt.meta and not any(k.startswith("param/embed") for k in ckpt.arrays)
    assert_array_equal(ckpt.arrays["param/layer0.weight"].shape, (32, ckpt.meta["widths"][0]))


def test_the_exports_hold_the_folded_network_and_onnx_scores_raw_rows_as_predict(tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    pd = pytest.importorskip("pandas")
    from mlptrain.cli.export import ExportArgs, export, load_safetensors
    from mlptrain.inference.onnx_columns import feeds

    write_table(tmp_path / "t.csv")
    train(table_cfg(tmp_path / "t.csv", epochs=2), tmp_path / "r")
    ckpt = tmp_path / "r" / "checkpoints" / "best.npz"
    features = checkpoint.load(ckpt).meta["widths"][0]
    tensors, _ = load_safetensors(export(ExportArgs(ckpt=str(ckpt), format="safetensors")))
    assert tensors["0.weight"].shape == (32, features) and "embed0.weight" not in tensors  # nn.Sequential's names
    write_table(tmp_path / "rows.csv", n=50, seed=3)  # other rows: levels the training rows may not hold
    frame = pd.read_csv(tmp_path / "rows.csv", dtype=str, keep_default_na=False)
    sess = ort.InferenceSession(
        str(export(ExportArgs(ckpt=str(ckpt), format="onnx"))), providers=["CPUExecutionProvider"]
    )
    p = Predictor(ckpt, device="cpu")
    assert p.plan is not None
    (probabilities,) = sess.run(["probabilities"], feeds(p.plan, frame))
    want = p.run(p.encode({c: frame[c].to_numpy() for c in p.plan.names}, "rows", str), probabilities=True)
    assert_allclose(probabilities, want.probabilities, rtol=0, atol=1e-5)


def test_host_residency_trains_the_embedding_as_the_device_resident_run(tmp_path: Path) -> None:
    """The data path is unchanged: host-resident batches (the plan's encoded splits, copied per step) train the
    same embedded model."""
    write_table(tmp_path / "t.csv", n=160)
    train(table_cfg(tmp_path / "t.csv", epochs=2), tmp_path / "device")
    train(table_cfg(tmp_path / "t.csv", epochs=2, data__residency="host"), tmp_path / "host")
    got = records(tmp_path / "host")
    assert got == records(tmp_path / "device") and got[0]["train/loss"] > 0
    assert_same_state(tmp_path / "host" / "checkpoints" / "last.npz", tmp_path / "device" / "checkpoints" / "last.npz")


def test_the_kept_columns_go_first_in_order_whatever_the_blocks_between_them() -> None:
    """Two blocks, one at the start and one between kept columns: ``x'`` is the kept columns in X's order, then
    each block's rows of E."""
    rng = np.random.default_rng(6)
    levels = [rng.integers(0, 4, 9), rng.integers(0, 3, 9)]
    x = np.hstack(
        [np.eye(4)[levels[0]], rng.standard_normal((9, 2)), np.eye(3)[levels[1]], rng.standard_normal((9, 1))]
    )
    embedded = [Block("first", 0, 4), Block("middle", 6, 9)]
    kw = {"rng": rng, "xp": np, "param_dtype": np.float64, "compute_dtype": np.float64}
    emb = ColumnEmbedding(embedded, 10, 2, **kw)
    got = emb.forward(FusedExecution(NumpyGemm()), x, keep=False)
    E0, E1 = (t.value for t in emb.tables)
    assert_array_equal(got, np.hstack([x[:, [4, 5, 9]], E0[levels[0]], E1[levels[1]]]))


@pytest.mark.parametrize("init", ["he", "lecun", "torch"])
def test_a_level_starts_the_first_layer_as_its_one_hot_column_does(init: str) -> None:
    """``E_c ~ N(0, F' / (d F))``: each level's start ``E_c W_c^T (L_c, H)`` has the standard deviation of one-hot's
    first-layer weights ``W_0 (H, F)`` under the same ``model.init``, within sampling error, on a large table
    (F = 2,300: 300 kept columns, a block of 2,000 levels; d = 16, so F' = 316). N(0, 1) would start it 11x
    louder, a rule without ``d`` 4x; the draw is the seed's, scaled."""
    features, dim, hidden = 2300, 16, 128
    embedded = [Block("many", 300, 2300)]
    kw = {"xp": np, "param_dtype": np.float64, "compute_dtype": np.float64}
    emb = ColumnEmbedding(embedded, features, dim, rng=np.random.default_rng(7), **kw)
    ex = FusedExecution(NumpyGemm())
    narrow = MLP([features, hidden, 2], execution=ex, rng=np.random.default_rng(8), embedding=emb, init=init, **kw)
    wide = MLP([features, hidden, 2], execution=ex, rng=np.random.default_rng(9), init=init, **kw)
    s = np.sqrt(316 / (dim * features))  # sqrt(F' / (d F)) = 0.0927
    E = emb.tables[0].value  # (2000, 16)
    assert_allclose(E, np.random.default_rng(7).standard_normal((2000, dim)) * s, rtol=1e-15)
    assert abs(E.std() / s - 1) < 0.03  # 32,000 draws: the sample std's relative error is about 0.004
    start = E @ narrow.layers[0].weight.value[:, 300:].T  # (2000, H): each level's first pre-activation
    one_hot = wide.layers[0].weight.value[:, 300:]  # (H, 2000): each level's column of W_0
    # its error is mostly W_c's 2,048 draws (about 0.016 relative): 0.08 is 5 of those, a wrong rule misses by 4x
    assert abs(start.std() / one_hot.std() - 1) < 0.08, (start.std(), one_hot.std())
