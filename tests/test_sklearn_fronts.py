"""mlptrain.sklearn's fronts (issue #47): what ``save`` may replace, what ``load`` may set, ``partial_fit``'s
classes, the CLI's BLAS-thread policy, the estimator's own names in warm-start errors, the target column."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sklearn")

from sklearn.exceptions import ConvergenceWarning  # noqa: E402
from threadpoolctl import threadpool_info, threadpool_limits  # noqa: E402

from mlptrain.base.backend import Backend  # noqa: E402
from mlptrain.base.errors import CheckpointError, ConfigError  # noqa: E402
from mlptrain.inference.predictor import Predictor  # noqa: E402
from mlptrain.run import checkpoint  # noqa: E402
from mlptrain.sklearn import MLPClassifier, MLPRegressor  # noqa: E402
from mlptrain.step import build
from mlptrain.step.trainer import Trainer  # noqa: E402


def _blobs(n: int = 90, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    return rng.normal(size=(n, 4)) + y[:, None] * 3.0, np.array(["a", "b", "c"])[y]


def _fitted(**kw: Any) -> MLPClassifier:
    x, y = _blobs()
    return MLPClassifier(hidden_layer_sizes=(8,), max_iter=2, random_state=0, **kw).fit(x, y)


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@pytest.mark.parametrize("kind", ["csv", "npz", "text"])
def test_save_never_replaces_a_file_that_is_not_a_checkpoint(tmp_path: Path, kind: str) -> None:
    """Before: ``save("train.csv")`` replaced the training data with a checkpoint."""
    clf = _fitted()
    path = tmp_path / f"train.{kind}"
    if kind == "npz":
        np.savez(path, x=np.ones((3, 4)), y=np.arange(3))
    else:
        path.write_text("f0,f1,label\n1,2,a\n")
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=r"exists and is not an mlptrain checkpoint; save replaces only a che"):
        clf.save(path)
    assert path.read_bytes() == before
    link = tmp_path / "model.npz"
    link.symlink_to(path)  # through a link the data file is what would be replaced
    with pytest.raises(CheckpointError, match="is not an mlptrain checkpoint"):
        clf.save(link)
    assert path.read_bytes() == before


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_save_replaces_a_checkpoint_and_writes_a_new_or_empty_file(tmp_path: Path) -> None:
    first, second = _fitted(), _fitted(alpha=0.5)
    path = first.save(tmp_path / "model.npz")
    second.save(path)  # an earlier checkpoint is replaced (atomically: checkpoint.save)
    assert MLPClassifier.load(path).alpha == 0.5
    empty = tmp_path / "empty.npz"
    empty.touch()  # tempfile.NamedTemporaryFile's: it holds nothing
    assert MLPClassifier.load(second.save(empty)).alpha == 0.5


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_save_removes_the_temp_file_a_killed_save_left(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A save killed mid-write (SIGKILL, or SIGTERM with Python's default handler: the fault campaign's
    partial_fit scenario) leaves ``model.npz.<pid>.<hex>.tmp``; the next save to that path removes it, and
    keeps the temp file of a process that is still alive."""
    import os

    from mlptrain.base.fs import TEMP_SUFFIX

    path = tmp_path / "model.npz"
    dead = tmp_path / f"model.npz.4194000.0badf00d{TEMP_SUFFIX}"  # no process has that pid (beyond pid_max)
    alive = tmp_path / f"model.npz.{os.getpid()}.0123abcd{TEMP_SUFFIX}"
    for tmp in (dead, alive):
        tmp.write_bytes(b"half a checkpoint")
    _fitted().save(path)
    assert not dead.exists() and alive.exists() and MLPClassifier.load(path).n_iter_ > 0
    assert f"removed {dead}" in caplog.text


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_partial_fit_with_other_classes_is_scikit_learns_error() -> None:
    """Before: the classes of a later call were ignored without a word."""
    x, y = _blobs()
    clf = MLPClassifier(hidden_layer_sizes=(8,), random_state=0).partial_fit(x, y, classes=["a", "b", "c"])
    same = r"^`classes=\['a', 'b', 'd'\]` is not the same as on last call to partial_fit, was: array\(\['a', 'b', 'c'\]"
    with pytest.raises(ValueError, match=same):
        clf.partial_fit(x, y, classes=["a", "b", "d"])
    assert clf.n_iter_ == 1
    clf.partial_fit(x, y, classes=["c", "b", "a", "a"])  # the same classes, in any order
    clf.partial_fit(x, y)
    assert clf.n_iter_ == 3 and clf.classes_.tolist() == ["a", "b", "c"]


