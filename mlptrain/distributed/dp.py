"""The data-parallel step's arithmetic: shards of a global batch, and the global gradient from the ranks'.

A run on ``world`` ranks with global batch ``B`` must take the steps a one-rank run with batch ``B``
takes. Every rank draws the same global order (the loader's seed), and rank ``r`` takes the
contiguous rows :func:`shard_rows` gives it, ``n_r`` of the ``n`` rows of each global batch. Its loss
is the mean over its ``n_r`` rows, so its gradient ``g_r`` is a mean too; the gradient of the global
mean is ``sum_r (n_r / n) g_r``. :class:`GradientSync` computes it with one all-reduce of the
gradients scaled by ``n_r`` and of ``n_r`` itself, then divides by the reduced ``n``. Every rank gets
the same bytes, so every rank's optimizer makes the same update and the parameters stay identical.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlptrain.distributed.comm import Communicator


def shard_rows(n: int, rank: int, world: int) -> slice:
    """The rows of an ``n``-row global batch that rank ``rank`` of ``world`` takes: contiguous, the
    first ``n % world`` ranks one row more. ``n`` may be below ``world`` (a short last batch): the
    ranks past ``n`` get none."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world}")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


class GradientSync:
    """Make every parameter's gradient the gradient of the global batch (see the module docstring)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def __call__(self, params: list[Any], rows: int) -> None:
        """``params``' gradients of this rank's mean loss over ``rows`` rows -> those of the global mean."""
        grads = [p.grad for p in params]
        for g in grads:
            g *= rows  # the gradient of this rank's summed loss
        count = np.array([float(rows)])
        self.comm.all_reduce([*grads, count])
        for g in grads:
            g /= count[0]  # the global mean's gradient, the same bytes on every rank
