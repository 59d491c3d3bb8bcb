"""Issue #47, the data's values and the data path: scaling whatever the spread, a streamed file that changes,
complex features, the task a regression loss asks for, and the messages of the readers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg
from numpy.testing import assert_allclose, assert_array_equal
from sklearn.preprocessing import StandardScaler

from mlptrain.base.errors import DatasetError
from mlptrain.cli.evaluate import EvaluateArgs, evaluate
from mlptrain.config.keys import suggest
from mlptrain.config.schema import DatasetName, Task
from mlptrain.data import Dataset, load_dataset
from mlptrain.data.files import chunks
from mlptrain.data.files.readers import read_table, write_csv
from mlptrain.data.prepare import normalization, target_scaling
from mlptrain.data.rows import NormalisedRows
from mlptrain.inference.predictor import Predictor
from mlptrain.run import checkpoint, faults
from mlptrain.run.run import train
from mlptrain.sklearn import MLPClassifier, MLPRegressor
from mlptrain.step.trainer import Trainer

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


# ------------------------------------------------------------------ 2. a streamed file that changes under a run

REPO = Path(__file__).resolve().parents[1]


def _stream_npz(path: Path, n: int = 2000, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = (rng.normal(size=(n, 9)) + y[:, None] * 0.7).astype(np.float32)
    np.savez(path, x=x, y=y)  # uncompressed: its x is memory-mapped where it lies, and streamed from there
    return path


def _stream_cfg(path: Path, **overrides: Any) -> Any:
    return make_cfg(
        data__name=DatasetName.file, data__path=str(path), data__residency="stream", data__batch_size=64, **overrides
    )


def test_a_streamed_file_rewritten_during_the_run_stops_it_with_last_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _stream_npz(tmp_path / "table.npz")
    check, starts = faults.stop_if_data_changed, []

    def rewrite_then_check(loop: Any, pos: Any) -> None:
        starts.append(pos.step)
        if len(starts) == 2:  # the second epoch's start: another table of the same size, written in place
            _stream_npz(path, seed=1)
        check(loop, pos)

    monkeypatch.setattr(faults, "stop_if_data_changed", rewrite_then_check)
    with pytest.raises(DatasetError) as info:
        train(_stream_cfg(path, epochs=3), tmp_path / "run")
    msg = str(info.value)
    assert f"data file {path} changed while the run streamed it (data.residency=stream): it was modified" in msg
    assert f"the last checkpoint, {tmp_path / 'run' / 'checkpoints' / 'last.npz'} (step {starts[1]}), is saved" in msg
    assert "\n" not in msg and starts[1] > 0
    assert checkpoint.load(tmp_path / "run" / "checkpoints" / "last.npz").meta["position"]["step"] == starts[1]


def test_a_file_truncated_under_a_streamed_split_is_an_error_not_a_sigbus(tmp_path: Path) -> None:
    path = _stream_npz(tmp_path / "table.npz")
    ds = load_dataset(_stream_cfg(path).data)
    rows = ds.x_train
    assert isinstance(rows, NormalisedRows) and rows.source is not None
    idx = np.arange(len(rows))[::-1].copy()
    whole = rows.take(idx, np.empty((len(idx), 9), np.float32))
    os.truncate(path, 4096)  # a memory map's read past the end: SIGBUS
    with pytest.raises(DatasetError, match=rf"data file {path} changed while the run streamed it .*: it is 4096 bytes"):
        rows.take(idx, np.empty_like(whole))
    rows.source.identity = rows.source._identity(os.stat(path))  # truncated between the check and the read
    with pytest.raises(DatasetError, match=r"a read at byte \d+ found the end of the file .*: the file was truncated"):
        rows.take(idx, np.empty_like(whole))


_TRUNCATE_LATER = """
import os, sys
from mlptrain.run import faults
from mlptrain.data import rows
path, check, read, state = sys.argv[1], faults.stop_if_data_changed, rows.StreamSource.read, {"starts": 0, "reads": 0}
race = "--race" in sys.argv
def arm(loop, pos):
    state["starts"] += 1
    check(loop, pos)
def truncate_then_read(self, at, out):
    state["reads"] += state["starts"] >= 2
    if state["reads"] == 5:  # the fifth batch of the second epoch
        os.truncate(path, 4096)
        if race:  # as if between the size check and the read
            self.identity = self._identity(os.stat(path))
    return read(self, at, out)