def _craft(path: Path, change: Any) -> Path:
    """The checkpoint at ``path`` with ``change(meta)`` applied and its SHA-256 made right again."""
    ckpt = checkpoint.load(path)
    meta = {k: v for k, v in ckpt.meta.items() if k not in ("sha256", "format", "format_version", "mlptrain")}
    change(meta)
    out = path.with_name("crafted.npz")
    checkpoint.save(out, ckpt.arrays, meta)
    return out


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.update(predict="x"), r"config.sklearn has 'predict', which is not a fitted attribute of MLPC"),
        (lambda s: s.update(__class__="x"), r"config.sklearn has '__class__', which is not a fitted attribute"),
        (lambda s: s["params"].update(state_=1), r"config.sklearn.params has 'state_', which is not a parameter of M"),
        (lambda s: s.update(params=[1]), r"config.sklearn.params is list; expected an object"),
    ],
)
def test_load_sets_only_the_estimators_parameters_and_fitted_attributes(
    tmp_path: Path, change: Any, message: str
) -> None:
    """Before: every key of the checkpoint's ``config.sklearn`` became an attribute (``predict`` included)."""
    path = _fitted().save(tmp_path / "model.npz")
    crafted = _craft(path, lambda meta: change(meta["config"]["sklearn"]))
    with pytest.raises(CheckpointError, match=message):
        MLPClassifier.load(crafted)
    assert MLPClassifier.load(path).n_iter_ == 2


def _blas() -> set[int]:
    return {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_fit_partial_fit_and_predict_take_the_clis_blas_thread_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A digits-sized fit steps on one BLAS thread, as the CLI's run does; before, on the library's default
    (11.6 s against 0.57 s on a busy 2-core machine)."""
    seen: list[set[int]] = []
    step = Trainer.step
    monkeypatch.setattr(Trainer, "step", lambda self, x, y: (seen.append(_blas()), step(self, x, y))[1])
    entered: list[float] = []
    policy = Backend.blas_threads

    def recorded(self: Backend, flops: float) -> Any:
        entered.append(flops)
        return policy(self, flops)

    monkeypatch.setattr(Backend, "blas_threads", recorded)
    logits = Predictor.logits
    monkeypatch.setattr(Predictor, "logits", lambda self, x: (seen.append(_blas()), logits(self, x))[1])
    x, y = _blobs()
    with threadpool_limits(limits=2, user_api="blas"):
        clf = MLPClassifier(hidden_layer_sizes=(8,), batch_size=30, max_iter=2, random_state=0).fit(x, y)
        clf.partial_fit(x, y)
        clf.predict(x[:7])
        after = _blas()
    assert len(seen) == 2 * 3 + 3 + 1 and all(t == {1} for t in seen), seen
    assert after == {2}
    train_step = build.step_flops([4, 8, 3], 30)  # 6 * 30 * (4*8 + 8*3)
    assert entered == [train_step, train_step, 2 * 7 * (4 * 8 + 8 * 3)]


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_layer_sizes": (9,)}, r"continues a fit made with hidden_layer_sizes=\(8,\), but hidden_layer_s"),
        ({"solver": "sgd"}, r"continues a fit made with solver='adam', but solver='sgd' now; set solver back, or "),
        ({"precision": "bf16"}, r"continues a fit made with precision='fp32', but precision='bf16' now"),
    ],
)
def test_a_continued_fit_names_the_estimators_parameters(change: dict[str, Any], message: str) -> None:
    """Before: ``model.hidden=[9]`` and ``optimizer=sgd``, the CLI's words, came back from the estimator."""
    x, y = _blobs()
    clf = _fitted(warm_start=True).set_params(**change)
    for call, how in ((lambda: clf.fit(x, y), "warm_start=True"), (lambda: clf.partial_fit(x, y), "partial_fit")):
        with pytest.raises(ConfigError, match=f"^MLPClassifier {how} " + message) as info:
            call()
        assert "model.hidden" not in str(info.value) and "optimizer=" not in str(info.value)
    assert clf.n_iter_ == 2


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_a_continued_sgd_fit_names_momentum() -> None:
    x, y = _blobs()
    clf = _fitted(solver="sgd", momentum=0.0, warm_start=True).set_params(momentum=0.9)
    with pytest.raises(ConfigError, match=r"^MLPClassifier partial_fit continues a fit made with momentum=0, but mom"):
        clf.partial_fit(x, y)


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_the_checkpoint_records_the_target_column_it_was_fitted_with(tmp_path: Path) -> None:
    """Before: ``config.data.target`` was always ``label``, so evaluate looked for a column the file lacked."""
    pd = pytest.importorskip("pandas")
    x, y = _blobs()
    frame = pd.DataFrame(x, columns=["f0", "f1", "f2", "f3"])
    clf = MLPClassifier(hidden_layer_sizes=(8,), max_iter=2, random_state=0).fit(frame, pd.Series(y, name="animal"))
    meta = checkpoint.load(clf.save(tmp_path / "clf.npz")).meta
    assert meta["config"]["data"]["target"] == "animal"
    assert Predictor(checkpoint.load(tmp_path / "clf.npz")).target_columns == ["animal"]
    unnamed = MLPClassifier(hidden_layer_sizes=(8,), max_iter=2, random_state=0).fit(x, y)
    assert unnamed.state_.meta["config"]["data"]["target"] == "label"
    targets = pd.DataFrame({"price": x[:, 0], "size": x[:, 1]})
    reg = MLPRegressor(hidden_layer_sizes=(8,), max_iter=2, random_state=0).fit(x[:, 2:], targets)
    meta = checkpoint.load(reg.save(tmp_path / "reg.npz")).meta
    assert meta["config"]["data"]["target"] == ["price", "size"] and meta["data"]["target_names"] == ["price", "size"]
    one = MLPRegressor(hidden_layer_sizes=(8,), max_iter=2, random_state=0).fit(x[:, 2:], pd.Series(x[:, 0], name="p"))
    assert one.state_.meta["config"]["data"]["target"] == "p" and one.state_.meta["data"]["target_names"] == ["p"]
    plain = MLPRegressor(hidden_layer_sizes=(8,), max_iter=2, random_state=0).fit(x[:, 2:], x[:, :2])
    assert plain.state_.meta["data"]["target_names"] == ["y0", "y1"]
    assert json.loads(json.dumps(plain.state_.meta["config"]["data"]["target"])) == ["y0", "y1"]


def test_an_ensemble_that_cannot_fit_in_memory_is_refused_before_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """ensemble_size=10**9 filled the host's memory building the members (the OOM killer ended the process): the
    members' bytes are counted first (here against 1 MiB said available) and a size that cannot fit is one error."""
    from mlptrain.base.errors import ResourceError
    from mlptrain.step import memory

    monkeypatch.setattr(memory, "host_memory_available", lambda: 2**20)
    x, y = _blobs()
    kw = {"hidden_layer_sizes": (64,), "max_iter": 1, "random_state": 0, "device": "cpu"}
    with pytest.raises(
        ResourceError,
        match=r"MLPClassifier\(ensemble_size=200\): 200 members of at least .* MiB each "
        r"need .* GiB, and the host has 0.000977 GiB available; lower it",
    ):
        MLPClassifier(ensemble_size=200, **kw).fit(x, y)
    assert isinstance(ResourceError("x"), MemoryError)
    assert MLPRegressor(ensemble_size=2, **kw).fit(x, np.arange(90.0)).coefs_[0].shape == (2, 4, 64)  # 2 fit


@pytest.mark.parametrize("members", [1, 3])
def test_a_cli_checkpoint_loads_with_its_ensemble_size_and_continues(tmp_path: Path, members: int) -> None:
    """``python -m mlptrain ensemble.size=3``'s checkpoint holds 3 members: the estimator loaded from it says
    ``ensemble_size=3`` (it said 1, and a warm-started fit then refused its own state); a CLI checkpoint continues
    with ``warm_start`` (its missing ``t_`` was an AttributeError), one model or an ensemble."""
    from sklearn.datasets import load_digits

    import mlptrain
    from tests.helpers import make_cfg

    mlptrain.train(make_cfg(ensemble__size=members, epochs=1, model__hidden=[8]), tmp_path / "run")
    loaded = MLPClassifier.load(tmp_path / "run" / "checkpoints" / "last.npz")
    shape = (64, 8) if members == 1 else (members, 64, 8)
    assert loaded.get_params()["ensemble_size"] == members and loaded.coefs_[0].shape == shape
    x, y = load_digits(return_X_y=True)
    loaded.set_params(warm_start=True, max_iter=1, device="cpu")
    with pytest.warns(ConvergenceWarning), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "X does not have valid feature names")  # the CLI's checkpoint names them
        assert loaded.fit(x, y.astype(str)).n_iter_ == 2 and loaded.coefs_[0].shape == shape  # the members go on


