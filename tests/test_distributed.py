"""Data parallelism on the CPU (mlptrain.distributed) with in-process ranks: the logic NCCL will carry."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from helpers import make_cfg

from mlptrain.base.errors import ConfigError
from mlptrain.data.loader import DataLoader
from mlptrain.distributed.comm import LocalGroup
from mlptrain.distributed.dp import shard_rows
from mlptrain.step.trainer import Trainer


@pytest.mark.parametrize(("n", "world"), [(64, 2), (65, 2), (10, 3), (7, 7), (100, 8)])
def test_shards_cover_the_batch_in_order_and_differ_by_at_most_a_row(n, world):
    rows = [range(n)[shard_rows(n, r, world)] for r in range(world)]
    assert [i for r in rows for i in r] == list(range(n))
    assert max(map(len, rows)) - min(map(len, rows)) <= 1


def test_sharded_loaders_yield_the_global_batches_between_them():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((51, 3)), rng.integers(0, 4, 51)  # batches 16, 16, 16, 3
    opts = {"xp": np, "dtype": np.float64, "shuffle": True, "drop_last": False, "seed": 5}
    whole = list(DataLoader(x, y, 16, **opts).epoch(2))
    parts = [list(DataLoader(x, y, 16, shard=(r, 3), **opts).epoch(2)) for r in range(3)]
    for i, (xb, yb) in enumerate(whole):
        np.testing.assert_array_equal(np.concatenate([p[i][0] for p in parts]), xb)
        np.testing.assert_array_equal(np.concatenate([p[i][1] for p in parts]), yb)


def test_a_last_batch_smaller_than_the_group_is_refused_clearly():
    x, y = np.zeros((33, 2)), np.zeros(33, np.int64)
    opts = {"xp": np, "dtype": np.float64, "shuffle": False, "seed": 0}
    with pytest.raises(ConfigError, match="has 1 rows, fewer than the 4 ranks; set drop_last=true"):
        DataLoader(x, y, 8, drop_last=False, shard=(0, 4), **opts)
    assert len(DataLoader(x, y, 8, drop_last=True, shard=(0, 4), **opts)) == 4


def _run(world: int, steps: int, **cfg_overrides):
    """Per-step global losses and each rank's parameters after every step, ranks as threads."""
    cfg = make_cfg(data__batch_size=63, precision__name="fp64", **cfg_overrides)
    group = LocalGroup(world) if world > 1 else None
    out = {"loss": [[] for _ in range(world)], "rows": [[] for _ in range(world)], "params": [[] for _ in range(world)]}
    errors = []

    def rank(r: int) -> None:
        try:
            tr = Trainer(cfg, comm=group.communicator(r) if group else None)
            done = 0
            for epoch in range(10):
                for x, y in tr.train_loader.epoch(epoch):
                    loss, _ = tr.step(x, y)
                    out["loss"][r].append(float(loss))
                    out["rows"][r].append(len(y))
                    out["params"][r].append([p.value.copy() for p in tr.model.params])
                    done += 1
                    if done == steps:
                        return
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    loss = np.array(out["loss"])  # (world, steps): every rank returns the global batch's mean loss
    for r in range(1, world):
        np.testing.assert_array_equal(loss[r], loss[0])  # the same reduced bytes on every rank
    rows = np.array(out["rows"])
    assert (rows.sum(axis=0) <= 63).all() and (rows.max(axis=0) - rows.min(axis=0) <= 1).all()
    return loss[0], out["params"]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_ranks_take_the_steps_of_one_with_the_global_batch(optimizer):
    """digits, batch 63 split 32 + 31 (unequal shards: their gradients must be weighted by rows), the
    short last batch too: the same per-step losses as one rank in fp64 within 1e-12 relative, and both
    ranks' parameters bit-identical after every step."""
    steps = 30  # past the first epoch's short last batch (17 steps per epoch)
    one, _ = _run(1, steps, optimizer__name=optimizer)
    two, params = _run(2, steps, optimizer__name=optimizer)
    np.testing.assert_allclose(two, one, rtol=1e-12)
    for step in range(steps):
        for a, b in zip(params[0][step], params[1][step], strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_rank_that_never_arrives_makes_the_others_fail_not_hang():
    group = LocalGroup(2, timeout=0.5)
    comm = group.communicator(0)
    with pytest.raises(threading.BrokenBarrierError):
        comm.all_reduce([np.ones(3)])


# --- launch: the environment launchers set, and the NCCL id's rendezvous -----------------------


def test_torchrun_and_mpirun_environments_are_read():
    from mlptrain.distributed.launch import DistEnv

    assert DistEnv.from_environ({}) is None  # no launcher: a single process
    tr = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert DistEnv.from_environ(tr) == DistEnv(1, 4, 1, "node0", 29500, "torchrun")
    mpi = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "12345",
    }
    assert DistEnv.from_environ(mpi) == DistEnv(3, 8, 1, "10.0.0.1", 12345, "mpirun")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK is not set"),
        ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"RANK='x'; expected an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "expected 0 <= rank < world size"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "without MASTER_ADDR"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
            "expected a TCP port",
        ),
    ],
)
def test_bad_launcher_environments_are_named(env, message):
    from mlptrain.distributed.launch import DistEnv

    with pytest.raises(ConfigError, match=message):
        DistEnv.from_environ(env)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(world: int, arrive: int, timeout: float) -> list:
    from mlptrain.distributed.launch import DistEnv, rendezvous

    port = _free_port()
    results: list = [None] * arrive

    def run(r: int) -> None:
        env = DistEnv(r, world, r, "127.0.0.1", port, "torchrun")
        try:
            results[r] = rendezvous(env, b"nccl-id-\x00\xff" * 16 if r == 0 else None, timeout=timeout)
        except Exception as exc:
            results[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in reversed(range(arrive))]  # rank 0 starts last
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_rank_0s_id_reaches_every_rank():
    results = _ranks(world=4, arrive=4, timeout=10)
    assert results == [b"nccl-id-\x00\xff" * 16] * 4


