"""``data.samples`` for MNIST-1D (issue #30: a draw large enough for five seeds to resolve half a point):
null, the default, is mnist1d's standard draw as before (4,000 training and 1,000 test samples);
another size is the same generator with its own seed, deterministic, cached by size; a size mnist1d
cannot draw is one ConfigError naming the value and what is expected, before anything is drawn."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from mlptrain.base.errors import ConfigError
from mlptrain.cli.main import compose_config
from mlptrain.config.schema import DataConfig
from mlptrain.data import load_dataset, sources
from mlptrain.data.dataset import Raw
from mlptrain.step.checks import validate

REPO = Path(__file__).resolve().parent.parent
# The standard draw as the loader gave it before data.samples applied to MNIST-1D (tree 55c0a0c):
# the labels' SHA-256 (train then test, int64) and a few features.
STANDARD_LABELS_SHA256 = "6feec4a017698c7fe237c8854cbd2e338c6dd5c16240f6fa79daefaaa129e169"
STANDARD_X_FIRST = [-0.33200567, -0.47191037, -0.77869708]  # x[0, :3]
STANDARD_X_TEST_LAST = [0.65987565, 0.87773435, 1.19315184]  # x_test[-1, -3:]


@pytest.fixture
def mnist1d() -> object:
    """mnist1d.data, with an empty loader cache before and after the test (each test draws for real)."""
    module = pytest.importorskip("mnist1d.data")
    sources._MNIST1D_CACHE.clear()
    yield module
    sources._MNIST1D_CACHE.clear()


def _raw(samples: int | None = None) -> Raw:
    return sources._load_mnist1d(DataConfig(name="mnist1d", samples=samples), np.random.default_rng(0))


def _direct(mnist1d: object, samples: int) -> dict:
    """mnist1d's own make_dataset at ``samples``, the global random state kept."""
    args = mnist1d.get_dataset_args()  # type: ignore[attr-defined]
    args.num_samples = samples
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        return mnist1d.make_dataset(args)  # type: ignore[attr-defined]
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


def _assert_same(raw: Raw, d: dict) -> None:
    for key in ("x", "y", "x_test", "y_test"):
        assert_array_equal(getattr(raw, key), d[key], err_msg=key)


def test_the_default_is_the_standard_draw_as_before(mnist1d: object) -> None:
    raw = _raw()
    assert (raw.x.shape, raw.x_test.shape) == ((4000, 40), (1000, 40))
    _assert_same(raw, mnist1d.make_dataset(mnist1d.get_dataset_args()))  # type: ignore[attr-defined]
    labels = np.concatenate([raw.y, raw.y_test]).astype(np.int64)
    assert hashlib.sha256(labels.tobytes()).hexdigest() == STANDARD_LABELS_SHA256
    assert_allclose(raw.x[0, :3], STANDARD_X_FIRST, rtol=1e-6)
    assert_allclose(raw.x_test[-1, -3:], STANDARD_X_TEST_LAST, rtol=1e-6)
    assert _raw(5000).x is raw.x  # the standard size said is the same draw, the same cache entry
    ds = load_dataset(DataConfig(name="mnist1d"))
    assert (len(ds.x_train), len(ds.x_val), len(ds.x_test)) == (3600, 400, 1000)


def test_a_larger_size_is_a_larger_draw_of_the_same_generator(mnist1d: object) -> None:
    raw = _raw(6000)
    assert (raw.x.shape, raw.x_test.shape) == ((4800, 40), (1200, 40))
    assert np.bincount(np.concatenate([raw.y, raw.y_test])).tolist() == [600] * 10  # samples/10 of each digit
    _assert_same(raw, _direct(mnist1d, 6000))
    ds = load_dataset(DataConfig(name="mnist1d", samples=6000))
    assert (len(ds.x_train), len(ds.x_val), len(ds.x_test)) == (4320, 480, 1200)


def test_each_size_is_cached_apart(mnist1d: object) -> None:
    small, other = _raw(1000), _raw(2000)
    assert (small.x.shape, other.x.shape) == ((800, 40), (1600, 40))
    again = _raw(1000)
    assert again.x is small.x and again.x_test is small.x_test  # from the cache, and the 1000-sample entry
    assert set(sources._MNIST1D_CACHE) == {1000, 2000}
    assert not small.x.flags.writeable


def test_a_size_is_drawn_the_same_on_every_call_and_leaves_the_global_random_state_alone(mnist1d: object) -> None:
    first = _raw(1000)
    sources._MNIST1D_CACHE.clear()
    np.random.seed(7)
    random.seed(8)
    before = (np.random.get_state()[1].copy(), random.getstate())
    second = _raw(1000)
    assert second.x is not first.x  # drawn again, not cached
    for key in ("x", "y", "x_test", "y_test"):
        assert_array_equal(getattr(second, key), getattr(first, key), err_msg=key)
    assert_array_equal(np.random.get_state()[1], before[0])
    assert random.getstate() == before[1]


@pytest.mark.parametrize("samples", [0, 5, -10, 15, 4999, True, 5000.0])
def test_a_size_mnist1d_cannot_draw_is_one_config_error(monkeypatch: pytest.MonkeyPatch, samples: object) -> None:
    """Refused before anything is drawn or imported: the same error without the mnist1d package."""
    monkeypatch.setitem(sys.modules, "mnist1d", None)
    monkeypatch.setitem(sys.modules, "mnist1d.data", None)
    message = f"data.samples={samples} cannot size MNIST-1D: expected a positive multiple of 10"
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")) as info:
        load_dataset(DataConfig(name="mnist1d", samples=samples))  # type: ignore[arg-type]
    assert "or null for its standard 5000" in str(info.value)


def test_the_config_checks_the_size_and_where_it_applies() -> None:
    cfg = compose_config(["data=mnist1d"])
    assert cfg.data.samples is None
    assert compose_config(["data=mnist1d", "data.samples=20000"]).data.samples == 20000
    with pytest.raises(ConfigError, match=r"data\.samples=15 cannot size MNIST-1D: expected a positive multiple"):
        compose_config(["data=mnist1d", "data.samples=15"])
    with pytest.raises(ConfigError, match=r"data\.samples=1 must be at least 2 or null"):
        compose_config(["data=synthetic", "data.samples=1"])
    with pytest.raises(
        ConfigError, match=r"data\.samples=20000 is not used with data=digits: it applies to data=synthetic and "
    ):
        compose_config(["data=digits", "data.samples=20000"])
    cfg.data.samples = 25
    with pytest.raises(ConfigError, match=r"data\.samples=25 cannot size MNIST-1D"):
        validate(cfg)


def test_synthetic_keeps_its_default_of_ten_thousand_samples() -> None:
    ds = load_dataset(DataConfig(name="synthetic"))
    assert len(ds.x_train) + len(ds.x_val) + len(ds.x_test) == 10000


def test_a_bad_size_on_the_command_line_is_one_line_and_no_run(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "HYDRA_MAIN_MODULE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    args = ["data=mnist1d", "data.samples=12345", "device=cpu", f"hydra.run.dir={tmp_path}/run"]
    proc = subprocess.run(
        [sys.executable, "-m", "mlptrain", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "data.samples=12345 cannot size MNIST-1D" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
