"""One preprocessing path: a Dataset built in Python is normalised as ``data=file`` is, regression targets are
standardised from the train split, and every checkpoint scores raw rows (predict, evaluate, both exports)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg

import mlptrain
from mlptrain.base.errors import CheckpointError, ConfigError, DatasetError
from mlptrain.cli.evaluate import EvaluateArgs, evaluate
from mlptrain.cli.export import ExportArgs, export, load_safetensors
from mlptrain.config.schema import DatasetName, TargetScaling
from mlptrain.data import Dataset, load_dataset
from mlptrain.data.dataset import Normalization
from mlptrain.data.files.readers import write_csv
from mlptrain.inference.predictor import Predictor
from mlptrain.run import checkpoint
from mlptrain.run.run import train
from mlptrain.step.checks import validate

FEATURES = ["f0", "f1", "f2", "f3"]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "cache"))


def _blobs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Three classes of 4 features on scales from 0.1 to 1000 around 500 (unnormalised, an MLP learns little)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centres = np.array([[0, 1, 2, 0], [2, 0, 1, 2], [1, 2, 0, 1]], dtype=np.float64)
    x = (centres[y] + 0.5 * rng.standard_normal((n, 4))) * np.array([0.1, 10.0, 1000.0, 1.0]) + 500.0
    return x, y


def _houses(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A table whose target (a price) runs over about 25 to 350, from 4 features of other scales."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 4)) * np.array([1.0, 20.0, 0.5, 3.0]) + np.array([3.0, 100.0, 0.0, 10.0])
    z = (x - [3.0, 100.0, 0.0, 10.0]) / [1.0, 20.0, 0.5, 3.0]
    price = 180.0 + 50.0 * z[:, 0] - 35.0 * z[:, 1] + 25.0 * np.tanh(z[:, 2] * z[:, 3]) + 5.0 * rng.standard_normal(n)
    return x, np.clip(price, 25.0, 346.0)


def _file_cfg(tmp_path: Path, **overrides: Any) -> Any:
    cfg = make_cfg(**{"epochs": 10, **overrides})
    cfg.data.name = DatasetName.file
    cfg.data.path = str(tmp_path / "train.csv")
    cfg.data.test_path = str(tmp_path / "test.csv")
    cfg.data.batch_size = 32
    return cfg


def _write(tmp_path: Path, make: Any, target: str) -> dict[str, np.ndarray]:
    # float32 values: the raw rows a Dataset holds in Python are the file's, to the bit
    (x, y), (x_te, y_te) = ((a.astype(np.float32).astype(np.float64), b) for a, b in (make(600, 0), make(200, 1)))
    write_csv(tmp_path / "train.csv", x, y, FEATURES, target=target)
    write_csv(tmp_path / "test.csv", x_te, y_te, FEATURES, target=target)
    return {"x": x, "y": y, "x_test": x_te, "y_test": y_te}


def _raw_dataset(cfg: Any) -> Dataset:
    """The file route's own splits of raw rows, as a user would build them in Python (no normalisation given)."""
    cfg_raw = _file_cfg(Path(cfg.data.path).parent, data__normalize="none")
    ds = load_dataset(cfg_raw.data)
    x = {s: getattr(ds, f"x_{s}").astype(np.float64) for s in ("train", "val", "test")}  # as a user reads them
    return Dataset(
        "mine",
        x["train"],
        ds.y_train,
        x["val"],
        ds.y_val,
        x["test"],
        ds.y_test,
        ds.num_classes,
        ds.class_names,
        ds.task,
        ds.feature_names,
        ds.target_names,
    )


# --- 1. a Dataset built in Python ----------------------------------------------------------------------------


