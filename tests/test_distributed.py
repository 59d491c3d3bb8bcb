"""Data parallelism on the CPU (mlptrain.distributed) with in-process ranks: the logic NCCL will carry."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import make_cfg

from mlptrain.config import OptimizerName, PrecisionName
from mlptrain.distributed.comm import LocalGroup
from mlptrain.distributed.dp import shard_rows
from mlptrain.errors import ConfigError
from mlptrain.loader import DataLoader
from mlptrain.trainer import Trainer


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
    cfg = make_cfg(data__batch_size=63, precision__name=PrecisionName.fp64, **cfg_overrides)
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
    loss = np.array(out["loss"])  # (world, steps), each rank's mean over its rows
    rows = np.array(out["rows"])
    return (loss * rows).sum(axis=0) / rows.sum(axis=0), out["params"]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_ranks_take_the_steps_of_one_with_the_global_batch(optimizer):
    """digits, batch 63 split 32 + 31 (unequal shards: their gradients must be weighted by rows), the
    short last batch too: the same per-step losses as one rank in fp64 within 1e-12 relative, and both
    ranks' parameters bit-identical after every step."""
    steps = 30  # past the first epoch's short last batch (17 steps per epoch)
    one, _ = _run(1, steps, optimizer__name=OptimizerName(optimizer))
    two, params = _run(2, steps, optimizer__name=OptimizerName(optimizer))
    np.testing.assert_allclose(two, one, rtol=1e-12)
    for step in range(steps):
        for a, b in zip(params[0][step], params[1][step], strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_rank_that_never_arrives_makes_the_others_fail_not_hang():
    import threading as th

    group = LocalGroup(2, timeout=0.5)
    comm = group.communicator(0)
    with pytest.raises(th.BrokenBarrierError):
        comm.all_reduce([np.ones(3)])
