"""``python -m mlptrain.export``: safetensors for PyTorch's nn.Sequential, ONNX with the normalisation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import make_cfg

from mlptrain.base.errors import ConfigError
from mlptrain.cli.export import ExportArgs, export, load_safetensors, main, safetensors_bytes
from mlptrain.inference.predictor import Predictor
from mlptrain.run.run import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("export") / "run"
    train(make_cfg(epochs=2, model__hidden=[24, 16]), d)  # digits: 64-24-16-10
    return d


def _raw(p: Predictor, n: int = 50) -> np.ndarray:
    """Raw digit-like inputs (pixel values 0..16), as predict would read them from a file."""
    return np.random.default_rng(1).integers(0, 17, (n, p.num_features)).astype(np.float64)


def test_safetensors_has_sequential_names_layout_and_metadata(run_dir: Path, tmp_path: Path) -> None:
    out = export(ExportArgs(ckpt=str(run_dir), format="safetensors", output=str(tmp_path / "m.safetensors")))
    tensors, meta = load_safetensors(out)
    p = Predictor(run_dir, device="cpu")
    assert list(tensors) == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    for i, layer in enumerate(p.model.layers):
        np.testing.assert_array_equal(tensors[f"{2 * i}.weight"], layer.weight.value)  # (out, in)
        np.testing.assert_array_equal(tensors[f"{2 * i}.bias"], layer.bias.value)
    info = json.loads(meta["mlptrain"])
    assert info["widths"] == [64, 24, 16, 10] and info["class_names"] == [str(d) for d in range(10)]
    np.testing.assert_array_equal(info["normalization"]["shift"], p.shift)
    np.testing.assert_array_equal(info["normalization"]["scale"], p.scale)
    # The same logits from NumPy and the file alone: normalise, then Linear/ReLU/Linear/ReLU/Linear.
    x = _raw(p)
    h = ((x.astype(np.float32) - p.shift.astype(np.float32)) * (1 / p.scale).astype(np.float32)).astype(np.float32)
    for i in range(3):
        h = h @ tensors[f"{2 * i}.weight"].T + tensors[f"{2 * i}.bias"]
        h = np.maximum(h, 0) if i < 2 else h
    np.testing.assert_allclose(h, p.logits(x), rtol=1e-5, atol=1e-5)


def test_safetensors_package_reads_our_file(run_dir: Path, tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.numpy")
    args = ExportArgs(ckpt=str(run_dir), format="safetensors", output=str(tmp_path / "m.safetensors"), dtype="fp16")
    out = export(args)
    theirs = st.load_file(str(out))
    ours, _ = load_safetensors(out)
    assert sorted(theirs) == sorted(ours)
    for k in ours:
        assert theirs[k].dtype == np.float16
        np.testing.assert_array_equal(theirs[k], ours[k])


def test_safetensors_loads_into_torch_sequential_with_the_same_logits(run_dir: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    try:
        from safetensors.torch import load_file
    except ImportError:  # the file's bytes are the format either way; read them with our reader then

        def load_file(path: str) -> dict:
            return {k: torch.from_numpy(v.copy()) for k, v in load_safetensors(Path(path))[0].items()}

    out = export(ExportArgs(ckpt=str(run_dir), format="safetensors", output=str(tmp_path / "m.safetensors")))
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 24), torch.nn.ReLU(), torch.nn.Linear(24, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10)
    )
    model.load_state_dict(load_file(str(out)))  # strict: every name and shape must match
    p = Predictor(run_dir, device="cpu")
    info = json.loads(load_safetensors(out)[1]["mlptrain"])
    x = _raw(p)
    shift, scale = (torch.tensor(info["normalization"][k], dtype=torch.float64) for k in ("shift", "scale"))
    with torch.no_grad():  # normalised in float64 and rounded once, as mlptrain does
        logits = model(((torch.tensor(x, dtype=torch.float64) - shift) * (1 / scale)).float()).numpy()
    # float32 GEMMs summed in another order than mlptrain's: logits of tens differ by a few 1e-5
    np.testing.assert_allclose(logits, p.logits(x), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(logits.argmax(1), p.logits(x).argmax(1))


def test_onnx_runtime_gives_mlptrains_predictions(run_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    out = export(ExportArgs(ckpt=str(run_dir), format="onnx", output=str(tmp_path / "m.onnx")))
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    p = Predictor(run_dir, device="cpu")
    x = _raw(p, 300)
    logits, probs, ids = session.run(["logits", "probabilities", "class_id"], {"x": x.astype(np.float32)})
    res = p.run(x, probabilities=True)
    np.testing.assert_array_equal(ids, res.class_id)
    np.testing.assert_allclose(logits, p.logits(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(probs, res.probabilities, rtol=1e-5, atol=1e-6)
    meta = session.get_modelmeta().custom_metadata_map  # the preprocessing travels with the model
    assert json.loads(meta["mlptrain"])["feature_names"] == p.feature_names


def test_onnx_of_a_linear_model(tmp_path: Path) -> None:
    """activation=none: no ReLU between the layers (and Sequential indices 0, 1, 2 in safetensors)."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    d = tmp_path / "run"
    train(make_cfg(epochs=1, model__hidden=[8], model__activation="none"), d)
    tensors, _ = load_safetensors(export(ExportArgs(ckpt=str(d), format="safetensors")))
    assert list(tensors) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    session = ort.InferenceSession(str(export(ExportArgs(ckpt=str(d), format="onnx"))))
    p = Predictor(d, device="cpu")
    x = _raw(p)
    # random pixels 0..16 on nearly constant pixels (scaled since #47) make logits of ~100: float32 GEMM orders
    np.testing.assert_allclose(
        session.run(["logits"], {"x": x.astype(np.float32)})[0], p.logits(x), rtol=1e-5, atol=1e-4
    )


