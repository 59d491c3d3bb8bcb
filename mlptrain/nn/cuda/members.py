"""An ensemble's per-member sums on the GPU: the GPU half of :mod:`mlptrain.nn.members`, two small kernels.

After the loss's row kernel (``mlptrain_xent_thread_rows`` or ``mlptrain_xent_rows`` over the stacked logits' ``K * B``
rows), an ensemble's step still has small reductions: each member's mean loss and correct count, the epoch's running
sums per member, and the two 0-d values the step log records (the members' mean loss and mean count). As CuPy array
operations they are a dozen launches of tiny kernels (CUB's segmented and single-tile reductions, a divide, casts,
adds, a floor divide), each costing about as much GPU time in a replayed CUDA graph as the work it does. Here they
are two:

1. :func:`member_means` (``mlptrain_member_means``, in the loss): ``(K * B,)`` row losses and flags ->
   ``loss (K,)`` float32 and ``correct (K,)`` int64. One block of 1024 threads (32 warps); each member gets
   ``W`` warps (as many as ``K`` leaves: ``W K <= 32``; 1 past 32 members, which then take turns). Each lane sums
   its member's rows ``lane, lane + 32 W, ...`` in float64, a shuffle tree sums the warp, and the member's first
   lane adds its ``W`` warps' partials in warp order: a fixed order, so the same bits on every replay, and no
   atomics. (The single model's ``mlptrain_xent_mean`` sums in float64 too; its order is a 256-thread tree.)
2. :func:`tally_members` (``mlptrain_member_tally``, in the step's bookkeeping): thread ``k`` adds member ``k``'s
   ``loss[k] * rows`` (rounded to the loss's dtype first, as ``loss * rows`` is) and ``correct[k]`` to the epoch's
   ``(K,)`` sums, and thread 0 writes the members' mean loss and ``(sum(correct) + K // 2) // K``. It reads the epoch's
   sums, so it runs once per step (:meth:`mlptrain.run.ensemble.EnsembleTrainer.step_metrics`), never where the
   forward and backward run alone (a graph's warm-up, the bgrad probe).

Both launch with no host sync and allocate only their outputs, so a CUDA graph captures them; ``rows`` (a host
int per batch size) is a kernel argument, fixed in each batch shape's graph. The NumPy formulas they follow are
:meth:`~mlptrain.run.ensemble.EnsembleTrainer.step_metrics`' CPU path and :class:`~mlptrain.nn.members.MemberHead`'s.

Nothing in the backward waits for either: the loss gradient comes from the row kernel, and what reads the means
(the step's returned losses and counts, the step log in the update kernel's last block) comes after the backward.
So in a training step they run on a stream of their own (:class:`MemberSums`), beside the backward's chain of GEMMs,
where on the main stream they were two more small kernels (and their launch gaps) between the loss and the
update; the main stream waits for the means at the backward's end and for the tally before the update::

    main:  rows ─┬─ head dgrad ── dX ── ... ── dW ── (waits: means) ── check ── (waits: tally) ── update
    sums:        └─ member_means ── member_tally   (the tally is enqueued after the backward, runs when it can)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import cupy as cp
import numpy as np

from mlptrain.base.cuda_source import Job

THREADS = 1024  # one block: 32 warps shared among the members

_MEANS_PREP = r"""
__shared__ double warp_loss[32];
__shared__ long long warp_ok[32];
"""

_MEANS = r"""
// One block of 1024 threads; this body runs once per thread (i = threadIdx.x).
const int lane = i & 31, warp = i >> 5;
int W = 1;  // warps per member: the most that K members leave (a power of two, W K <= 32)
while (2 * W * K <= 32) W *= 2;
const int at_once = 32 / W;  // members summed at once
const int slot = warp / W, part = warp % W;  // this warp's member in the turn, and its share of the rows
for (long long first = 0; first < K; first += at_once) {
    const long long k = first + slot;
    double s = 0.0;
    long long ok = 0;
    if (k < K) {  // rows part * 32 + lane, then every 32 W-th: row_loss (K * B,), member k's at k * B
        for (long long r = part * 32 + lane; r < B; r += 32 * W) {
            s += (double)row_loss[k * B + r];
            ok += row_ok[k * B + r];
        }
    }
    for (int off = 16; off > 0; off >>= 1) {  // a fixed shuffle tree: lane 0 holds the warp's sum
        s += __shfl_down_sync(0xffffffffu, s, off);
        ok += __shfl_down_sync(0xffffffffu, ok, off);
    }
    if (lane == 0) { warp_loss[warp] = s; warp_ok[warp] = ok; }
    __syncthreads();
    if (part == 0 && lane == 0 && k < K) {  // the member's W warps, in warp order
        double total = 0.0;
        long long n = 0;
        for (int w = 0; w < W; ++w) { total += warp_loss[warp + w]; n += warp_ok[warp + w]; }
        loss[k] = (float)(total / (double)B);  // the mean of member k's B row losses
        correct[k] = n;
    }
    __syncthreads();  // warp_loss is read before the next turn writes it
}
"""

_TALLY_PREP = r"""
__device__ float mlptrain_mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ double mlptrain_mul_rn(double a, double b) { return __dmul_rn(a, b); }
"""

_TALLY = r"""
// K threads, thread i member i's sums (independent: no thread waits on another's memory), and thread 0 the means.
if (i < K) {
    // loss * rows rounded to L (no fused multiply-add), then added in float64: the CPU's `member_loss += loss * rows`
    member_loss[i] += (double)mlptrain_mul_rn(loss[i], (L)rows);
    member_correct[i] += correct[i];
}
if (i == 0) {  // the means read only the inputs: loads without stores between them, which the compiler can batch
    double s = 0.0;
    long long c = 0;
    for (long long k = 0; k < K; ++k) {
        s += (double)loss[k];
        c += correct[k];
    }
    mean_loss[0] = (L)(s / (double)K);
    mean_correct[0] = (c + K / 2) / K;  // the members' mean count, rounded to a whole row (c >= 0)
}
"""


@functools.cache
def _kernels() -> tuple[Any, Any]:
    means = cp.ElementwiseKernel(
        "raw float32 row_loss, raw int32 row_ok, int64 K, int64 B",
        "raw float32 loss, raw int64 correct",
        _MEANS,
        "mlptrain_member_means",
        loop_prep=_MEANS_PREP,
        no_return=True,
        options=("--maxrregcount=64",),  # 1024 threads leave 64 registers each (CuPy sets no launch bounds)
    )
    tally = cp.ElementwiseKernel(
        "raw L loss, raw int64 correct, int64 K, int64 rows",
        "raw float64 member_loss, raw int64 member_correct, raw L mean_loss, raw int64 mean_correct",
        _TALLY,
        "mlptrain_member_tally",
        preamble=_TALLY_PREP,
        no_return=True,
    )
    return means, tally


def member_means(row_loss: Any, row_ok: Any, members: int) -> tuple[Any, Any]:
    """``(loss (K,) float32, correct (K,) int64)`` of ``row_loss (K * B,)`` float32 and ``row_ok (K * B,)`` int32
    (member ``k``'s rows at ``k * B``): each member's mean row loss and its count, in one launch (see the module
    docstring for the order of the sums)."""
    means, _ = _kernels()
    b = row_loss.size // members
    loss = cp.empty(members, dtype=cp.float32)
    correct = cp.empty(members, dtype=cp.int64)
    means(row_loss, row_ok, members, b, loss, correct, size=THREADS, block_size=THREADS)
    return loss, correct


def tally_members(loss: Any, correct: Any, rows: int, member_loss: Any, member_correct: Any) -> tuple[Any, Any]:
    """Add one step to the epoch's sums, in one launch: ``member_loss[k] += loss[k] * rows`` (float64, the product in
    ``loss``'s dtype) and ``member_correct[k] += correct[k]``; returns the 0-d ``(mean loss, mean count)`` the step log
    records: the members' mean loss (``loss``'s dtype: float32, or float64) and ``(sum(correct) + K // 2) // K``."""
    _, tally = _kernels()
    mean_loss = cp.empty((), dtype=loss.dtype)
    mean_correct = cp.empty((), dtype=cp.int64)
    k, correct = loss.shape[0], correct.astype(cp.int64, copy=False)  # (a copy only if a loss counted in int32)
    tally(loss, correct, k, int(rows), member_loss, member_correct, mean_loss, mean_correct, size=k, block_size=32)
    return mean_loss, mean_correct


def tally_job(members: int, loss_dtype: Any, rows: int) -> Job:
    """:func:`tally_members` compiled ahead (stage ``update``): the very call on zeros of ``members`` members."""

    def run() -> None:
        zeros = functools.partial(cp.zeros, members)
        tally_members(zeros(dtype=loss_dtype), zeros(dtype=cp.int64), rows, zeros(cp.float64), zeros(cp.int64))

    return Job(f"mlptrain_member_tally ({members} members, {np.dtype(loss_dtype).name} loss)", "update", run)


class MemberSums:
    """The members' sums on a stream of their own, beside the backward (the module docstring's picture).

    :meth:`beside` wraps the training step's backward (:meth:`mlptrain.nn.members.MemberHead.backward`): inside it,
    :meth:`means` forks the sums stream off the main stream once the row kernel has run, runs ``member_means`` there,
    and keeps the row losses it reads alive until the main stream has waited for it, when the backward ends (a free
    block goes back to the main stream's lists at once; the main stream could reuse it before the sums stream read
    it). :meth:`tally` (the step's bookkeeping, after the backward) runs ``member_tally`` behind the means on the
    same stream when it is handed their very outputs (else it forks again: the main stream made what it reads), and
    the main stream waits for it before the update, whose last block reads its two means. Each fork is joined even
    when a launch raises, so that a CUDA graph capture ends with the real error, not an unjoined stream's.

    What the sums stream makes (the ``(K,)`` losses and counts, the two means) is allocated from its own free lists,
    and the main stream reads it only after waiting for the sums stream. A block freed there goes to the sums
    stream's next allocation: the next step's means, after that step's fork, or this step's tally, which no fork
    precedes; nothing on the main stream reads one of the sums stream's blocks while the backward is being enqueued,
    so neither can overwrite a block the main stream still reads. A CUDA graph capture records the fork and the
    joins as edges between its branches.
    """

    def __init__(self) -> None:
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._fork, self._means_done, self._tally_done = (cp.cuda.Event(disable_timing=True) for _ in range(3))
        self._reads: tuple[Any, Any] | None = None  # the row losses and flags member_means reads
        self._made: tuple[Any, Any] | None = None  # this step's member_means outputs: the tally follows without a fork
        self._owner: int | None = None  # the thread inside beside()

    @property
    def active(self) -> bool:
        """Inside :meth:`beside`, on its thread (not a compile-ahead job's): MemberHead's loss sends its means here."""
        return self._owner == threading.get_ident()

    @contextlib.contextmanager
    def beside(self) -> Iterator[None]:
        """The training step's backward: its means here; on the way out the main stream waits for them."""
        main = cp.cuda.get_current_stream()
        self._owner, self._made = threading.get_ident(), None
        try:
            yield
        finally:
            self._owner = None
            if self._reads is not None:
                main.wait_event(self._means_done)
                self._reads = None

    def means(self, row_loss: Any, row_ok: Any, members: int) -> tuple[Any, Any]:
        """:func:`member_means` on the sums stream, after the main stream's work so far (the row kernel)."""
        self._fork.record(cp.cuda.get_current_stream())
        self.stream.wait_event(self._fork)
        self._reads = (row_loss, row_ok)  # (set first: beside() joins the fork whatever happens below)
        with self.stream:
            try:
                out = member_means(row_loss, row_ok, members)
            finally:
                self._means_done.record(self.stream)
        self._made = out
        return out

    def tally(self, loss: Any, correct: Any, rows: int, member_loss: Any, member_correct: Any) -> tuple[Any, Any]:
        """:func:`tally_members` on the sums stream, behind this step's :meth:`means` when ``loss`` and ``correct``
        are their outputs (else forked off the main stream, which made them); the main stream waits for it."""
        main, made = cp.cuda.get_current_stream(), self._made
        self._made = None
        if made is None or made[0] is not loss or made[1] is not correct:
            self._fork.record(main)
            self.stream.wait_event(self._fork)
        with self.stream:
            try:
                out = tally_members(loss, correct, rows, member_loss, member_correct)
            finally:
                self._tally_done.record(self.stream)
                main.wait_event(self._tally_done)
        return out