def test_an_ensembles_member_k_is_the_seed_k_run_on_the_split_of_random_state() -> None:
    """docs/sklearn.md, ``ensemble_size``: member k draws its weights and batches from ``random_state + k`` over the
    one split and normalisation of ``random_state`` (the CLI's ``seed=random_state+k data.split_seed=random_state``),
    bit for bit; ``MLPClassifier(random_state=random_state + k)`` splits and orders its rows by its own seed."""
    from mlptrain.run.interval import Interval
    from mlptrain.sklearn.fitting import run_epoch

    x, y = _blobs()
    kw = {"hidden_layer_sizes": (8,), "max_iter": 3, "batch_size": 16, "n_iter_no_change": 100, "device": "cpu"}
    with pytest.warns(ConvergenceWarning):
        ens = MLPClassifier(ensemble_size=3, random_state=4, **kw).fit(x, y)
    for k in (1, 2):
        setup = MLPClassifier(random_state=4, **kw).fit_setup(x, y)
        setup.cfg.seed = 4 + k  # the run of seed 4 + k on random_state=4's split
        tr = Trainer(setup.cfg, setup.dataset)
        interval = Interval(tr, setup.cfg.log_every)
        with tr.stream:
            for epoch in range(3):
                run_epoch(tr, interval, epoch)
        for name, a in tr.state_dict()[0].items():
            if name.startswith("param/"):
                np.testing.assert_array_equal(ens.state_.arrays[name][k], a, err_msg=f"member {k} {name}")
    with pytest.warns(ConvergenceWarning):
        alone = MLPClassifier(random_state=5, **kw).fit(x, y)  # its own split: other rows in each batch
    assert not np.array_equal(ens.coefs_[0][1], alone.coefs_[0])
