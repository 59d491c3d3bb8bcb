"""Inference on the GPU (mlptrain.inference.cuda.predictor): RELU_BIAS, one graph per batch size, the CPU's
predictions."""

from pathlib import Path

import numpy as np
import pytest
from gpu_helpers import cp
from helpers import make_cfg

from mlptrain.inference.predictor import Predictor
from mlptrain.run.run import train

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("infer") / "run"
    train(make_cfg(epochs=3, model__hidden=[96, 64]), d)  # trained on the CPU: digits, 64-96-64-10
    return d / "checkpoints" / "best.npz"


def _raw(n: int) -> np.ndarray:
    return np.random.default_rng(3).integers(0, 17, (n, 64)).astype(np.float64)  # digit pixels 0..16


def test_gpu_fp32_predictions_equal_the_cpus(ckpt: Path) -> None:
    cpu = Predictor(ckpt, device="cpu")
    gpu = Predictor(ckpt, device="gpu", precision="fp32", batch_size=384)  # 1000 rows: 2 full batches and a short one
    x = _raw(1000)
    want, got = cpu.run(x, probabilities=True), gpu.run(x, probabilities=True)
    np.testing.assert_allclose(gpu.logits(x), cpu.logits(x), rtol=1e-4, atol=1e-4)
    margin = np.sort(cpu.logits(x), axis=1)
    clear = margin[:, -1] - margin[:, -2] > 1e-3  # rows whose argmax no rounding can flip
    np.testing.assert_array_equal(got.class_id[clear], want.class_id[clear])
    np.testing.assert_allclose(got.probabilities, want.probabilities, rtol=1e-4, atol=1e-5)
    assert gpu.gpu_runner.graphs_captured() == 1  # the short batch reused the graph of the full ones


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_graph_replays_equal_the_uncaptured_forward(ckpt: Path, precision: str) -> None:
    gpu = Predictor(ckpt, device="gpu", precision=precision, batch_size=256)
    x = _raw(777)
    out = gpu.run(x, probabilities=True)
    logits = gpu.logits(x)  # uncaptured: CuPy normalisation, the same GEMMs
    np.testing.assert_array_equal(out.class_id, logits.argmax(axis=1))
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out.probabilities, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)
    cpu = Predictor(ckpt, device="cpu").run(x)
    assert np.mean(out.class_id == cpu.class_id) > 0.98  # half precision rounds; nearly all predictions agree


def test_inference_uses_relu_bias_not_relu_aux_bias(ckpt: Path) -> None:
    gpu = Predictor(ckpt, device="gpu", precision="fp16")
    gpu.run(_raw(100))
    epilogs = sorted(sig[-1].name for sig in gpu.model.execution.gemm._plans)
    assert epilogs == ["BIAS", "RELU_BIAS", "RELU_BIAS"]  # two hidden layers, no mask written


def test_device_inputs_equal_host_inputs(ckpt: Path) -> None:
    gpu = Predictor(ckpt, device="gpu", precision="bf16", batch_size=128)
    x = _raw(300)
    host = gpu.run(x, probabilities=True)
    dev = gpu.run(cp.asarray(x, dtype=cp.float32), probabilities=True)
    np.testing.assert_array_equal(dev.class_id, host.class_id)
    np.testing.assert_array_equal(dev.probabilities, host.probabilities)


def test_a_quantile_model_maps_raw_rows_on_the_host_as_the_cpu_does(tmp_path: Path) -> None:
    """data.normalize=quantile: the Predictor maps the raw rows through the quantile table on the host (float64), then
    the graph's normaliser casts them; CuPy inputs come to the host for the map. Predictions are the CPU's."""
    train(make_cfg(epochs=2, data__normalize="quantile"), tmp_path / "run")
    path = tmp_path / "run" / "checkpoints" / "best.npz"
    cpu, gpu = Predictor(path, device="cpu"), Predictor(path, device="gpu", precision="fp32", batch_size=256)
    assert gpu.normalization.quantile is not None and len(gpu.normalization.quantile.columns) > 0
    x = _raw(700)
    np.testing.assert_allclose(gpu.logits(x), cpu.logits(x), rtol=1e-4, atol=1e-4)
    host, want = gpu.run(x, probabilities=True), cpu.run(x, probabilities=True)
    np.testing.assert_allclose(host.probabilities, want.probabilities, rtol=1e-4, atol=1e-5)
    dev = gpu.run(cp.asarray(x, dtype=cp.float32), probabilities=True)  # integers: the same values in float32
    np.testing.assert_array_equal(dev.class_id, host.class_id)
    np.testing.assert_array_equal(dev.probabilities, host.probabilities)


