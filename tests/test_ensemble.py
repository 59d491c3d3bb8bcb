"""ensemble.size=K: K members trained as one batched step, each the single run of its seed (docs/ensembles.md)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlptrain.base.errors import CheckpointError, ConfigError
from mlptrain.config.schema import Device, Mode, TrainConfig
from mlptrain.data import Dataset
from mlptrain.inference.predictor import Predictor, softmax
from mlptrain.nn.batched import BatchedNumpyGemm
from mlptrain.nn.epilogs import Epilog, matmul, relu_aux_shape
from mlptrain.run import checkpoint
from mlptrain.run.ensemble import EnsembleTrainer
from mlptrain.run.run import train
from mlptrain.step.trainer import Trainer

K = 3


def make_cfg(seed: int = 5, size: int = 1, mode: str = "fused", precision: str = "fp32", **kw) -> TrainConfig:
    cfg = TrainConfig()
    cfg.device, cfg.progress, cfg.seed, cfg.epochs = Device.cpu, False, seed, 1
    cfg.execution.mode = Mode(mode)
    cfg.precision.name = precision
    cfg.model.hidden = [32, 16]
    cfg.data.batch_size = 64
    cfg.ensemble.size = size
    for key, value in kw.items():
        setattr(cfg, key, value)
    return cfg


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
@pytest.mark.parametrize("mode", ["fused", "naive"])
def test_member_k_is_the_single_run_of_seed_plus_k_bit_for_bit(mode: str, precision: str) -> None:
    ens = EnsembleTrainer(make_cfg(size=K, mode=mode, precision=precision))
    singles = [Trainer(make_cfg(seed=5 + k, mode=mode, precision=precision)) for k in range(K)]
    for k, single in enumerate(singles):  # the same initial weights, drawn as the single run draws them
        for name, a in single.model.state_dict().items():
            np.testing.assert_array_equal(ens.model.member_state(k)[name], a)
    together = np.array([np.array(ens.step(x, y)[0]) for x, y in ens.train_batches(0)])  # (steps, K)
    for k, single in enumerate(singles):
        alone = np.array([single.step(x, y)[0] for x, y in single.train_batches(0)])
        np.testing.assert_array_equal(together[:, k], alone)  # every step's loss, bit for bit
        assert len(set(together[:, k])) == len(alone)  # (the losses move: the members train)
    scores = ens.evaluate("val")
    for k, single in enumerate(singles):
        alone = single.evaluate("val")
        assert scores[f"member{k}/val/loss"] == alone["val/loss"]
        assert scores[f"member{k}/val/acc"] == alone["val/acc"]
    assert not np.array_equal(together[:, 0], together[:, 1])  # the members differ


@pytest.mark.parametrize("epilog", [Epilog.RELU_AUX_BIAS, Epilog.BGRADB, None])
def test_the_batched_contract_is_each_members_gemm_with_nvmaths_batched_shapes(epilog: Epilog | None) -> None:
    rng = np.random.default_rng(1)
    m, kd, n = 20, 7, 12
    a = rng.standard_normal((K, m, kd)).astype(np.float32)
    b = rng.standard_normal((K, kd, n)).astype(np.float32)
    bias = rng.standard_normal((K, m, 1)).astype(np.float32)
    inputs = {"bias": bias} if epilog is Epilog.RELU_AUX_BIAS else {}
    d, aux = BatchedNumpyGemm()("site", a, b, epilog, **inputs)
    assert d.shape == (K, m, n)
    for k in range(K):
        one = matmul(a[k], b[k], epilog=epilog, epilog_inputs={n_: v[k] for n_, v in inputs.items()})
        d_k, aux_k = one if isinstance(one, tuple) else (one, {})
        np.testing.assert_array_equal(d[k], d_k)
        assert d[k].flags.f_contiguous == d_k.flags.f_contiguous  # the layout the single GEMM gives
        if epilog is Epilog.RELU_AUX_BIAS:
            assert aux["relu_aux"].shape == (K, *relu_aux_shape(m, n))
            np.testing.assert_array_equal(aux["relu_aux"][k], aux_k["relu_aux"])
        if epilog is Epilog.BGRADB:
            assert aux["bgradb"].shape == (K, n, 1)  # nvmath's batched bias gradient (batch, L, 1)
            np.testing.assert_array_equal(aux["bgradb"][k, :, 0], aux_k["bgradb"])


def test_the_refused_combinations_are_named() -> None:
    with pytest.raises(ConfigError, match="precision.compute_copy=cast"):
        cfg = make_cfg(size=2)
        cfg.precision.compute_copy = type(cfg.precision.compute_copy)("cast")
        EnsembleTrainer(cfg)
    with pytest.raises(ConfigError, match=r"ensemble.size=0 must be a positive integer"):
        EnsembleTrainer(make_cfg(size=0))


@pytest.fixture(scope="module")
def ensemble_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ensemble") / "run"
    train(make_cfg(size=K, epochs=2), out)
    return out


def test_metrics_hold_each_members_scores_and_the_ensembles(ensemble_run: Path) -> None:
    records = [json.loads(line) for line in (ensemble_run / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert len(epochs) == 2
    last = epochs[-1]
    for k in range(K):
        for key in ("train/loss", "train/acc", "val/acc", "val/loss", "test/acc"):
            assert f"member{k}/{key}" in last
    members = [last[f"member{k}/val/loss"] for k in range(K)]
    assert len(set(members)) == K
    # the ensemble's log loss is that of the mean probability: at most the members' mean log loss (Jensen)
    assert last["val/loss"] <= np.mean(members) + 1e-9


def test_a_checkpoint_holds_every_member_and_one_model_refuses_it(ensemble_run: Path) -> None:
    ckpt = checkpoint.load(ensemble_run / "checkpoints" / "last.npz")
    assert ckpt.meta["members"] == K
    assert ckpt.arrays["param/layer0.weight"].shape == (K, 32, 64)
    assert ckpt.arrays["param/layer0.bias"].shape == (K, 32)
    single = Trainer(make_cfg(seed=0))
    with pytest.raises(CheckpointError, match=r"ensemble of 3 member\(s\) but this run builds 1.*ensemble.size=3"):
        single.load_state_dict(ckpt.arrays, ckpt.meta, step=0, where="last.npz")
    ens = EnsembleTrainer(make_cfg(seed=0, size=K))
    ens.load_state_dict(ckpt.arrays, ckpt.meta, step=ckpt.position.step, where="last.npz")
    for name, a in ens.model.state_dict().items():
        np.testing.assert_array_equal(a, ckpt.arrays[f"param/{name}"])


def test_resume_continues_the_ensemble(ensemble_run: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(ensemble_run, copy)
    summary = train(dataclasses.replace(make_cfg(size=K, epochs=3), resume=str(copy)), copy)
    assert summary["epochs"] == 3
    epochs = [json.loads(x) for x in (copy / "metrics.jsonl").read_text().splitlines() if '"epoch"' in x]
    assert [r["epoch"] for r in epochs if r["kind"] == "epoch"] == [1, 2, 3]


def test_predict_of_an_ensemble_is_the_mean_of_its_members_predictions(ensemble_run: Path) -> None:
    ckpt = checkpoint.load(ensemble_run / "checkpoints" / "last.npz")
    x = np.random.default_rng(0).uniform(0, 16, size=(40, 64))
    together = Predictor(ckpt, device="cpu").run(x, probabilities=True).probabilities
    members = []
    for k in range(K):  # member k as a one-model checkpoint
        arrays = {n: (a[k] if n.startswith("param/") else a) for n, a in ckpt.arrays.items()}
        meta = {n: v for n, v in ckpt.meta.items() if n != "members"}
        one = Predictor(checkpoint.Checkpoint(ckpt.path, arrays, meta), device="cpu")
        members.append(softmax(one.logits(x).astype(np.float64)))
    mean = np.mean(members, axis=0)
    np.testing.assert_allclose(together, mean, rtol=2e-5, atol=1e-7)
    assert not np.allclose(members[0], members[1], atol=1e-3)  # (a mean of different members)
    top2 = np.sort(mean, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-4  # rows whose class is not a near tie
    classes = Predictor(ckpt, device="cpu").run(x).class_id
    np.testing.assert_array_equal(classes[clear], mean.argmax(1)[clear])
    assert clear.sum() > len(x) // 2


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_batched_sweep_gives_member_k_the_single_run_of_its_lr_and_weight_decay(optimizer: str) -> None:
    lrs, decays = [0.05, 0.01, 0.2], [0.0, 1e-3, 1e-2]
    cfg = make_cfg(size=K)
    cfg.optimizer.name = optimizer
    cfg.ensemble.lr, cfg.ensemble.weight_decay = lrs, decays
    ens = EnsembleTrainer(cfg)
    together = np.array([np.array(ens.step(x, y)[0]) for x, y in ens.train_batches(0)])
    for k in range(K):
        one = make_cfg(seed=5 + k)
        one.optimizer.name = optimizer
        one.optimizer.lr, one.optimizer.weight_decay = lrs[k], decays[k]
        single = Trainer(one)
        alone = np.array([single.step(x, y)[0] for x, y in single.train_batches(0)])
        np.testing.assert_array_equal(together[:, k], alone)
    assert ens.epoch_extras()["member2/lr"] == 0.2


def test_a_sweep_run_writes_a_table_of_its_members(tmp_path: Path) -> None:
    cfg = make_cfg(size=K, epochs=1)
    cfg.ensemble.lr = [0.01, 0.05, 0.2]
    summary = train(cfg, tmp_path / "run")
    lines = (tmp_path / "run" / "members.md").read_text().splitlines()
    assert lines[0] == "| member | seed | lr | weight_decay | val/loss | val/acc | test/loss | test/acc |"
    assert lines[4].startswith("| 2 | 7 | 0.2 | 0 | ") and f"{summary['member2/test/acc']:.4g} |" in lines[4]
    assert lines[5].startswith("| the ensemble |") and lines[5].endswith(f"{summary['test/acc']:.4g} |")


def test_a_sweep_needs_one_value_per_member() -> None:
    cfg = make_cfg(size=K)
    cfg.ensemble.lr = [0.1, 0.2]
    with pytest.raises(ConfigError, match=r"ensemble.lr=\[0.1, 0.2\] has 2 values; .*one per member"):
        EnsembleTrainer(cfg)
    cfg.ensemble.lr = [0.1, 0.2, -1.0]
    with pytest.raises(ConfigError, match=r"ensemble.lr=\[0.1, 0.2, -1.0\]: each must be a finite number > 0"):
        EnsembleTrainer(cfg)


def test_the_exports_of_an_ensemble_predict_as_its_checkpoint(ensemble_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from mlptrain.cli.export import ExportArgs, export, load_safetensors

    ckpt = ensemble_run / "checkpoints" / "last.npz"
    p = Predictor(ckpt, device="cpu")
    x = np.random.default_rng(2).integers(0, 17, (200, 64)).astype(np.float64)
    out = export(ExportArgs(ckpt=str(ckpt), format="onnx", output=str(tmp_path / "e.onnx")))
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    logits, probs, ids = session.run(["logits", "probabilities", "class_id"], {"x": x.astype(np.float32)})
    res = p.run(x, probabilities=True)
    np.testing.assert_allclose(logits, p.logits(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(probs, res.probabilities, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ids, res.class_id)
    tensors, meta = load_safetensors(
        export(ExportArgs(ckpt=str(ckpt), format="safetensors", output=str(tmp_path / "e.safetensors")))
    )
    arrays = checkpoint.load(ckpt).arrays
    for k in range(K):  # nn.ModuleList of K nn.Sequential(Linear, ReLU, Linear, ReLU, Linear): "k.<module>.weight"
        np.testing.assert_array_equal(tensors[f"{k}.0.weight"], arrays["param/layer0.weight"][k])
        np.testing.assert_array_equal(tensors[f"{k}.4.bias"], arrays["param/layer2.bias"][k])
    assert json.loads(meta["mlptrain"])["members"] == K


def regression_table() -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 5))
    y = (x @ np.array([1.0, -2.0, 0.5, 0.0, 3.0]) + 0.1 * rng.standard_normal(400)).astype(np.float32)[:, None]
    return Dataset("linear", x[:300], y[:300], x[300:340], y[300:340], x[340:], y[340:], 1, task="regression")


def test_a_regression_ensemble_predicts_the_members_mean_output(tmp_path: Path) -> None:
    cfg = make_cfg(size=K, epochs=3)
    cfg.model.loss, cfg.data.batch_size = "mse", 32
    summary = train(cfg, tmp_path / "run", regression_table())
    assert {f"member{k}/val/rmse" for k in range(K)} <= set(summary) and "val/rmse" in summary
    ckpt = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.npz")
    x = np.random.default_rng(1).standard_normal((50, 5))
    together = Predictor(ckpt, device="cpu").run(x).values
    members = []
    for k in range(K):
        arrays = {n: (a[k] if n.startswith("param/") else a) for n, a in ckpt.arrays.items()}
        meta = {n: v for n, v in ckpt.meta.items() if n != "members"}
        members.append(Predictor(checkpoint.Checkpoint(ckpt.path, arrays, meta), device="cpu").run(x).values)
    assert together is not None and together.shape == (50, 1)
    np.testing.assert_allclose(together, np.mean(members, axis=0), rtol=1e-5, atol=1e-5)  # in the targets' units
    assert not np.allclose(members[0], members[1])


def test_a_resumed_ensemble_is_the_uninterrupted_one_bit_for_bit(tmp_path: Path) -> None:
    def cfg(epochs: int) -> TrainConfig:  # a constant rate: the schedule does not depend on the epochs asked
        c = make_cfg(size=K, epochs=epochs)
        c.optimizer.schedule = type(c.optimizer.schedule)("constant")
        return c

    whole = tmp_path / "whole"
    train(cfg(2), whole)
    part = tmp_path / "part"
    train(cfg(1), part)
    train(dataclasses.replace(cfg(2), resume=str(part)), part)
    a = checkpoint.load(whole / "checkpoints" / "last.npz").arrays
    b = checkpoint.load(part / "checkpoints" / "last.npz").arrays
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_the_estimators_ensemble_predicts_the_mean_of_its_members() -> None:
    from sklearn.datasets import load_breast_cancer

    from mlptrain.sklearn import MLPClassifier

    X, y = load_breast_cancer(return_X_y=True)
    kw = {"hidden_layer_sizes": (16,), "max_iter": 4, "device": "cpu", "learning_rate_init": 0.01}
    with pytest.warns(Warning):  # (ConvergenceWarning: 4 epochs)
        ens = MLPClassifier(ensemble_size=K, random_state=3, **kw).fit(X, y)
    ckpt = ens.state_
    members = []
    for k in range(K):  # member k as a one-model checkpoint
        arrays = {n: (a[k] if n.startswith("param/") else a) for n, a in ckpt.arrays.items()}
        meta = {n: v for n, v in ckpt.meta.items() if n != "members"}
        members.append(
            Predictor(checkpoint.Checkpoint(ckpt.path, arrays, meta), device="cpu").run(X, probabilities=True)
        )
    probabilities = [m.probabilities for m in members]
    np.testing.assert_allclose(ens.predict_proba(X), np.mean(probabilities, axis=0), rtol=1e-5, atol=1e-7)
    assert not np.allclose(probabilities[0], probabilities[1], atol=1e-3)
    assert ens.coefs_[0].shape == (K, 30, 16) and ens.intercepts_[1].shape == (K, 2)
    np.testing.assert_array_equal(ens.coefs_[0][1], ckpt.arrays["param/layer0.weight"][1].T)
    with pytest.raises(ConfigError, match="ensemble_size=0; expected a positive integer"):
        MLPClassifier(ensemble_size=0, **kw).fit(X, y)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_stacked_cross_entropy_is_each_members_cross_entropy(dtype: type) -> None:
    from mlptrain.nn.losses import softmax_cross_entropy
    from mlptrain.nn.members import stacked_cross_entropy

    rng = np.random.default_rng(4)
    logits = (3 * rng.standard_normal((K, 50, 7))).astype(dtype)
    y = rng.integers(0, 7, (K, 50))
    scale = np.array(8.0)
    loss, dlogits, correct = stacked_cross_entropy(logits.copy(), y, scale)
    tol = 1e-6 if dtype == np.float32 else 1e-13
    for k in range(K):
        one_loss, one_grad, one_correct = softmax_cross_entropy(logits[k], y[k], scale)
        np.testing.assert_allclose(loss[k], one_loss, rtol=tol)
        np.testing.assert_allclose(dlogits[k], one_grad, rtol=tol, atol=tol)
        assert correct[k] == one_correct
    written = logits.copy()
    _, same, _ = stacked_cross_entropy(written, y, scale, inplace=True)
    assert same is written and dlogits.dtype == dtype
    np.testing.assert_array_equal(written, dlogits)


def test_a_sweep_without_members_is_refused_when_the_config_is_validated(tmp_path: Path) -> None:
    cfg = make_cfg()
    cfg.ensemble.weight_decay = [0.1, 0.2]
    with pytest.raises(ConfigError, match=r"ensemble.weight_decay=\[0.1, 0.2\] has 2 values"):
        train(cfg, tmp_path / "run")  # a run of one model, which would ignore the list
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mode", ["fused", "naive"])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_a_one_target_regression_member_is_its_single_run_bit_for_bit(activation: str, mode: str) -> None:
    """One output: the input gradient below the top layer is K = 1 (the epilogs' DRELU/DGELU refuse it), applied
    apart (FusedExecution._input_grad_k1) on every member's slice."""

    def cfg(seed: int, size: int = 1) -> TrainConfig:
        c = make_cfg(seed=seed, size=size, mode=mode)
        c.model.loss, c.model.activation, c.data.batch_size = "mse", activation, 32
        return c

    data = regression_table()
    ens = EnsembleTrainer(cfg(5, K), data)
    together = np.array([np.array(ens.step(x, y)[0]) for x, y in ens.train_batches(0)])
    for k in range(K):
        single = Trainer(cfg(5 + k), data)
        alone = np.array([single.step(x, y)[0] for x, y in single.train_batches(0)])
        np.testing.assert_array_equal(together[:, k], alone)


def test_the_members_loss_compiles_ahead_by_the_steps_own_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ensemble's loss job makes the training step's loss call, :meth:`MemberHead.losses` (what
    :meth:`MemberHead.grads` calls) over zero ``(K, rows, C)`` logits in place, for each training batch size (on the
    GPU: the row kernel and ``mlptrain_member_means``), and evaluation's, the single head's call on one member's
    ``(rows, C)`` logits, for each evaluation batch size. On the CPU the head is in mode ``gemm``: no head kernel."""
    from mlptrain.nn.members import MemberHead

    tr = EnsembleTrainer(make_cfg(size=K))
    assert tr.head.mode == "gemm"  # the CPU (the oracle): the output layer's input gradient is its batched GEMM
    seen: list[tuple] = []
    losses, evaluate = MemberHead.losses, MemberHead.evaluate

    def spy_losses(self: Any, logits: Any, y: Any, grad_scale: Any, *, inplace: bool = False) -> Any:
        seen.append(("losses", logits.shape, y.shape, inplace))
        return losses(self, logits, y, grad_scale, inplace=inplace)

    def spy_evaluate(self: Any, logits: Any, y: Any) -> Any:
        seen.append(("evaluate", logits.shape, y.shape))
        return evaluate(self, logits, y)

    monkeypatch.setattr(MemberHead, "losses", spy_losses)
    monkeypatch.setattr(MemberHead, "evaluate", spy_evaluate)
    jobs = [job for job in tr.precompile_jobs() if job.stage == "loss"]
    for job in jobs:
        job.run()
    train, (val, test) = tr.train_loader.row_counts(), (tr.eval_loaders[s].row_counts() for s in ("val", "test"))
    assert train == [64, 14] and val == [144] and test == [359]  # digits: a full batch and a short one
    assert sorted(seen, key=str) == sorted(
        [("losses", (K, r, 10), (K, r), True) for r in train] + [("evaluate", (r, 10), (r,)) for r in [*val, *test]],
        key=str,
    )
    want = f"cross_entropy of {K} members' float32 logits, 10 outputs, batches of 64, 14 rows"
    assert jobs[-1].name == want


def test_an_ensembles_head_kernel_is_planned_ahead_where_its_head_takes_it() -> None:
    """In mode ``kernel`` (what MemberHead.choose takes on the GPU) the loss stage also compiles the members' head
    kernel, once for the training batches; the single model's head kernel, which an ensemble never launches, is not
    planned (evaluation's batches are all the single head's jobs see)."""
    from mlptrain.nn.members import MemberHead

    tr = EnsembleTrainer(make_cfg(size=K))
    tr.head = MemberHead("cross_entropy", "kernel")
    names = [job.name for job in tr.precompile_jobs() if job.stage == "loss"]
    assert names == [
        "cross_entropy of float32 logits, 10 outputs, batches of 359, 144 rows",
        f"cross_entropy of {K} members' float32 logits, 10 outputs, batches of 64, 14 rows",
        f"mlptrain_member_head_dgrad ({K} members, 10 classes, float32)",
    ]
    with pytest.raises(ValueError, match="an ensemble's head mode 'loss_bias' is unknown"):
        MemberHead("cross_entropy", "loss_bias")