def test_a_python_dataset_of_raw_features_trains_and_scores_as_data_file(tmp_path: Path) -> None:
    data = _write(tmp_path, _blobs, "label")
    cfg = _file_cfg(tmp_path)
    by_file = train(cfg, tmp_path / "file")
    raw = _raw_dataset(cfg)
    assert raw.normalization is None and raw.x_train.max() > 400  # raw features in
    by_python = train(cfg, tmp_path / "python", dataset=raw)
    assert by_file["test/acc"] > 0.9
    assert by_python["test/acc"] == by_file["test/acc"]
    np.testing.assert_allclose(by_python["test/loss"], by_file["test/loss"], rtol=1e-5)
    a, b = (checkpoint.load(tmp_path / r / "checkpoints" / "last.npz") for r in ("file", "python"))
    np.testing.assert_allclose(a.arrays["data/shift"], b.arrays["data/shift"], rtol=1e-12)
    np.testing.assert_allclose(a.arrays["data/scale"], b.arrays["data/scale"], rtol=1e-12)
    assert b.meta["data"]["normalize"] == "standard" and b.meta["data"]["normalization_from"] == "train split"
    # raw rows scored: equal to the model's own test predictions, and its test accuracy
    p = Predictor(tmp_path / "python" / "checkpoints" / "last.npz", device="cpu")
    normalised = Normalization("standard", p.shift, p.scale).apply(data["x_test"])
    own = p.logits(normalised, normalised=True).argmax(axis=1)
    scored = mlptrain.predict(p, data["x_test"])
    np.testing.assert_array_equal(scored, own)
    assert np.mean(scored == data["y_test"]) == by_python["test/acc"]


def test_a_dataset_with_its_own_normalization_keeps_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    x, y = _blobs(400, 0)
    shift, scale = np.full(4, 500.0), np.array([0.1, 10.0, 1000.0, 1.0])  # the user's own, stated
    norm = Normalization("by hand", shift, scale)
    xn = norm.apply(x)
    ds = Dataset("mine", xn[:300], y[:300], xn[300:340], y[300:340], xn[340:], y[340:], 3, normalization=norm)
    with caplog.at_level("INFO", logger="mlptrain.data.prepare"):
        summary = train(make_cfg(epochs=10), tmp_path / "run", dataset=ds)
    assert (
        "dataset mine: its own normalisation (by hand) is kept; data.normalize=standard is not applied" in caplog.text
    )
    ckpt = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.npz")
    np.testing.assert_array_equal(ckpt.arrays["data/shift"], shift)
    np.testing.assert_array_equal(ckpt.arrays["data/scale"], scale)
    assert ckpt.meta["data"]["normalize"] == "by hand" and ckpt.meta["data"]["normalization_from"] == "dataset"
    scored = mlptrain.predict(tmp_path / "run" / "checkpoints" / "last.npz", x[340:], device="cpu")
    assert np.mean(scored == y[340:]) == summary["test/acc"]


def test_an_old_checkpoint_of_a_python_dataset_refuses_raw_rows(tmp_path: Path) -> None:
    """Before, a Dataset built in Python left identity preprocessing while data.normalize said standard."""
    x, y = _blobs(200, 0)
    xn = ((x - x.mean(axis=0)) / x.std(axis=0)).astype(np.float32)  # normalised by hand, not recorded
    ds = Dataset("mine", xn[:150], y[:150], xn[150:170], y[150:170], xn[170:], y[170:], 3)
    train(make_cfg(epochs=1), tmp_path / "run", dataset=ds)
    path = tmp_path / "run" / "checkpoints" / "last.npz"
    ckpt = checkpoint.load(path)
    meta = {k: v for k, v in ckpt.meta.items() if k not in ("format", "format_version", "sha256")}
    meta["data"] = {k: v for k, v in meta["data"].items() if k != "normalization_from"}
    meta["data"]["normalize"] = "none"
    arrays = {**ckpt.arrays, "data/shift": np.zeros(4), "data/scale": np.ones(4)}
    checkpoint.save(tmp_path / "old.npz", arrays, meta)
    p = Predictor(tmp_path / "old.npz", device="cpu")
    with pytest.raises(CheckpointError, match=r"old.npz was trained on a Dataset built in Python .* cannot score raw"):
        p.run(x[170:])
    # rows normalised as its training data still score, stated by the caller
    assert p.logits(xn[170:], normalised=True).shape == (30, 3)


# --- 2. regression targets --------------------------------------------------------------------------------------