def test_a_gelu_model_trains_on_the_cpu_and_exports_to_onnx_and_torch(tmp_path: Path) -> None:
    """activation=gelu (the tanh form): trained through the epilog contract on the CPU, its ONNX graph
    (GELU as basic operators) and its nn.Sequential(..., GELU(approximate="tanh"), ...) agree with mlptrain."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    d = tmp_path / "run"
    summary = train(make_cfg(epochs=3, model__hidden=[24, 16], model__activation="gelu"), d)
    assert summary["test/acc"] > 0.8  # digits learns with GELU as it does with ReLU
    tensors, meta = load_safetensors(export(ExportArgs(ckpt=str(d), format="safetensors")))
    assert list(tensors)[::2] == ["0.weight", "2.weight", "4.weight"]
    assert json.loads(meta["mlptrain"])["activation"] == "gelu"
    session = ort.InferenceSession(str(export(ExportArgs(ckpt=str(d), format="onnx"))))
    p = Predictor(d, device="cpu")
    x = _raw(p, 200)
    logits, ids = session.run(["logits", "class_id"], {"x": x.astype(np.float32)})
    np.testing.assert_allclose(logits, p.logits(x), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(ids, p.run(x).class_id)
    try:
        import torch
    except ImportError:
        return
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 24),
        torch.nn.GELU(approximate="tanh"),
        torch.nn.Linear(24, 16),
        torch.nn.GELU(approximate="tanh"),
        torch.nn.Linear(16, 10),
    )
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in tensors.items()})
    info = json.loads(meta["mlptrain"])["normalization"]
    shift, scale = (torch.tensor(info[k], dtype=torch.float32) for k in ("shift", "scale"))
    with torch.no_grad():
        out = model((torch.tensor(x, dtype=torch.float32) - shift) * (1 / scale)).numpy()
    np.testing.assert_allclose(out, p.logits(x), rtol=1e-4, atol=1e-4)


def test_bad_arguments_are_clear(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="format='pickle'; expected one of safetensors, onnx"):
        export(ExportArgs(ckpt=str(run_dir), format="pickle"))
    with pytest.raises(ConfigError, match="dtype='fp16'; expected fp32"):
        export(ExportArgs(ckpt=str(run_dir), format="onnx", dtype="fp16"))
    assert main([f"ckpt={tmp_path / 'none.npz'}", "format=onnx"]) == 2


def test_safetensors_header_is_aligned_and_offsets_are_contiguous() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(3, dtype=np.float16)
    raw = safetensors_bytes({"a": a, "b": b}, {"k": "v"})
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    assert (8 + n) % 8 == 0
    assert header["a"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert header["b"] == {"dtype": "F16", "shape": [3], "data_offsets": [24, 30]}
    assert len(raw) == 8 + n + 30 and header["__metadata__"] == {"k": "v"}
