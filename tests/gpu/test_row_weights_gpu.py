"""data.weight on the GPU: the row-weighted losses against the float64 NumPy loss, each row's weight gathered
with it by every loader (and by the step itself), and a weighted run's steps on the resident, host-resident and
streamed paths against each other and against the CPU's."""

from pathlib import Path

import numpy as np
import pytest
from gpu_helpers import DTYPES, close, cp, f64, rand
from helpers import make_cfg, records
from numpy.testing import assert_allclose, assert_array_equal

from mlptrain.config.schema import DatasetName, Device
from mlptrain.data.host_loader import HostLoader
from mlptrain.data.loader import DataLoader
from mlptrain.nn.losses import class_weighted, mse, row_weighted, softmax_cross_entropy
from mlptrain.run.run import train

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "cache"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("B", "C"), [(7, 3), (256, 10), (1025, 10), (300, 40)])
@pytest.mark.parametrize("kind", ["cross_entropy", "class_weight", "mse"])
def test_row_weighted_losses_match_the_float64_numpy_loss(dtype: str, B: int, C: int, kind: str) -> None:
    rng = np.random.default_rng(B * C)
    z = rand(rng, (B, C), dtype) * 4
    w = rng.uniform(0.0, 3.0, B)
    w[0] = 0.0  # a row left out
    if kind == "mse":
        yw = np.concatenate([rng.standard_normal((B, C)), w[:, None]], axis=1)
        cpu, gpu = row_weighted(mse, False), row_weighted(mse, False)
    else:
        yw = np.stack([rng.integers(0, C, B), w], axis=1).astype(np.float64)
        cw = rng.uniform(0.5, 2.0, C).astype(np.float32)
        base = (lambda cw: class_weighted(cw)) if kind == "class_weight" else (lambda cw: softmax_cross_entropy)
        cpu, gpu = row_weighted(base(cw), True), row_weighted(base(cp.asarray(cw)), True)
    ref_loss, ref_d, ref_correct, ref_db = cpu(f64(z), yw, 512.0, bias_grad=True)
    loss, d, correct, db = gpu(cp.asarray(z), cp.asarray(yw), cp.asarray(512.0), bias_grad=True)
    assert d.dtype == z.dtype and d.shape == (B, C)
    assert abs(float(loss) - float(ref_loss)) < 1e-5 * max(1.0, abs(float(ref_loss)))
    close(d, ref_d, dtype, "row-weighted gradient")
    close(db, ref_db, dtype, "row-weighted output bias gradient")
    assert int(correct) == int(ref_correct)
    logits = cp.asarray(z)  # in place, as the training step calls it
    loss2, d2, _, _ = gpu(logits, cp.asarray(yw), cp.asarray(512.0), bias_grad=True, inplace=True)
    assert d2 is logits and float(loss2) == float(loss)
    assert_array_equal(f64(d2), f64(d))


def test_every_loader_and_the_steps_own_gather_carry_each_rows_weight() -> None:
    rng = np.random.default_rng(3)
    x, y, w = rng.standard_normal((5003, 7)).astype(np.float32), rng.integers(0, 4, 5003), rng.uniform(0, 2, 5003)
    opts = dict(xp=cp, dtype=np.float32, shuffle=True, drop_last=False, seed=11, w=w)
    dev, host = DataLoader(x, y, 500, **opts), HostLoader(x, y, 500, **opts)
    perm = dev.permutation(2)
    for ld in (dev, host):
        for i, (xb, yw) in enumerate(ld.epoch(2)):
            rows = perm[i * 500 : (i + 1) * 500]
            assert yw.dtype == cp.float64 and yw.shape == (len(rows), 2)
            assert_array_equal(yw.get(), np.stack([y[rows], w[rows]], axis=1))
            assert_array_equal(xb.get(), x[rows])
    dev.place_order(2, 0, 0)  # the gather inside a captured step: batch 3 read from the step count on the device
    xb, yw = dev.empty_batch(500)
    dev.gather_in_step(xb, yw, cp.asarray(3, dtype=cp.int64))
    assert_array_equal(yw.get(), np.stack([y[perm[1500:2000]], w[perm[1500:2000]]], axis=1))


def _table(path: Path, n: int = 900) -> Path:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((n, 6))
    y = np.argmax(x[:, :3] + 0.3 * rng.standard_normal((n, 3)), axis=1)
    w = np.round(rng.uniform(0, 3, n), 3)
    lines = ["f0,f1,f2,w,f3,f4,f5,label"]
    cell = lambda v: repr(float(v))  # noqa: E731 (NumPy 2's repr of np.float64 is 'np.float64(...)': text)
    lines += [",".join([*map(cell, x[i, :3]), str(w[i]), *map(cell, x[i, 3:]), str(y[i])]) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_weighted_run_takes_the_same_steps_on_every_path_and_the_cpus(tmp_path: Path) -> None:
    path = _table(tmp_path / "t.csv")
    base = dict(
        data__name=DatasetName.file,
        data__path=str(path),
        data__weight="w",
        data__batch_size=64,
        epochs=2,
        log_every=1,
        model__class_weight=[1.0, 2.0, 0.5],
    )
    cpu = train(make_cfg(**base), tmp_path / "cpu")
    runs = {
        r: train(make_cfg(**base, device=Device.gpu, data__residency=r), tmp_path / r)
        for r in ("device", "host", "stream")
    }
    assert cpu["steps"] == runs["device"]["steps"] == runs["host"]["steps"] > 20
    steps = {r: [s for s in records(tmp_path / r) if s["kind"] == "step"] for r in ("cpu", *runs)}
    assert steps["host"] == steps["device"] == steps["stream"]  # the same batches, the same weights: bit for bit
    got = [s["train/loss"] for s in steps["device"]]
    assert_allclose(got, [s["train/loss"] for s in steps["cpu"]], rtol=2e-4)
    unweighted = train(make_cfg(**{**base, "data__weight": None, "data__drop": ["w"]}), tmp_path / "plain")
    assert unweighted["steps"] == cpu["steps"]  # the check can fail: the weights change the losses
    plain = [s["train/loss"] for s in records(tmp_path / "plain") if s["kind"] == "step"]
    assert np.abs(np.array(plain) - got).max() > 1e-2
