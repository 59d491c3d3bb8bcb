"""model.class_weight: the weighted cross-entropy and its gradient, balanced weights, the run, the errors."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_cfg
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.metrics import balanced_accuracy_score
from sklearn.utils.class_weight import compute_class_weight

from mlptrain.base.errors import ConfigError
from mlptrain.config.schema import DatasetName
from mlptrain.data import load_dataset
from mlptrain.inference.predictor import predict
from mlptrain.nn.losses import class_weights, softmax_cross_entropy
from mlptrain.run.run import train
from mlptrain.step.checks import validate


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "cache"))


def _batch(seed: int = 0, rows: int = 37, classes: int = 5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((rows, classes)) * 3.0
    y = rng.integers(0, classes, rows)
    w = rng.uniform(0.1, 4.0, classes).astype(np.float32)
    w[1] = 0.0  # a zero weight: its rows count for nothing
    return z, y, w


def _float64_reference(z: np.ndarray, y: np.ndarray, w: np.ndarray, scale: float) -> tuple[float, np.ndarray]:
    """The weighted mean and its gradient written out in float64, row by row."""
    rw = w.astype(np.float64)[y]  # (B,)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    loss = float((rw * (lse - z[np.arange(len(y)), y])).sum() / rw.sum())
    p = np.exp(z - lse[:, None])
    p[np.arange(len(y)), y] -= 1.0
    return loss, p * rw[:, None] / rw.sum() * scale


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("scale", [1.0, 256.0])
def test_weighted_loss_and_gradient_match_float64_and_torch(dtype: type, scale: float) -> None:
    z, y, w = _batch()
    loss, d, correct, db = softmax_cross_entropy(z.astype(dtype), y, scale, bias_grad=True, class_weight=w)
    ref_loss, ref_d = _float64_reference(z.astype(dtype).astype(np.float64), y, w, scale)
    tol = 1e-12 if dtype == np.float64 else 2e-6
    assert d.dtype == dtype
    assert_allclose(float(loss), ref_loss, rtol=tol)
    assert_allclose(d, ref_d, rtol=tol, atol=tol * scale)
    assert_allclose(db, ref_d.sum(0), rtol=tol, atol=10 * tol * scale)
    assert int(correct) == int((z.astype(dtype).argmax(1) == y).sum())
    t = torch.tensor(z.astype(dtype).astype(np.float64), requires_grad=True)
    tl = torch.nn.functional.cross_entropy(t, torch.tensor(y), weight=torch.tensor(w, dtype=torch.float64))
    (tl * scale).backward()
    assert_allclose(float(loss), tl.item(), rtol=tol)
    assert_allclose(d, t.grad.numpy(), rtol=tol, atol=tol * scale)


def test_weighted_loss_in_place_equals_the_copy() -> None:
    z, y, w = _batch(1)
    loss, d, _ = softmax_cross_entropy(z.copy(), y, class_weight=w)
    logits = z.copy()
    loss2, d2, _ = softmax_cross_entropy(logits, y, class_weight=w, inplace=True)
    assert d2 is logits
    assert_array_equal(d, d2)
    assert float(loss) == float(loss2)


def test_equal_weights_are_the_plain_mean_and_none_is_todays_path() -> None:
    z, y, _ = _batch(2)
    plain = softmax_cross_entropy(z, y, 4.0)
    assert_allclose(softmax_cross_entropy(z, y, 4.0, class_weight=np.full(5, 3.0, np.float32))[1], plain[1], rtol=1e-12)
    none = softmax_cross_entropy(z, y, 4.0, class_weight=None)
    assert float(none[0]) == float(plain[0])
    assert_array_equal(none[1], plain[1])  # bit for bit: the unweighted code path


def test_balanced_weights_are_scikit_learns() -> None:
    y = np.repeat([0, 1, 2, 3], [500, 30, 7, 1])
    ours = class_weights("balanced", y, 4)
    assert ours is not None and ours.dtype == np.float32
    assert_allclose(ours, compute_class_weight("balanced", classes=np.arange(4), y=y), rtol=1e-7)
    assert_array_equal(class_weights([1, 2.5, 0, 3], y, 4), np.float32([1, 2.5, 0, 3]))
    assert class_weights(None, y, 4) is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("balance", "model.class_weight='balance' must be null, balanced or a list of one weight per class"),
        ([1.0, -2.0], "model.class_weight=[1.0, -2.0]: -2.0 is not a weight; expected finite numbers >= 0"),
        ([1.0, float("inf")], "model.class_weight=[1.0, inf]: inf is not a weight; expected finite numbers >= 0"),
        ([1.0, "a"], "model.class_weight=[1.0, 'a']: 'a' is not a weight; expected finite numbers >= 0"),
        ([0.0, 0.0], "model.class_weight=[0.0, 0.0] needs at least one weight above 0"),
        ([], "model.class_weight=[] needs at least one weight above 0"),
    ],
)
def test_bad_class_weights_are_one_clear_error(spec: object, message: str) -> None:
    with pytest.raises(ConfigError, match="invalid configuration: " + re.escape(message)):
        validate(make_cfg(model__class_weight=spec))


def test_class_weight_needs_the_cross_entropy_loss() -> None:
    with pytest.raises(ConfigError, match="model.class_weight weights the cross_entropy loss; model.loss=mse takes"):
        validate(make_cfg(model__class_weight="balanced", model__loss="mse"))


def test_a_list_of_the_wrong_length_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.class_weight has 3 weights for 10 classes; give one per class"):
        train(make_cfg(model__class_weight=[1, 2, 3], epochs=1), tmp_path / "run")


def _imbalanced(path: Path, seed: int = 0) -> Path:
    """Two overlapping classes, 5% positives; a test split of the same draw."""
    rng = np.random.default_rng(seed)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = (rng.random(n) < 0.05).astype(np.int64)
        x = rng.standard_normal((n, 6)) + 1.2 * y[:, None] * np.array([1, 1, 0.5, 0, 0, 0])
        return x, y

    x, y = draw(3000)
    x_test, y_test = draw(3000)
    np.savez(path, x=x, y=y, x_test=x_test, y_test=y_test)
    return path


def test_balanced_class_weight_beats_the_unweighted_run_on_balanced_accuracy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = _imbalanced(tmp_path / "imb.npz")
    scores = {}
    for name, spec in (("plain", None), ("balanced", "balanced")):
        cfg = make_cfg(epochs=6, model__hidden=[16], model__class_weight=spec)
        cfg.data.name, cfg.data.path, cfg.data.batch_size = DatasetName.file, str(data), 64
        with caplog.at_level(logging.INFO, logger="mlptrain.run.run"):
            train(cfg, tmp_path / name)
        with np.load(data) as f:
            y_pred = predict(tmp_path / name / "checkpoints" / "last.npz", f["x_test"], device="cpu")
            scores[name] = balanced_accuracy_score(f["y_test"], y_pred)
    assert scores["balanced"] > scores["plain"] + 0.1, scores
    y_train = load_dataset(cfg.data).y_train  # the run's training split
    expected = compute_class_weight("balanced", classes=np.arange(2), y=y_train)
    record = json.loads((tmp_path / "balanced" / "run.json").read_text())
    assert_allclose(record["class_weight"], expected, rtol=1e-7)
    assert "class_weight" not in json.loads((tmp_path / "plain" / "run.json").read_text())
    firsts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mlptrain ")]
    assert len(firsts) == 2 and "class weights" not in firsts[0]
    assert firsts[1].endswith(f", class weights 0: {expected[0]:.4g}, 1: {expected[1]:.4g}"), firsts[1]


@pytest.mark.parametrize("with_class_weight", [False, True])
def test_row_weights_match_torch_and_a_zero_weighted_half_is_the_other_halfs_loss(with_class_weight: bool) -> None:
    z, y, w = _batch(4, rows=40)
    cw = w if with_class_weight else None
    rw = np.random.default_rng(5).uniform(0.0, 3.0, 40).astype(np.float32)
    loss, d, _ = softmax_cross_entropy(z, y, 8.0, class_weight=cw, row_weight=rw)
    t = torch.tensor(z, requires_grad=True)
    both = torch.tensor(rw, dtype=torch.float64) * (torch.tensor(w, dtype=torch.float64)[y] if cw is not None else 1.0)
    per_row = torch.nn.functional.cross_entropy(t, torch.tensor(y), reduction="none")
    tl = (per_row * both).sum() / both.sum()
    (tl * 8.0).backward()
    assert_allclose(float(loss), tl.item(), rtol=1e-12)
    assert_allclose(d, t.grad.numpy(), rtol=1e-12, atol=1e-15)
    half = np.r_[np.ones(20), np.zeros(20)].astype(np.float32)  # the second half weighs nothing
    loss, d, _ = softmax_cross_entropy(z, y, 8.0, class_weight=cw, row_weight=half)
    loss_a, d_a, _ = softmax_cross_entropy(z[:20], y[:20], 8.0, class_weight=cw)
    assert_allclose(float(loss), float(loss_a), rtol=1e-13)
    assert_allclose(d[:20], d_a, rtol=1e-13, atol=1e-16)
    assert_array_equal(d[20:], 0.0)