def test_a_rank_that_never_connects_fails_rank_0_within_the_timeout():
    results = _ranks(world=3, arrive=2, timeout=1.0)
    assert isinstance(results[0], TimeoutError) and "1 of 2 ranks never connected" in str(results[0])
    assert results[1] == b"nccl-id-\x00\xff" * 16


def test_a_rank_without_rank_0_fails_within_the_timeout():
    from mlptrain.distributed.launch import DistEnv, rendezvous

    env = DistEnv(1, 2, 1, "127.0.0.1", _free_port(), "torchrun")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="could not reach rank 0 at 127.0.0.1"):
        rendezvous(env, None, timeout=0.5)
    assert time.monotonic() - t0 < 5


def test_evaluation_is_split_across_ranks_and_reduced():
    """Each rank scores its rows of val and test; the all-reduced sums are the whole split's."""
    cfg = make_cfg(data__batch_size=64, precision__name="fp64", data__eval_batch_size=50)
    one = Trainer(cfg).evaluate("test")
    group = LocalGroup(3)
    results: list = [None] * 3

    def rank(r: int) -> None:
        tr = Trainer(cfg, comm=group.communicator(r))
        assert tr.eval_loaders["test"].num_samples < len(tr.dataset.y_test)  # a third of the rows each
        results[r] = tr.evaluate("test")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for res in results:
        assert res["test/acc"] == one["test/acc"]
        np.testing.assert_allclose(res["test/loss"], one["test/loss"], rtol=1e-12)
    assert results[0] == results[1] == results[2]  # the same bytes on every rank


class _Recorder:
    """A communicator that records what each all-reduce call got (and on which stream), summing nothing."""

    rank, world = 0, 1

    def __init__(self) -> None:
        self.calls: list[tuple[list, object]] = []

    def all_reduce(self, arrays, stream=None):
        self.calls.append((list(arrays), stream))


def test_weight_gradients_are_reduced_by_layer_as_the_side_stream_makes_them_and_the_rest_at_the_end():
    """The bucketing: one all-reduce per layer whose weight gradient the side stream made (top layer
    first, as the backward makes them), then one group with the bottom layer's weight gradient, every
    bias gradient and the step's statistics, on the same stream."""
    from types import SimpleNamespace

    from mlptrain.distributed.dp import GradientSync

    comm, side = _Recorder(), object()
    params = [
        SimpleNamespace(name=n, grad=np.full(3, i, np.float64))
        for i, n in enumerate(["l0.w", "l0.b", "l1.w", "l1.b", "l2.w", "l2.b"])
    ]
    model = SimpleNamespace(side_stream=side, on_weight_grad=None)
    sync = GradientSync(comm, batch_size=64, bucket_bytes=1)  # every layer's gradient fills a bucket
    sync.overlap(model)
    assert model.on_weight_grad == sync.weight_grad_ready
    model.on_weight_grad(params[4])  # layer 2's dW, then layer 1's: the order of the backward
    model.on_weight_grad(params[2])
    loss, correct, rows, inv = sync(params, np.float64(0.5), np.int64(30), 32, np.float64(1.0))

    def which(a):
        return next((i for i, p in enumerate(params) if a is p.grad), "stats")

    got = [([which(a) for a in arrays], stream) for arrays, stream in comm.calls]
    assert got == [([4], None), ([2], None), ([0, 1, 3, 5, "stats"], side)]
    # one rank: the statistics come back as they went, and a full batch leaves the multiplier at 1
    assert (loss, correct, rows, inv) == (0.5, 30, 32.0, 2.0)  # 32 of 64 rows: B / n = 2


