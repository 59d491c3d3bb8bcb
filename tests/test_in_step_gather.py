"""A step that gathers its own batch (StepBatches.epoch, DataLoader.gather_in_step): the same batches.

On the GPU a replayed step gathers its batch with its first kernels, reading the step count on the device;
here the same path runs on the CPU (turned on by hand), and must give the run the batches, and so the per-step
losses, of the loader gathering each batch before the step: from the start, and from inside an epoch (resume).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_cfg

from mlptrain.step.trainer import Trainer


def losses(tr: Trainer, epochs: int, start: tuple[int, int] = (0, 0), own: bool = False) -> list[float]:
    out = []
    first_epoch, first_batch = start
    for epoch in range(first_epoch, epochs):
        batch = first_batch if epoch == first_epoch else 0
        batches = tr.train_batches(epoch, batch) if own else tr.train_loader.epoch(epoch, batch)
        for x, y in batches:
            out.append(float(tr.step(x, y)[0]))
    return out


@pytest.mark.parametrize("batch_size", [64, 100])  # 1257 train rows: a short last batch of 41 or 57
def test_the_step_gathers_the_batches_the_loader_would(batch_size: int) -> None:
    cfg = make_cfg(data__batch_size=batch_size, epochs=3, optimizer__lr=0.1)
    expected = losses(Trainer(cfg), 3)
    tr = Trainer(cfg)
    tr.batches.gathers_in_step = True
    got = losses(tr, 3, own=True)
    assert len(got) == 3 * tr.steps_per_epoch and got == expected  # bit for bit, the short batches included
    assert sorted(tr.batches._own_batches) == sorted({batch_size, len(tr.train_loader.x) % batch_size})


def test_from_inside_an_epoch_it_continues_with_the_right_batch() -> None:
    cfg = make_cfg(data__batch_size=64, epochs=2)
    expected = losses(Trainer(cfg), 2)
    tr = Trainer(cfg)
    tr.batches.gathers_in_step = True
    head = losses(tr, 1, own=True)[:7]  # the first 7 steps, then a new trainer resumes at epoch 0, batch 7
    again = Trainer(cfg)
    again.batches.gathers_in_step = True
    steps = Trainer(cfg)  # the same 7 steps on a third trainer, so that its parameters are those of step 7
    for x, y in list(steps.train_loader.epoch(0))[:7]:
        steps.step(x, y)
    arrays, meta = steps.state_dict()
    again.load_state_dict(arrays, meta, step=7, where="test")
    tail = losses(again, 2, start=(0, 7), own=True)
    assert head == expected[:7] and tail == expected[7:]


def test_the_order_is_placed_before_the_first_step_of_each_epoch() -> None:
    tr = Trainer(make_cfg(data__batch_size=64))
    tr.batches.gathers_in_step = True
    ld = tr.train_loader
    batches = tr.train_batches(1, 2)
    x, y = next(batches)
    np.testing.assert_array_equal(ld._order, ld.permutation(1))
    assert int(ld._base[0]) == tr.step_count - 2  # step count 0 stands at batch 2 of epoch 1
    ld.gather_in_step(x, y, tr.clock.device)
    idx = ld.permutation(1)[2 * 64 : 3 * 64]
    np.testing.assert_array_equal(x, ld.x[idx])
    np.testing.assert_array_equal(y, ld.y[idx])


@pytest.mark.parametrize("folds", [0, 3])  # the same rows for every member; cross-validation's own rows per member
def test_an_ensembles_step_gathers_the_stacked_batches_its_loader_would(folds: int) -> None:
    """MemberLoader under a CUDA graph: the members' orders laid out batch by batch on the device, and the step's
    stacked batch (K, B, F) one gather of K * B positions; every step's losses bit for bit as the loader's batches,
    the short last batch and a start inside the epoch included."""
    from test_ensemble import make_cfg as ensemble_cfg

    from mlptrain.run.ensemble import EnsembleTrainer

    cfg = ensemble_cfg(size=3, epochs=2)
    cfg.data.batch_size = 100  # digits' 1257 training rows (folds: 2/3 of the pool): a short last batch
    cfg.ensemble.folds = folds

    def member_losses(tr: EnsembleTrainer, own: bool, start: int = 0) -> list[list[float]]:
        out = []
        for epoch in range(2):
            batch = start if epoch == 0 else 0
            batches = tr.train_batches(epoch, batch) if own else tr.train_loader.epoch(epoch, batch)
            out += [np.asarray(tr.step(x, y)[0]).tolist() for x, y in batches]
        return out

    expected = member_losses(EnsembleTrainer(cfg), own=False)
    tr = EnsembleTrainer(cfg)
    tr.batches.gathers_in_step = True
    got = member_losses(tr, own=True)
    ld = tr.train_loader
    assert len(got) == 2 * len(ld) and got == expected
    assert len(ld.row_counts()) == 2  # the short last batch was gathered in the step too
    order = ld.step_order(1)
    rows = ld.orders(1)[:, 100:200]  # (K, 100): batch 1 of epoch 1, member by member
    np.testing.assert_array_equal(order[3 * 100 : 6 * 100], rows.reshape(-1))
    again = EnsembleTrainer(cfg)  # from batch 5 of epoch 0, on a fresh trainer: its own batches 5, 6, ...
    again.batches.gathers_in_step = True
    fresh = EnsembleTrainer(cfg)
    assert member_losses(again, own=True, start=5)[:3] == member_losses(fresh, own=False, start=5)[:3]