def test_regression_outputs_on_the_gpu(tmp_path: Path) -> None:
    from mlptrain.config.schema import DatasetName
    from mlptrain.data.files.readers import write_csv

    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 5)) * 10
    y = x @ rng.standard_normal(5)
    write_csv(tmp_path / "r.csv", x, y, [f"x{i}" for i in range(5)], target="y")
    train(
        make_cfg(
            data__name=DatasetName.file,
            data__path=str(tmp_path / "r.csv"),
            data__target="y",
            data__cache=False,
            model__loss="mse",
            epochs=2,
        ),
        tmp_path / "run",
    )
    path = tmp_path / "run" / "checkpoints" / "best.npz"
    cpu, gpu = Predictor(path, device="cpu"), Predictor(path, device="gpu", precision="fp32", batch_size=64)
    np.testing.assert_allclose(gpu.run(x).values, cpu.run(x).values, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("f", [784, 6, 4096])
def test_normalise_kernel_rounds_as_numpy(name: str, f: int) -> None:
    from gpu_helpers import np_dtype

    from mlptrain.inference.cuda.infer_kernels import normalise

    rng = np.random.default_rng(f)
    x = (rng.standard_normal((37, f)) * 50 + 10).astype(np.float32)
    shift = rng.standard_normal(f).astype(np.float32)
    inv = rng.uniform(0.01, 3, f).astype(np.float32)
    want = ((x - shift) * inv).astype(np_dtype(name))  # float32 arithmetic, then one rounding
    for offset in (0, 1):  # 16-byte aligned (float4 loads when f % 4 == 0), and not
        flat = cp.asarray(np.concatenate([np.zeros(offset, np.float32), x.ravel()]))
        xd = flat[offset:].reshape(37, f)
        out = cp.empty((37, f), dtype=np_dtype(name))
        normalise(xd, cp.asarray(shift), cp.asarray(inv), out)
        assert cp.asnumpy(out).tobytes() == want.tobytes(), (name, f, offset)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("c", [10, 33, 4096])
def test_argmax_kernel_takes_the_first_maximum(name: str, c: int) -> None:
    from gpu_helpers import np_dtype

    from mlptrain.inference.cuda.infer_kernels import argmax

    rng = np.random.default_rng(c)
    z = rng.standard_normal((1000, c)).astype(np_dtype(name))
    rows = np.arange(0, 1000, 7)
    top = z.astype(np.float64).argmax(axis=1)
    z[rows, (top[rows] + 5) % c] = z[rows, top[rows]]  # ties: before or after the first maximum
    want = z.astype(np.float64).argmax(axis=1)  # NumPy: the first index of the maximum
    np.testing.assert_array_equal(cp.asnumpy(argmax(cp.asarray(z))), want)


def test_calls_of_many_sizes_share_a_few_graphs(ckpt: Path) -> None:
    cpu = Predictor(ckpt, device="cpu")
    gpu = Predictor(ckpt, device="gpu", precision="fp32")
    x = _raw(1000)
    for n in (1, 5, 60, 64, 100, 1000, 3, 999, 120):  # each size warmed up once, then captured
        got, want = gpu.run(x[:n], probabilities=True), cpu.run(x[:n], probabilities=True)
        np.testing.assert_allclose(got.probabilities, want.probabilities, rtol=1e-4, atol=1e-5)
        assert got.class_id.shape == (n,)
    assert gpu.gpu_runner.graphs_captured() == 3  # batches of 64, 128 and 1024 rows


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
def test_argmax_kernel_takes_the_first_nan_as_numpy_does(name: str) -> None:
    from gpu_helpers import np_dtype

    from mlptrain.inference.cuda.infer_kernels import argmax

    z = np.random.default_rng(1).standard_normal((200, 50)).astype(np_dtype(name))
    z[3, 7] = z[3, 40] = np.nan  # the first NaN wins
    z[4, 0] = np.nan  # at column 0
    z[5, 49] = np.nan  # at the last column
    z[6, :] = np.nan
    want = z.astype(np.float64).argmax(axis=1)
    assert want[3] == 7 and want[4] == 0 and want[5] == 49 and want[6] == 0
    np.testing.assert_array_equal(cp.asnumpy(argmax(cp.asarray(z))), want)


def test_normalise_kernel_refuses_operands_by_shape_and_dtype() -> None:
    from mlptrain.inference.cuda.infer_kernels import normalise

    x = cp.ones((4, 8), cp.float32)
    with pytest.raises(ValueError, match=r"got x float32\(4, 8\), shift float32\(7,\)"):
        normalise(x, cp.ones(7, cp.float32), cp.ones(8, cp.float32), cp.empty((4, 8), cp.float16))
    with pytest.raises(ValueError, match=r"out int32\(4, 8\)"):
        normalise(x, cp.ones(8, cp.float32), cp.ones(8, cp.float32), cp.empty((4, 8), cp.int32))


def test_inputs_still_being_computed_on_another_stream_are_waited_for(ckpt: Path) -> None:
    gpu = Predictor(ckpt, device="gpu", precision="fp32", batch_size=512)
    raw = _raw(4096)
    want = gpu.run(raw).class_id
    with cp.cuda.Stream(non_blocking=True):
        x = cp.asarray(raw, dtype=cp.float32)
        for _ in range(50):  # keep this stream busy, then rewrite x in place as the last thing it does
            x = x * 1.0
        got = gpu.run(x).class_id
    np.testing.assert_array_equal(got, want)
