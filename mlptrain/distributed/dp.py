"""The data-parallel step's arithmetic: shards of a global batch, and the global gradient from the ranks'.

A run on ``world`` ranks with global batch ``B`` must take the steps a one-rank run with batch ``B``
takes. Every rank draws the same global order (the loader's seed), and rank ``r`` takes the
contiguous rows :func:`shard_rows` gives it, ``n_r`` of the ``n`` rows of each global batch. Its loss
is the mean over its ``n_r`` rows, so its gradient ``g_r`` is a mean too; the gradient of the global
mean is ``sum_r (n_r / n) g_r``.

:class:`GradientSync` gets there without a pass over the gradients of its own and without the host:

1. the backward runs with the loss scale times ``n_r / B`` (:meth:`GradientSync.grad_scale`, one
   scalar), so rank ``r``'s gradients come out as ``(n_r / B) g_r``: for a full batch
   ``g_r / world``, the size one GPU's gradients have (the fp16 overflow check sees the same range);
2. one all-reduce sums them, with the step's ``[loss x n_r, correct, n_r]``;
3. the optimizer's gradient multiplier (the inverse loss scale) is multiplied by ``B / n``, ``n``
   the reduced row count, still on the device: 1 for a full batch, and the weights ``n_r / n``
   for a short last batch. ``n`` is never a host constant: a rank's shard size alone does not
   say how large the global batch was, and a CUDA graph replays whatever constant it captured.

Every rank then holds the same bytes (the all-reduce gives every rank the same sums), so the
overflow check skips the same steps everywhere, and every optimizer makes the same update.
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
    """Make this rank's gradients, loss and count those of the global batch (see the module docstring).

    Args:
        comm: this rank's communicator.
        batch_size: the global batch size ``B`` of the run.
        xp: the array module of the step (NumPy or CuPy).
        bucket_bytes: the weight gradients made so far are all-reduced together once they reach this
            size (``distributed.bucket_mib``; PyTorch DDP's ``bucket_cap_mb`` is 25 too): every layer
            of a large model goes alone, as soon as it is made; a small model's go in the final
            group, one NCCL launch instead of one per layer (each costs its latency).
    """

    def __init__(self, comm: Communicator, batch_size: int, xp: Any = np, bucket_bytes: int = 25 * 2**20) -> None:
        self.comm = comm
        self.batch_size = batch_size
        self.xp = xp
        self.bucket_bytes = bucket_bytes
        self._bucket: list[Any] = []  # weight gradients made but not yet sent
        self.stream: Any = None  # GPU: where the all-reduces run (the weight gradients' stream)
        self._early: list[Any] = []  # the gradients this step reduced already (:meth:`weight_grad_ready`)

    def overlap(self, model: Any) -> None:
        """Buckets: the weight gradients the side stream made (:attr:`mlptrain.nn.network.MLP.on_weight_grad`)
        are all-reduced there as soon as they reach ``bucket_bytes``, while the backward goes on below;
        the rest (a bucket not filled, the bottom layer's, the biases, the step's statistics) at the end.
        Every collective runs on that one stream, in the same order on every rank (NCCL's rule for one
        communicator)."""
        self.stream = model.side_stream
        if self.stream is not None:
            model.on_weight_grad = self.weight_grad_ready

    def weight_grad_ready(self, param: Any) -> None:
        """``param.grad`` was just enqueued on the current (side) stream: send the bucket once it is full."""
        self._bucket.append(param)
        if sum(int(p.grad.nbytes) for p in self._bucket) >= self.bucket_bytes:
            self.comm.all_reduce([p.grad for p in self._bucket])  # on the side stream, right after the GEMM
            self._early += self._bucket
            self._bucket = []

    def grad_scale(self, scale: Any, rows: int) -> Any:
        """The loss scale of this rank's backward: ``scale x rows / B`` (a 0-d device array)."""
        return scale * (rows / self.batch_size)

    def __call__(self, params: list[Any], loss: Any, correct: Any, rows: int, inv_scale: Any) -> tuple:
        """All-reduce after the backward; returns the global ``(loss, correct, rows, inv_scale)``.

        ``rows`` of the result is a 0-d array (the global batch's rows), ``inv_scale`` the
        optimizer's gradient multiplier for the reduced gradients.
        """
        xp = self.xp
        wide = np.float64 if loss.dtype == np.float64 or xp is np else np.float32
        # [loss x n_r, correct, n_r]: the sums give the global mean loss, the correct count and n
        stats = xp.stack([loss.astype(wide) * rows, xp.asarray(correct).astype(wide), xp.full((), rows, wide)])
        early = {id(p) for p in self._early}
        rest = [p.grad for p in params if id(p) not in early]
        self._early.clear()
        self._bucket = []  # (not full: its gradients go in the final group)
        if self.stream is None:
            self.comm.all_reduce([*rest, stats])
        else:  # after the main stream's work so far, on the stream of the early all-reduces; joined back
            self.comm.all_reduce([*rest, stats], stream=self.stream)
        total = stats[2].astype(np.float64)  # the step log takes the rows as a 0-d float64
        mean_loss = (stats[0] / stats[2]).astype(loss.dtype)
        factor = (self.batch_size / total).astype(inv_scale.dtype)  # 1 for a full batch, exactly
        return mean_loss, stats[1].astype(xp.asarray(correct).dtype), total, inv_scale * factor