def test_a_regression_with_targets_in_the_hundreds_trains_below_the_mean(tmp_path: Path) -> None:
    """The README's data=file data.target=price model.loss=mse, default lr: before, non-finite at step 4."""
    data = _write(tmp_path, _houses, "price")
    cfg = _file_cfg(tmp_path, model__loss="mse", epochs=20)
    cfg.data.target = "price"
    summary = train(cfg, tmp_path / "run")
    mean_mse = float(np.mean((data["y_test"] - data["y"].mean()) ** 2))  # predicting the train mean
    assert summary["test/loss"] < 0.2 * mean_mse
    ckpt = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.npz")
    assert ckpt.meta["data"]["target_scaling"] == "standard"
    np.testing.assert_allclose(ckpt.arrays["data/target_shift"], [np.mean(load_dataset_y(cfg))], rtol=1e-6)
    # predict and evaluate in the target's units, agreeing with the run's own test loss
    values = mlptrain.predict(tmp_path / "run" / "checkpoints" / "last.npz", data["x_test"], device="cpu")
    assert values.shape == (200, 1) and 20 < values.mean() < 350
    mse = float(np.mean((values[:, 0].astype(np.float64) - data["y_test"]) ** 2))
    np.testing.assert_allclose(mse, summary["test/loss"], rtol=1e-4)
    report, _ = evaluate(EvaluateArgs(ckpt=str(tmp_path / "run" / "checkpoints" / "last.npz"), device="cpu"))
    np.testing.assert_allclose(report["loss"], summary["test/loss"], rtol=1e-4)
    np.testing.assert_allclose(report["mse"]["price"], mse, rtol=1e-4)


def load_dataset_y(cfg: Any) -> np.ndarray:
    """The train split's raw targets (the file route, targets unscaled)."""
    cfg_raw = _file_cfg(Path(cfg.data.path).parent, data__target_scaling=TargetScaling.none)
    cfg_raw.data.target = cfg.data.target
    return load_dataset(cfg_raw.data).y_train