def test_without_a_side_stream_everything_goes_in_one_group():
    from types import SimpleNamespace

    from mlptrain.distributed.dp import GradientSync

    comm = _Recorder()
    params = [SimpleNamespace(grad=np.ones(2)) for _ in range(4)]
    model = SimpleNamespace(side_stream=None, on_weight_grad=None)
    sync = GradientSync(comm, batch_size=8)
    sync.overlap(model)
    assert model.on_weight_grad is None
    sync(params, np.float64(1.0), np.int64(8), 8, np.float64(0.25))
    assert len(comm.calls) == 1 and len(comm.calls[0][0]) == 5 and comm.calls[0][1] is None


@pytest.mark.parametrize(
    ("cap", "calls"), [(48, [[4, 2], [0, 1, 3, 5, "stats"]]), (10**6, [[0, 1, 2, 3, 4, 5, "stats"]])]
)
def test_small_weight_gradients_share_a_bucket(cap, calls):
    """Buckets of at least ``bucket_bytes``: two 24-byte gradients fill a 48-byte bucket together; a
    bucket never filled (a small model: DDP's 25 MiB) goes with the final group, one launch in all."""
    from types import SimpleNamespace

    from mlptrain.distributed.dp import GradientSync

    comm, side = _Recorder(), object()
    params = [SimpleNamespace(grad=np.full(3, i, np.float64)) for i in range(6)]  # 24 bytes each
    model = SimpleNamespace(side_stream=side, on_weight_grad=None)
    sync = GradientSync(comm, batch_size=8, bucket_bytes=cap)
    sync.overlap(model)
    model.on_weight_grad(params[4])
    model.on_weight_grad(params[2])
    sync(params, np.float64(1.0), np.int64(8), 8, np.float64(1.0))

    def which(a):
        return next((i for i, p in enumerate(params) if a is p.grad), "stats")

    assert [[which(a) for a in arrays] for arrays, _ in comm.calls] == calls
    model.on_weight_grad(params[4])  # the next step starts with an empty bucket
    assert sync._bucket == [params[4]]


def test_under_torchrun_the_id_goes_through_torchruns_own_store(monkeypatch):
    """torchrun's agent already listens at MASTER_ADDR:MASTER_PORT (its TCPStore): rank 0 puts the id
    there as a client, the others read it; no server of mlptrain's own tries to take the port."""
    import sys
    import types

    from mlptrain.distributed.launch import DistEnv, exchange_id

    shared: dict = {}
    made: list = []

    class FakeStore:
        def __init__(self, host, port, is_master, timeout):
            made.append((host, port, is_master))

        def set(self, key, value):
            shared[key] = value

        def get(self, key):
            deadline = time.monotonic() + 5
            while key not in shared and time.monotonic() < deadline:
                time.sleep(0.01)
            return shared[key]

    dist = types.ModuleType("torch.distributed")
    dist.TCPStore = FakeStore
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    out: list = [None, None]

    def run(r):
        env = DistEnv(r, 2, r, "host0", 29500, "torchrun")
        out[r] = exchange_id(env, b"id" * 64 if r == 0 else None, environ={"TORCHELASTIC_RESTART_COUNT": "1"})

    ts = [threading.Thread(target=run, args=(r,)) for r in (1, 0)]
    [t.start() for t in ts]
    [t.join(10) for t in ts]
    assert out == [b"id" * 64] * 2
    assert made == [("host0", 29500, False)] * 2 and list(shared) == ["mlptrain/nccl_unique_id/1"]


def test_mlptrain_rdzv_port_chooses_mlptrains_own_rendezvous_and_its_port():
    from mlptrain.distributed.launch import DistEnv, exchange_id

    port = _free_port()
    out: list = [None, None]

    def run(r):
        env = DistEnv(r, 2, r, "127.0.0.1", 1, "torchrun")  # MASTER_PORT unused: MLPTRAIN_RDZV_PORT decides
        out[r] = exchange_id(env, b"x" * 128 if r == 0 else None, timeout=10, environ={"MLPTRAIN_RDZV_PORT": str(port)})

    ts = [threading.Thread(target=run, args=(r,)) for r in (1, 0)]
    [t.start() for t in ts]
    [t.join(20) for t in ts]
    assert out == [b"x" * 128] * 2
    with pytest.raises(ConfigError, match="MLPTRAIN_RDZV_PORT='http'; expected a TCP port number"):
        exchange_id(DistEnv(1, 2, 1, "127.0.0.1", 1, "mpirun"), None, environ={"MLPTRAIN_RDZV_PORT": "http"})


def test_launcher_variables_on_a_machine_without_a_gpu_are_one_line_and_leave_nothing(tmp_path):
    """torchrun's RANK, WORLD_SIZE ... where there is no GPU: exit 2, one line, no run folder (#28.10)."""
    import os
    import subprocess
    import sys

    from test_cli import REPO

    from mlptrain.base.backend import probe_gpu

    if probe_gpu()[0]:
        pytest.skip("this machine has a GPU")
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR",)}
    launcher = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    env.update(PYTHONPATH=str(REPO), **launcher)
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "mlptrain", "epochs=1", f"hydra.run.dir={run}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert "torchrun started rank 0 of 2" in line and "no GPU" in line, line
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not run.exists(), "nothing is left behind"
