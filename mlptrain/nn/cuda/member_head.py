"""An ensemble's output-layer input gradient: the single model's head kernel, for K members in one launch.

For K members of a small head (:func:`mlptrain.nn.cuda.head.head_kernel_applies`) the batched GEMM::

    dZ_below^T (K, H, B) = W^T (K, H, C) @ dlogits^T (K, C, B),  DRELU(_BGRAD) with the batched relu_aux

has K = C: cuBLASLt runs it as a small-tile kernel, and mlptrain's mask-and-sum pass after it
(:mod:`mlptrain.nn.cuda.epilogue_kernels`). ``mlptrain_member_head_dgrad`` does it in one launch, and member
``k``'s ``dZ_below (B, H)`` and bias gradient ``(H,)`` are the single kernel's (``mlptrain_head_dgrad``) on
member ``k``'s slices, bit for bit: every element is the same float32 chain of ``fmaf`` over the C classes,
rounded once to the compute dtype, and every column's sum the same partials added in the same tree.

The single kernel's block is 8 columns (one relu_aux byte a row) by 64 row lanes: lane ``p`` sums rows
``p, p + 64, ...`` in order, then a tree adds the 64 lanes (lane ``i`` takes lane ``i + s`` for ``s = 32, 16,
..., 1``). It launches ``ceil(H / 8)`` blocks, one wave of an H100 for ``H <= 1024``. K members of that block
would be K waves (ptxas gives the kernel ~100 registers a thread at C = 10: one 512-thread block per SM). So a block of
the members' kernel is ``LANES`` times wider, ``8 LANES`` columns by ``64 / LANES`` row groups, and each
thread keeps ``LANES`` lanes of its column in registers: lanes ``g, g + 64 / LANES, ...``. The steps of the
tree that join two of a thread's lanes (``s >= 64 / LANES``) are register adds, the rest go through shared
memory as the single kernel's do; the same adds, in the same order. :func:`member_lanes` takes the widest
block that still leaves a block for every two SMs; ``LANES = 1`` is the single kernel's block. The members
are folded into the block index (block ``k * blocks + j`` is member ``k``'s block ``j``): CuPy's
``ElementwiseKernel`` launches a one-dimensional grid, and a member's blocks come together, as a
``gridDim.y = K`` launch would issue them. Not timed on a GPU yet: ``benchmarks/probes/member_head.py`` times
each width against the batched GEMM, ``benchmarks/probes/member_kernels.py`` the step with and without it.

Where it enters the backward: :meth:`mlptrain.nn.members.MemberHead.grads` (head mode ``kernel``).
"""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp

from mlptrain.nn.cuda.head import head_kernel_applies
from mlptrain.nn.epilogs import relu_aux_shape

THREADS = 512  # the single kernel's block: 64 row lanes of 8 columns
LANE_CHOICES = (8, 4, 2, 1)  # lanes a thread keeps: blocks of 64, 32, 16 or 8 columns


