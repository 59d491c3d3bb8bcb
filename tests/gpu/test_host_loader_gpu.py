"""Host-resident splits on the GPU (#31, data.residency=host): the resident loader's batches, the same run.

mlptrain.data.host_loader.HostLoader gathers each batch into a pinned slot on a producer thread and copies it on a
stream of its own (mlptrain.data.cuda.host_loader.DeviceStaging), a few batches ahead; the loop's stream waits for
the slot's copy, copies it into the step's buffers and records that it is done with the slot. A missing
wait would show here as a batch of the wrong rows (the tests queue many batches without synchronising).
"""

from pathlib import Path

import numpy as np
import pytest
from helpers import make_cfg, records

from mlptrain.config.schema import Bgrad, Device
from mlptrain.data.host_loader import HostLoader
from mlptrain.data.loader import DataLoader
from mlptrain.run.run import train

pytestmark = pytest.mark.gpu


def _loaders(dtype, targets: int = 0, batch_size: int = 1000, **kw):  # noqa: ANN001, ANN202
    import cupy as cp
    import ml_dtypes  # noqa: F401 (bfloat16 in NumPy)

    rng = np.random.default_rng(5)
    x = rng.normal(size=(20_011, 37)).astype(np.float32)
    y = rng.normal(size=(20_011, targets)).astype(np.float32) if targets else rng.integers(0, 10, size=20_011)
    opts = dict(xp=cp, dtype=dtype, shuffle=True, drop_last=False, seed=3) | kw
    return DataLoader(x, y, batch_size, **opts), HostLoader(x, y, batch_size, **opts)


@pytest.mark.parametrize(("dtype", "targets"), [("float32", 0), ("bfloat16", 0), ("float16", 2)])
def test_batches_equal_the_resident_loaders_with_no_sync_between_them(dtype: str, targets: int) -> None:
    import cupy as cp
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    dev, host = _loaders(dt, targets)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # the loop's stream is never the default one
        for epoch in range(2):
            got = list(host.epoch(epoch))  # 21 batches queued back to back: fresh arrays each
            want = list(dev.epoch(epoch))
            stream.synchronize()
            assert len(got) == len(want) == 21 and len(got[-1][1]) == 20_011 % 1000
            for (xa, ya), (xb, yb) in zip(want, got, strict=True):
                assert xb.dtype == dt and yb.dtype == ya.dtype
                assert bytes(xa.get().tobytes()) == bytes(xb.get().tobytes())
                np.testing.assert_array_equal(ya.get(), yb.get())


def test_the_steps_buffers_are_refilled_in_stream_order() -> None:
    import cupy as cp

    dev, host = _loaders(np.dtype(np.float32), batch_size=512)
    bufs: dict = {}

    def out(rows: int):  # noqa: ANN202 (the step's fixed input buffers)
        if rows not in bufs:
            bufs[rows] = (cp.empty((rows, 37), cp.float32), cp.empty(rows, cp.int64))
        return bufs[rows]

    stream = cp.cuda.Stream(non_blocking=True)
    sums_host, sums_dev = [], []
    with stream:
        for (xa, ya), (xb, yb) in zip(dev.epoch(1), host.epoch(1, out=out), strict=True):
            sums_dev.append(xa.sum(axis=0) + ya.sum())  # what a step reading the buffers would see
            sums_host.append(xb.sum(axis=0) + yb.sum())
        stream.synchronize()
    assert len(sums_host) == 40
    np.testing.assert_array_equal(cp.stack(sums_host).get(), cp.stack(sums_dev).get())


@pytest.mark.parametrize(("precision", "residency"), [("fp32", "host"), ("bf16", "host"), ("bf16", "stream")])
def test_a_host_resident_run_takes_the_resident_runs_steps(tmp_path: Path, precision: str, residency: str) -> None:
    cfg = dict(device=Device.gpu, epochs=2, log_every=5, execution__bgrad=Bgrad.bgradb, data__batch_size=100)
    cfg["precision__name"] = precision
    resident = train(make_cfg(**cfg), tmp_path / "device")
    host = train(make_cfg(**cfg, data__residency=residency), tmp_path / "host")  # stream: rows normalised per batch
    assert host["steps"] == resident["steps"] == 2 * 13  # digits: 1,294 training rows, a short last batch of 94
    got, expected = records(tmp_path / "host"), records(tmp_path / "device")
    steps = [r for r in got if r["kind"] == "step"]
    assert steps and steps == [r for r in expected if r["kind"] == "step"]
    assert [r for r in got if r["kind"] == "epoch"] == [r for r in expected if r["kind"] == "epoch"]