def test_losses_are_in_the_targets_units_train_val_and_test(tmp_path: Path) -> None:
    """Two targets of other scales: every loss the run reports is the MSE of the unscaled outputs."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 3))
    t = np.stack([200.0 + 40.0 * x[:, 0], 0.5 * x[:, 1]], axis=1)  # (N, 2): units of 40 and of 0.5
    ds = Dataset(
        "two",
        x[:200],
        t[:200].astype(np.float32),
        x[200:250],
        t[200:250].astype(np.float32),
        x[250:],
        t[250:].astype(np.float32),
        2,
        task="regression",
    )
    summary = train(make_cfg(epochs=3, model__loss="mse"), tmp_path / "run", dataset=ds)
    p = Predictor(tmp_path / "run" / "checkpoints" / "last.npz", device="cpu")
    out = p.run(x[250:]).values.astype(np.float64)
    np.testing.assert_allclose(summary["test/loss"], np.mean((out - t[250:]) ** 2), rtol=1e-4)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in recs if r["kind"] == "step")
    # the first logged step's loss: predicting ~0 standardised is predicting the mean, whose MSE is in units
    assert first["train/loss"] > 100.0


def test_exports_and_predict_give_outputs_in_the_targets_units(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    data = _write(tmp_path, _houses, "price")
    cfg = _file_cfg(tmp_path, model__loss="mse", epochs=5)
    cfg.data.target = "price"
    train(cfg, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "last.npz"
    values = mlptrain.predict(ckpt, data["x_test"], device="cpu")
    onnx_path = export(ExportArgs(ckpt=str(ckpt), format="onnx", output=str(tmp_path / "m.onnx")))
    import onnx

    nodes = onnx.load(str(onnx_path)).graph.node
    tail = [(n.op_type, list(n.input), list(n.output)) for n in nodes[-3:]]
    assert tail == [
        ("Gemm", ["h1", "layer1.weight", "layer1.bias"], ["z_out"]),
        ("Mul", ["z_out", "target_scale"], ["z_scaled"]),
        ("Add", ["z_scaled", "target_shift"], ["logits"]),
    ]
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (onnx_out,) = sess.run(["logits"], {"x": data["x_test"].astype(np.float32)})
    np.testing.assert_allclose(onnx_out, values, rtol=1e-5, atol=1e-3)
    st = export(ExportArgs(ckpt=str(ckpt), format="safetensors", output=str(tmp_path / "m.safetensors")))
    tensors, meta = load_safetensors(st)
    pre = json.loads(meta["mlptrain"])
    h = (data["x_test"] - pre["normalization"]["shift"]) / pre["normalization"]["scale"]
    h = np.maximum(h @ tensors["0.weight"].T + tensors["0.bias"], 0.0)
    z = h @ tensors["2.weight"].T + tensors["2.bias"]  # the network's standardised output
    ts = pre["target_scaling"]
    assert ts["method"] == "standard" and ts["formula"] == "y = output * scale + shift"
    np.testing.assert_allclose(z * ts["scale"] + ts["shift"], values, rtol=1e-4, atol=1e-2)


def test_an_old_regression_checkpoint_without_target_scaling_scores_as_before(tmp_path: Path) -> None:
    data = _write(tmp_path, _houses, "price")
    cfg = _file_cfg(tmp_path, model__loss="mse", epochs=2, optimizer__lr=1e-4, data__target_scaling=TargetScaling.none)
    cfg.data.target = "price"
    summary = train(cfg, tmp_path / "run")
    ckpt = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.npz")
    np.testing.assert_array_equal(ckpt.arrays["data/target_scale"], [1.0])
    meta = {k: v for k, v in ckpt.meta.items() if k not in ("format", "format_version", "sha256")}
    meta["data"] = {k: v for k, v in meta["data"].items() if k not in ("target_scaling", "normalization_from")}
    meta["config"]["data"].pop("target_scaling")  # a setting that did not exist yet
    arrays = {k: v for k, v in ckpt.arrays.items() if not k.startswith("data/target_")}
    checkpoint.save(tmp_path / "old.npz", arrays, meta)  # as mlptrain wrote it before target scaling
    p = Predictor(tmp_path / "old.npz", device="cpu")
    x = Normalization("standard", p.shift, p.scale).apply(data["x_test"])
    np.testing.assert_array_equal(p.run(data["x_test"]).values, p.model.forward(x, keep=False))
    report, _ = evaluate(EvaluateArgs(ckpt=str(tmp_path / "old.npz"), device="cpu"))
    np.testing.assert_allclose(report["loss"], summary["test/loss"], rtol=1e-5)
    # resuming it with standardised targets would read its outputs in the wrong units: refused, with the fix
    cfg.data.target_scaling, cfg.epochs, cfg.resume = TargetScaling.standard, 3, str(tmp_path / "old.npz")
    with pytest.raises(
        DatasetError,
        match=r"old.npz was trained on the targets as they are .* resume with "
        r"data.target_scaling=none",
    ):
        train(cfg, tmp_path / "resumed")


def test_target_scaling_is_a_regression_setting(tmp_path: Path) -> None:
    cfg = make_cfg(data__target_scaling=TargetScaling.none)
    with pytest.raises(
        ConfigError,
        match=r"data.target_scaling=none is not used with model.loss=cross_entropy: it "
        r"applies to regressions \(model.loss=mse\)",
    ):
        validate(cfg)
    cfg.model.loss = "mse"  # mse on the digits' classes: a classification all the same
    with pytest.raises(ConfigError, match=r"data.target_scaling=none: dataset 'digits' is a classification; .*"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_gpus_regression_losses_are_in_the_targets_units_as_the_cpus(tmp_path: Path, precision: str) -> None:
    """The step's weighted mse (mlptrain.nn.losses.mse_in_units) inside the GPU's CUDA graph, and its evaluation."""
    from mlptrain.config.schema import Device
    from mlptrain.run.metrics import read_metrics

    data = _write(tmp_path, _houses, "price")
    runs = {}
    for device in ("cpu", "gpu"):
        cfg = _file_cfg(tmp_path, model__loss="mse", epochs=5)
        cfg.data.target = "price"
        if device == "gpu":
            cfg.device, cfg.precision.name = Device.gpu, precision
        summary = train(cfg, tmp_path / device)
        records = [r for r in read_metrics(tmp_path / device / "metrics.jsonl") if r["kind"] == "step"]
        runs[device] = summary, [r["train/loss"] for r in records], [r.get("skipped", False) for r in records]
    (cpu, cpu_steps, _), (gpu, gpu_steps, skipped) = runs["cpu"], runs["gpu"]
    rtol = 1e-3 if precision == "fp32" else 5e-2
    # fp16's loss scaler skips its first steps while the scale backs off from 2^16; a skipped step leaves
    # the weights as they were, so the runs' losses are comparable up to the first skip (included)
    same = next((i + 1 for i, s in enumerate(skipped) if s), 3)
    np.testing.assert_allclose(gpu_steps[:same], cpu_steps[:same], rtol=rtol)  # in price units (thousands at first)
    assert cpu_steps[0] > 1000.0
    np.testing.assert_allclose(gpu["test/loss"], cpu["test/loss"], rtol=10 * rtol)
    mean_mse = float(np.mean((data["y_test"] - data["y"].mean()) ** 2))
    assert gpu["test/loss"] < 0.2 * mean_mse
    values = Predictor(tmp_path / "gpu" / "checkpoints" / "last.npz", device="gpu").run(data["x_test"]).values
    mse = float(np.mean((values[:, 0].astype(np.float64) - data["y_test"]) ** 2))
    np.testing.assert_allclose(mse, gpu["test/loss"], rtol=rtol)