def member_lanes(members: int, hidden: int, sms: int) -> int:
    """The lanes a thread keeps (the block's width over 8 columns): the widest block whose
    ``members * ceil(hidden / (8 lanes))`` blocks still number at least half the GPU's ``sms``; else 1."""
    return next((w for w in LANE_CHOICES if 2 * members * -(-hidden // (8 * w)) >= sms), 1)


def member_input_grad(
    dlogits: Any, W: Any, relu_aux: Any, *, bias_grad_below: bool = True, lanes: int | None = None
) -> tuple[Any, Any]:
    """:func:`mlptrain.nn.cuda.head.head_input_grad` of each of K members in one launch: ``dZ_below[k] =
    (dlogits[k] @ W[k]) * relu'(Z_below[k])`` and its sum over member ``k``'s batch, the single kernel's bits.

    Args:
        dlogits: ``(K, B, C)`` the members' loss gradients, C-contiguous, compute dtype.
        W: ``(K, C, H)`` the members' output weights in the compute dtype, C-contiguous.
        relu_aux: the layer below's masks, uint8 ``(K, Mb, B)``: each member's column-major ``(Mb, B)`` of
            RELU_AUX_BIAS, the members one after the other (a batched GEMM's ``relu_aux``).
        bias_grad_below: also return each member's ``dZ_below`` summed over its batch (DRELU_BGRAD); False:
            DRELU only (the layer below reduces its own bias gradient with BGRADB).
        lanes: one of :data:`LANE_CHOICES`; None: :func:`member_lanes` for this GPU (the result is the same).

    Returns:
        ``(dz_below (K, B, H), db_below (K, H) or None)`` in the compute dtype.

    Raises:
        ValueError: shapes, dtypes or layouts that do not fit together, naming them.
    """
    if dlogits.ndim != 3 or not dlogits.flags.c_contiguous:
        raise ValueError(f"dlogits must be a C-contiguous (members, batch, classes) array; got shape {dlogits.shape}")
    K, B, C = dlogits.shape
    if not head_kernel_applies(B, C):
        raise ValueError(f"the head kernel takes B <= 1024, C <= 32 and B * C <= 10240; got dlogits {dlogits.shape}")
    if W.ndim != 3 or W.shape[:2] != (K, C) or W.dtype != dlogits.dtype or not W.flags.c_contiguous:
        raise ValueError(
            f"the output weights must be C-contiguous ({K}, {C}, hidden) {dlogits.dtype} for dlogits {dlogits.shape}; "
            f"got {W.dtype} {W.shape}{'' if W.flags.c_contiguous else ' (not C-contiguous)'}"
        )
    H = W.shape[2]
    mb = relu_aux_shape(H, B)[0]
    want = (mb * B, 1, mb)  # member after member, each column-major; an axis of one element may have any stride
    fits = all(s == w for s, w, n in zip(relu_aux.strides, want, relu_aux.shape, strict=False) if n > 1)
    if relu_aux.dtype != cp.uint8 or relu_aux.shape != (K, mb, B) or not fits:
        raise ValueError(
            f"relu_aux must be uint8 {(K, mb, B)} with each member column-major (strides {want}) for {H} hidden "
            f"units and batch {B}; got {relu_aux.dtype} {relu_aux.shape} strides {relu_aux.strides}"
        )
    if lanes is None:
        lanes = member_lanes(K, H, _sms())
    if lanes not in LANE_CHOICES:
        raise ValueError(f"lanes must be one of {LANE_CHOICES}; got {lanes}")
    dz = cp.empty((K, B, H), dtype=dlogits.dtype)  # member k's (B, H) == its column-major (H, B) DRELU result
    db = cp.empty((K, H) if bias_grad_below else 1, dtype=dlogits.dtype)
    blocks = -(-H // (8 * lanes))  # per member
    aux = relu_aux.swapaxes(1, 2).reshape(-1)  # a flat view: (K, B, Mb) is the C-order array of its memory
    args = (dlogits.reshape(-1), W.reshape(-1), aux, B, H, mb, blocks, bias_grad_below, dz.reshape(-1), db.reshape(-1))
    member_dgrad_kernel(C, lanes)(*args, size=K * blocks * THREADS, block_size=THREADS)
    return dz, (db if bias_grad_below else None)


@functools.cache
def _sms() -> int:
    """The GPU's SM count, read once (the step calls :func:`member_input_grad` every time it runs)."""
    return int(cp.cuda.Device().attributes["MultiProcessorCount"])


def compile_members_ahead(weight: tuple[int, int, int], dtype: Any, rows: list[int], *, bias_grad_below: bool) -> None:
    """:func:`member_input_grad` for the members' output weights of shape ``weight`` (K, C, H) and each training batch
    of ``rows``, on zeros: the job :meth:`mlptrain.nn.members.MemberHead.precompile_jobs` declares."""
    w = cp.zeros(weight, dtype)  # (K, C, H)
    k, c, h = w.shape
    for r in rows:
        aux = cp.zeros((k, *relu_aux_shape(h, r)[::-1]), cp.uint8).swapaxes(1, 2)  # (K, Mb, B), members column-major
        member_input_grad(cp.zeros((k, r, c), w.dtype), w, aux, bias_grad_below=bias_grad_below)


_MEMBER_BODY = r"""
const long long member = blockIdx.x / blocks, j = blockIdx.x % blocks;  // member k's block j
const T* const d = &d_all[member * B * C];                    // (B, C)
const T* const W = &W_all[member * C * H];                    // (C, H)
const unsigned char* const aux = &aux_all[member * B * Mb];   // (B, Mb): the column-major (Mb, B) mask
T* const dzb = &dzb_all[member * B * H];                      // (B, H)
T* const db = &db_all[want_db ? member * H : 0];              // (H,)
const int t = threadIdx.x, col = t % COLS, g = t / COLS;      // g: the row group; lanes g + GROUPS m are this thread's
const long long h = j * COLS + col;
const bool in = h < H;
const int n = (int)B * C;
float wc[C];  // W's column h, loaded before anything is used
#pragma unroll
for (int c = 0; c < C; ++c) wc[c] = in ? (float)W[c * H + h] : 0.0f;
const long long byte = h >> 3;
const int bit = (int)(h & 7);
for (int k0 = 0; k0 < n; k0 += 8 * NT) {  // dlogits into shared memory as float32, 8 loads a thread in flight
    float v[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] = k0 + q * NT + t < n ? (float)d[k0 + q * NT + t] : 0.0f;
#pragma unroll
    for (int q = 0; q < 8; ++q) if (k0 + q * NT + t < n) dls[k0 + q * NT + t] = v[q];
}
__syncthreads();
float part[LANES];  // part[m]: lane g + GROUPS m, the sum of rows g + GROUPS m, + 64, + 128, ... in order
#pragma unroll
for (int m = 0; m < LANES; ++m) part[m] = 0.0f;
// 8 rows a thread at a time: its row q is r0 + 64 (q / LANES) + GROUPS (q % LANES), of lane q % LANES
for (int r0 = g; r0 < B; r0 += 512 / LANES) {
    unsigned char mk[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        const int r = r0 + (q / LANES) * 64 + (q % LANES) * GROUPS;
        mk[q] = r < B && in ? aux[r * Mb + byte] : 0;
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        const int r = r0 + (q / LANES) * 64 + (q % LANES) * GROUPS;
        if (r < B && in) {
            const float* z = dls + r * C;
            float acc = 0.0f;  // dZ[r, h] = sum over c of dlogits[r, c] W[c, h], float32, as the single kernel
#pragma unroll
            for (int c = 0; c < C; ++c) acc = fmaf(z[c], wc[c], acc);
            const T v = (T)(((mk[q] >> bit) & 1) ? acc : 0.0f);  // dReLU of the layer below
            dzb[r * H + h] = v;
            part[q % LANES] += (float)v;
        }
    }
}
if (want_db) {  // the single kernel's tree over the 64 lanes: lane i += lane i + s, s = 32, 16, ..., 1
#pragma unroll
    for (int s = LANES / 2; s >= 1; s >>= 1) {  // s GROUPS >= GROUPS: both lanes are this thread's
#pragma unroll
        for (int m = 0; m < s; ++m) part[m] += part[m + s];
    }
    red[t] = part[0];  // lane g
    __syncthreads();
    for (int s = NT / 2; s >= COLS; s >>= 1) {  // s / COLS < GROUPS: lane g += lane g + s / COLS, across threads
        if (t < s) red[t] += red[t + s];
        __syncthreads();
    }
    if (t < COLS && in) db[h] = (T)red[t];
}
"""


@functools.cache
def member_dgrad_kernel(classes: int, lanes: int) -> Any:
    """The members' kernel for ``classes`` classes and blocks of ``8 lanes`` columns (compiled once per pair)."""
    prep = f"""
const int C = {classes};        // K of the product: the loops over it unroll
const int LANES = {lanes};      // row lanes a thread keeps
const int COLS = {8 * lanes};   // columns per block
const int GROUPS = {64 // lanes};  // row groups: threads per column
const int NT = {THREADS};
__shared__ float dls[{10240 // classes * classes}];  // dlogits as float32 (B * C <= 10240)
__shared__ float red[{THREADS}];  // the lanes' sums, for the steps of the tree across threads
"""
    return cp.ElementwiseKernel(
        "raw T d_all, raw T W_all, raw uint8 aux_all, int64 B, int64 H, int64 Mb, int64 blocks, bool want_db",
        "raw T dzb_all, raw T db_all",
        _MEMBER_BODY,
        "mlptrain_member_head_dgrad",
        loop_prep=prep,
        no_return=True,
        options=(f"--maxrregcount={min(255, 65536 // THREADS)}",),  # a full block shares the register file
    )
