"""Host-resident splits (data.residency=host): HostLoader gives the resident loader's batches, the pipe's order.

mlptrain.data.host_loader.HostLoader keeps a split in host memory and gathers each batch on a producer thread
(mlptrain.data.host_loader.Pipe) a few batches ahead of the loop; on the GPU each batch is then copied to the device
(tests/gpu/test_host_loader_gpu.py). Here, on the CPU, the same loader and pipe must give the batches of
DataLoader bit for bit (order, shards, the last batch, a resumed epoch), and so the same run.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import make_cfg, records
from numpy.testing import assert_array_equal

from mlptrain.base.errors import ConfigError, ResourceError
from mlptrain.data.host_loader import HostLoader, Pipe, host_table, residency, take_rows
from mlptrain.data.loader import DataLoader
from mlptrain.run.run import train
from mlptrain.step.trainer import Trainer


def _data(n: int = 1003, f: int = 5, targets: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, f))  # float64: the loaders cast it
    y = rng.normal(size=(n, targets)) if targets else rng.integers(0, 7, size=n)
    return x, y


def _pair(n: int = 1003, batch_size: int = 64, targets: int = 0, **kw) -> tuple[DataLoader, HostLoader]:
    x, y = _data(n, targets=targets)
    opts = {"xp": np, "dtype": np.float32, "shuffle": True, "drop_last": False, "seed": 11} | kw
    return DataLoader(x, y, batch_size, **opts), HostLoader(x, y, batch_size, **opts)


def _same_batches(a, b) -> int:  # noqa: ANN001 (iterators of batches)
    count = 0
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert xa.dtype == xb.dtype and ya.dtype == yb.dtype
        assert_array_equal(xa, xb)
        assert_array_equal(ya, yb)
        count += 1
    return count


@pytest.mark.parametrize(
    ("batch_size", "drop_last", "shuffle", "targets"),
    [(64, False, True, 0), (64, True, True, 0), (100, False, False, 0), (1003, False, True, 0), (2000, False, True, 2)],
)
def test_the_batches_are_the_resident_loaders(batch_size: int, drop_last: bool, shuffle: bool, targets: int) -> None:
    dev, host = _pair(batch_size=batch_size, drop_last=drop_last, shuffle=shuffle, targets=targets)
    assert len(dev) == len(host) and host.row_counts() == dev.row_counts()
    for epoch in range(3):
        assert _same_batches(dev.epoch(epoch), host.epoch(epoch)) == len(dev)
    if not drop_last and 1003 % batch_size:  # the short last batch is there
        assert len(list(host.epoch(0))[-1][1]) == 1003 % batch_size


def test_a_resumed_epoch_starts_at_the_same_batch() -> None:
    dev, host = _pair()
    for start in (0, 5, 15, 16):
        assert _same_batches(dev.epoch(2, start), host.epoch(2, start)) == len(dev) - start
    with pytest.raises(ConfigError, match="start_batch=17"):
        host.epoch(0, 17)


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_gets_its_shard_of_the_same_global_batch(world: int) -> None:
    for rank in range(world):
        dev, host = _pair(shard=(rank, world), drop_last=True)
        got = list(host.epoch(1))
        assert _same_batches(dev.epoch(1), iter(got)) == len(dev)
        assert host.global_rows == 64  # of the batch last yielded


def test_given_buffers_are_filled_and_wrong_ones_refused() -> None:
    dev, host = _pair()
    bufs = {}

    def out(rows: int) -> tuple[np.ndarray, np.ndarray]:
        if rows not in bufs:
            bufs[rows] = (np.empty((rows, 5), np.float32), np.empty(rows, np.int64))
        return bufs[rows]

    for (xa, ya), (xb, yb) in zip(dev.epoch(0), host.epoch(0, out=out), strict=True):
        assert xb is bufs[len(xb)][0] and yb is bufs[len(yb)][1]
        assert_array_equal(xa, xb)
        assert_array_equal(ya, yb)
    with pytest.raises(ValueError, match="do not fit"):
        next(host.epoch(0, out=lambda rows: (np.empty((rows, 5), np.float64), np.empty(rows, np.int64))))


def test_the_table_is_not_copied_when_it_has_the_dtype_already() -> None:
    x, y = _data()
    x32 = x.astype(np.float32)
    host = HostLoader(x32, y, 64, xp=np, dtype=np.float32, shuffle=True, drop_last=False, seed=0)
    assert host.x is x32  # read in place: no copy of the split
    cast = HostLoader(x, y, 64, xp=np, dtype=np.float32, shuffle=True, drop_last=False, seed=0)
    assert cast.x.dtype == np.float32 and not np.shares_memory(cast.x, x)
    assert_array_equal(cast.x, x32)
    fortran = np.asfortranarray(x32)
    assert host_table(fortran, np.dtype(np.float32)).flags.c_contiguous


def test_a_large_batch_is_gathered_on_threads_as_on_one() -> None:
    from concurrent.futures import ThreadPoolExecutor

    class Counting(ThreadPoolExecutor):
        parts: list[int] = []

        def map(self, fn, *its, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            cuts = list(its[0])
            self.parts.append(len(cuts))
            return super().map(fn, cuts, **kw)

    x = np.random.default_rng(0).normal(size=(40_000, 64)).astype(np.float32)  # 256 bytes a row
    idx = np.random.default_rng(1).permutation(40_000)[:30_001]  # 7.7 MB: 8 threads' shares of at least 1 MiB
    one, many = np.empty((30_001, 64), np.float32), np.empty((30_001, 64), np.float32)
    take_rows(x, idx, one, None)
    labels = np.arange(40_000)
    small = np.empty(30_001, labels.dtype)
    with Counting(4) as pool:
        take_rows(x, idx, many, pool)
        take_rows(labels, idx, small, pool)  # 240 kB: on the calling thread, not the pool
    assert Counting.parts == [7]
    assert_array_equal(one, x[idx])
    assert_array_equal(many, x[idx])
    assert_array_equal(small, idx)


# --- the pipe ------------------------------------------------------------------------------------


def test_the_pipe_yields_in_order_and_runs_at_most_slots_ahead() -> None:
    consumed = [0]
    ahead = []

    def produce(k: int, item: int) -> int:
        ahead.append(item - consumed[0])  # how far ahead of the consumer this item is made
        assert k == item % 3
        return item * 10

    got = []
    for k, value in Pipe(range(50), produce, slots=3):
        time.sleep(0.001)  # a slow consumer: the producer fills the ring
        got.append((k, value))
        consumed[0] += 1
    assert got == [(i % 3, i * 10) for i in range(50)]
    assert max(ahead) <= 3 and max(ahead) >= 2  # the ring was full at times, never over


def test_a_failure_in_the_producer_is_raised_at_its_item() -> None:
    def produce(k: int, item: int) -> int:
        if item == 4:
            raise OSError("disk gone at item 4")
        return item

    got = []
    with pytest.raises(OSError, match="item 4"):
        for _, value in Pipe(range(10), produce, slots=2):
            got.append(value)
    assert got == [0, 1, 2, 3]


def test_a_consumer_that_stops_early_stops_the_producer() -> None:
    made = []
    pipe = Pipe(range(10_000), lambda k, item: made.append(item) or item, slots=2, name="test-early")
    for _, value in pipe:
        if value == 3:
            break
    pipe.close()
    assert not pipe._thread.is_alive() and len(made) <= 4 + 2
    assert not any(t.name == "mlptrain-test-early" for t in threading.enumerate())
    with pytest.raises(ValueError, match="slots=0"):
        Pipe(range(3), lambda k, item: item, slots=0)


# --- the choice, and a run ---------------------------------------------------------------------


def _fake_gpu(free: int) -> SimpleNamespace:
    return SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(memGetInfo=lambda: (free, 4 * free))))


def test_auto_keeps_the_splits_on_the_device_where_they_fit_and_in_host_memory_where_not() -> None:
    cfg = make_cfg()
    ds = Trainer(cfg).dataset  # digits: 1797 rows x 64 features, 0.5 MB in float32
    f32 = np.dtype(np.float32)
    assert residency(cfg.data, ds, _fake_gpu(10**9), f32) == "device"
    assert residency(cfg.data, ds, _fake_gpu(100_000), f32) == "host"
    assert residency(cfg.data, ds, np, f32) == "device"  # the CPU: a copy of each split
    cfg.data.residency = "device"
    with pytest.raises(ResourceError, match=r"data\.residency=host"):
        residency(cfg.data, ds, _fake_gpu(100_000), f32)
    cfg.data.residency = "host"
    assert residency(cfg.data, ds, _fake_gpu(10**9), f32) == "host"
    cfg.data.residency = "disk"
    with pytest.raises(ConfigError, match="data.residency='disk'"):
        residency(cfg.data, ds, np, f32)


def test_a_host_resident_trainer_takes_the_same_steps() -> None:
    cfg = make_cfg(data__batch_size=100, optimizer__lr=0.1)
    dev, host = Trainer(cfg), Trainer(make_cfg(data__batch_size=100, optimizer__lr=0.1, data__residency="host"))
    assert isinstance(host.train_loader, HostLoader) and all(
        isinstance(v, HostLoader) for v in host.eval_loaders.values()
    )
    assert type(dev.train_loader) is DataLoader
    for tr in (dev, host):
        tr.losses = [float(tr.step(x, y)[0]) for epoch in range(2) for x, y in tr.train_batches(epoch)]
    assert len(host.losses) == 2 * host.steps_per_epoch and host.losses == dev.losses
    assert host.evaluate("test") == dev.evaluate("test")


def test_a_host_resident_run_writes_the_resident_runs_records(tmp_path) -> None:  # noqa: ANN001
    train(make_cfg(epochs=2), tmp_path / "device")
    train(make_cfg(epochs=2, data__residency="host"), tmp_path / "host")
    got, expected = records(tmp_path / "host"), records(tmp_path / "device")
    assert [r for r in got if r["kind"] == "step"] == [r for r in expected if r["kind"] == "step"]
    assert [r for r in got if r["kind"] == "epoch"] == [r for r in expected if r["kind"] == "epoch"]