faults.stop_if_data_changed, rows.StreamSource.read = arm, truncate_then_read
sys.argv = ["mlptrain", *[a for a in sys.argv[2:] if a != "--race"]]
from mlptrain.cli.main import main
main()
"""


@pytest.mark.parametrize("race", [False, True])
def test_a_run_whose_streamed_file_is_truncated_says_so_and_keeps_last(tmp_path: Path, race: bool) -> None:
    path = _stream_npz(tmp_path / "table.npz")
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLPTRAIN_DATA": str(tmp_path / "cache")}
    args = ["data=file", f"data.path={path}", "data.residency=stream", "device=cpu", "model.hidden=[16]"]
    args += ["epochs=3", "progress=false", f"hydra.run.dir={run}"] + (["--race"] if race else [])
    command = [sys.executable, "-c", _TRUNCATE_LATER, str(path), *args]
    got = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert got.returncode > 0, f"killed by signal {-got.returncode}: {got.stderr[-2000:]}"  # SIGBUS: -7
    errors = [line for line in got.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and f"data file {path} changed while the run streamed it" in errors[0], got.stderr
    assert ("found the end of the file" if race else "it is 4096 bytes") in errors[0]
    assert "Traceback" not in got.stderr
    assert (run / "checkpoints" / "last.npz").is_file()  # the first epoch's


# ------------------------------------------------------------------ 3. complex features


def test_complex_features_are_refused_not_cast_to_real(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 3)) + 0.5j, np.arange(60) % 2
    np.savez(tmp_path / "c.npz", x=x, y=y)
    np.savez(tmp_path / "cy.npz", x=x.real, y=y + 1j)
    one = "holds complex numbers (complex128); Complex data not supported: expected real numbers"
    for name, what in (("c.npz", "x"), ("cy.npz", "y")):
        cfg = make_cfg(data__name=DatasetName.file, data__path=str(tmp_path / name)).data
        with pytest.raises(DatasetError) as info:
            load_dataset(cfg)
        assert str(info.value).startswith(f"data file {tmp_path / name}: {what} {one}")
    with pytest.raises(DatasetError, match=re.escape(f"dataset 'd' split train: x {one}")):
        Dataset("d", x, y, x[:5], y[:5], x[:5], y[:5], 2)
    for est in (MLPClassifier(max_iter=2), MLPRegressor(max_iter=2)):
        with pytest.raises(
            ValueError, match="^" + re.escape(f"X {one}")
        ) as caught:  # a ConfigError: sklearn's checks want ValueError
            est.fit(x, y)
        assert "\n" not in str(caught.value)
    fitted = MLPClassifier(max_iter=2, random_state=0).fit(x.real, y)
    with pytest.raises(ValueError, match="^" + re.escape(f"X {one}")):
        fitted.predict(x)


# ------------------------------------------------------------------ 4. a regression loss makes the task a regression


def _whole_numbers(path: Path, n: int, seed: int, target: Any = None) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3))
    y = np.round(200 + 60 * x[:, 0] - 30 * x[:, 1]) if target is None else target(n)  # whole numbers, ~200 values
    write_csv(path, x, y, ["a", "b", "c"], target="price")


def test_a_whole_number_target_with_mse_is_a_regression(tmp_path: Path) -> None:
    _whole_numbers(tmp_path / "train.csv", 400, 0)
    _whole_numbers(tmp_path / "test.csv", 100, 1)  # values the training file lacks: were "not among the labels"
    cfg = make_cfg(
        data__name=DatasetName.file,
        data__path=str(tmp_path / "train.csv"),
        data__test_path=str(tmp_path / "test.csv"),
        data__target="price",
        model__loss="mse",
        epochs=5,
    )
    summary = train(cfg, tmp_path / "run")
    y_test = np.loadtxt(tmp_path / "test.csv", delimiter=",", skiprows=1, usecols=3)
    assert "test/acc" not in summary and summary["test/loss"] < 0.5 * np.var(y_test)  # it learnt the numbers
    p = Predictor(tmp_path / "run", device="cpu")
    assert p.task == "regression" and p.widths[-1] == 1  # was a 194-class classifier ("test acc 0.0000")
    scored, _ = evaluate(EvaluateArgs(ckpt=str(tmp_path / "run"), split="test", device="cpu"))
    assert scored["loss"] == pytest.approx(summary["best/test/loss"], rel=1e-5)
    cfg.model.loss, cfg.data.test_path = "cross_entropy", None  # a classification loss with data.task=auto:
    with pytest.raises(DatasetError, match="198 distinct whole numbers in 400 rows"):  # ambiguous (#49): refused
        Trainer(cfg)
    cfg.data.task = Task.classification  # said outright: its whole numbers are classes
    assert Trainer(cfg).dataset.task == "classification"


def test_text_targets_with_a_regression_loss_are_refused_naming_the_way_to_one_hot_classes(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("a,b,label\n" + "".join(f"{i},{i % 3},{'xyz'[i % 3]}\n" for i in range(30)))
    cfg = make_cfg(data__name=DatasetName.file, data__path=str(tmp_path / "t.csv"), model__loss="mse")
    with pytest.raises(DatasetError, match=r"target \['x'\] is not a number; .*set data.task=classification\)$"):
        train(cfg, tmp_path / "run")
    cfg.data.task = Task.classification  # mse on one-hot classes, as asked
    assert Trainer(cfg).dataset.num_classes == 3


# ------------------------------------------------------------------ 5-8. what the messages say, and where


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLPTRAIN_DATA": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "mlptrain", "device=cpu", "progress=false", *args]
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_the_warning_of_dropped_rows_is_in_the_runs_log(tmp_path: Path) -> None:
    lines = ["a,b,label"] + [f"{i % 7},{i % 5},{'' if i % 17 == 0 else i % 2}" for i in range(120)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    args = ["data=file", f"data.path={tmp_path / 't.csv'}", "data.missing=drop", "epochs=1", f"hydra.run.dir={run}"]
    got = _cli(tmp_path, *args)
    assert got.returncode == 0, got.stderr
    said = f"data file {tmp_path / 't.csv'}: 8 of 120 rows dropped, lines 2, 19, 36, 53, 70 and 3 more: no target"
    assert said in got.stderr  # on the terminal, as before
    log_lines = (run / "mlptrain.log").read_text().splitlines()
    assert [line for line in log_lines if said in line and "[WARNING]" in line]  # was missing: logged before the file
    assert said in log_lines[0]  # in the order it was said: before the run's first line


@pytest.mark.parametrize("reader", ["numpy", "arrow"])
def test_a_line_of_spaces_is_refused_by_its_line_number(tmp_path: Path, reader: str) -> None:
    path = tmp_path / "sp.csv"
    path.write_text("a,b,label\n1,2,0\n3,4,1\n   \n5,6,0\n\n7,8,1\n")  # line 4: spaces; line 6: empty (skipped)
    with pytest.raises(DatasetError) as info:
        read_table(path, "label", reader=reader)  # Arrow: "CSV parse error: Expected 3 columns, got 1", no line
    assert str(info.value) == (
        f"data file {path} line 4 holds only whitespace ('   '); remove the line, or give it a value for each of the "
        "3 columns"
    )
    path.write_text("a,b,label\n1,2,0\n3,4,1\n\n5,6,0\n")  # an empty line is skipped, as it was
    table, _ = read_table(path, "label", reader=reader)
    assert_array_equal(table.x, [[1, 2], [3, 4], [5, 6]])


def test_a_target_beyond_float32s_range_is_named_as_such(tmp_path: Path) -> None:
    path = tmp_path / "big.csv"
    path.write_text("a,b,price\n1,2,3.5\n3,4,1e39\n5,6,2.5\n7,8,-1.5\n")
    cfg = make_cfg(data__name=DatasetName.file, data__path=str(path), data__target="price", model__loss="mse").data
    with pytest.raises(DatasetError) as info:
        load_dataset(cfg)  # was "inf is not a finite number; targets must be finite"
    assert str(info.value) == (
        f"data file {path} line 3, column 'price': 1e+39 is beyond float32's range (+-3.4e+38), in which targets are "
        "scaled and trained; rescale the column"
    )


@pytest.mark.parametrize(
    ("value", "want"),
    [("none", "did you mean data.normalize?"), ("minmax", "did you mean data.normalize=minmax?")],
)
def test_the_normalise_typo_gets_a_suggestion_that_reads_cleanly(tmp_path: Path, value: str, want: str) -> None:
    got = _cli(tmp_path, f"data.normalise={value}", f"hydra.run.dir={tmp_path / 'run'}")
    assert got.returncode == 2
    assert got.stderr.strip().splitlines()[-1] == f"error: data.normalise is not a setting; {want}"
    assert suggest("data.normalise", value) == f"; {want}"  # was "'data.normalize='"'"'none'"'"''" for none
