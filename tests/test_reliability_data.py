"""Issue #47, the data's values and the data path: scaling whatever the spread, a streamed file that changes,
complex features, the task a regression loss asks for, and the messages of the readers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.preprocessing import StandardScaler

from mlptrain.data import chunks
from mlptrain.data.prepare import normalization, target_scaling
from mlptrain.data.rows import NormalisedRows
from mlptrain.sklearn import MLPClassifier, MLPRegressor

pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "cache"))


def _two_moons(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two interleaved half circles (a boundary a linear model cannot draw), 2 features of spread ~1."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    t = rng.uniform(0, np.pi, n)
    x = np.stack([np.cos(t) + y, np.sin(t) * (1 - 2 * y) + 0.5 * y], axis=1) + 0.1 * rng.standard_normal((n, 2))
    return x, y


def _spreads(n: int = 500) -> np.ndarray:
    """``(n, 7)`` columns of spreads 1e-7, 1, 1e7, an offset of 1e8, a spread 1000x under the others and two
    constant columns (0.1 does not survive a mean of sums: the mean is not exactly 0.1)."""
    rng = np.random.default_rng(3)
    z = rng.standard_normal((n, 5))
    x = np.column_stack([z[:, 0] * 1e-7, z[:, 1], z[:, 2] * 1e7 + 5.0, z[:, 3] + 1e8, z[:, 4] * 1e-3])
    return np.column_stack([x, np.full(n, 0.1), np.full(n, -3e5)])


def test_tiny_spread_features_train_like_the_unscaled_ones() -> None:
    x, y = _two_moons(600, 0)
    xt, yt = _two_moons(400, 1)
    kw = dict(hidden_layer_sizes=(32,), max_iter=40, random_state=0, learning_rate_init=0.01)
    plain = MLPClassifier(**kw).fit(x, y).score(xt, yt)
    tiny = MLPClassifier(**kw).fit(x * 1e-7, y).score(xt * 1e-7, yt)  # was 0.5: only centred, never scaled
    assert plain > 0.9
    assert abs(tiny - plain) <= 0.01


def test_a_regressor_of_tiny_targets_fits_like_the_unscaled_one() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((500, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.standard_normal(500)
    kw = dict(hidden_layer_sizes=(16,), max_iter=30, random_state=0, learning_rate_init=0.01, tol=0.0)
    plain = MLPRegressor(**kw).fit(x, y).score(x, y)
    tiny = MLPRegressor(**kw).fit(x, y * 1e-7).score(x, y * 1e-7)  # R² was -3e11: the targets only centred
    assert plain > 0.9
    assert abs(tiny - plain) < 0.01
    ts = target_scaling("standard", (y * 1e-7).astype(np.float32)[:, None])
    assert_allclose(ts.scale, [np.std((y * 1e-7).astype(np.float32).astype(np.float64))], rtol=1e-12)


def test_standardisation_is_sklearns_standard_scaler_whatever_the_spread() -> None:
    x = _spreads()
    train = np.arange(400)
    norm = normalization("standard", x, train)
    want = StandardScaler().fit(x[train]).transform(x).astype(np.float32)  # (n, 7)
    got = norm.apply(x)
    assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert_array_equal(got[:, 5:], 0.0)  # the constant columns: exactly 0, never noise over a tiny spread
    assert_array_equal(chunks.gather_normalised(x, None, norm.shift, norm.scale, chunk=64), got)
    for dtype in (np.float32, np.float16):
        out = np.empty((len(x), x.shape[1]), dtype)
        NormalisedRows(x, None, norm.shift, norm.scale, dtype).take(np.arange(len(x)), out)
        assert_array_equal(out, got.astype(dtype))  # streamed rows: the made split's bits


@pytest.mark.parametrize("method", ["standard", "minmax"])
def test_an_offset_of_1e8_normalises_as_offset_0(method: str) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1000, 4)) * np.array([1.0, 0.01, 3.0, 0.1])
    a = normalization(method, x).apply(x)
    b = normalization(method, x + 1e8).apply(x + 1e8)  # was float32-rounded first: steps of 8 around 1e8
    assert_allclose(b, a, atol=1e-5)  # x + 1e8 in float64 keeps steps of 1.5e-8: 1.5e-6 of the 0.01 spread
    norm = normalization(method, x + 1e8)
    made = chunks.gather_normalised(x + 1e8, np.arange(0, 1000, 3), norm.shift, norm.scale)
    assert_array_equal(made, b[::3])
