"""One kernel launch over every parameter of a model: the optimizer update and the overflow check.

A small MLP has a few large weights and a few tiny biases. One elementwise kernel per
parameter means one launch per parameter; in a replayed CUDA graph each launch of a small kernel
still costs a couple of microseconds of GPU time, as much as a small GEMM. A *multi-tensor*
kernel (Apex's ``multi_tensor_apply``, PyTorch's ``foreach`` optimizers) does the whole model in
one launch. Here the grid is fixed (enough threads to fill the GPU, fewer for a tiny model) and
every thread walks every tensor with the grid's stride; the tensor sizes are compile-time
constants, so each loop is as simple as a single-tensor kernel's::

    thread i of N:  for (j = i; j < 802816; j += N) update(g0[j], p0[j], ...);   // layer0.weight
                    for (j = i; j < 1024;   j += N) update(g1[j], p1[j], ...);   // layer0.bias
                    ...

Some work must happen once per launch, after every element is done: Adam's step count ``t``
advances, the overflow flag of all gradients is published. :class:`MultiTensorKernel` gives a
kernel a *last-block* epilogue (the threadfence reduction of the CUDA samples): each block, when
its threads are done, increments a counter in device memory, and the block that sees the
counter reach the grid size knows every other block has finished and runs the epilogue, then
resets the counter for the next launch (or the next replay of a CUDA graph). The fixed grid keeps
those atomic increments to about a thousand per launch; one block per 256 elements instead (7,300
blocks for 784-1024-1024-10) made the overflow check and the SGD update several times slower
(docs/benchmarks.md, "Figures moved out of the code").

The kernels are CuPy ElementwiseKernels over raw arrays, so CuPy names the dtypes (float16,
bfloat16, float32, float64) and caches the compiled code on disk per model layout.

An ensemble's per-member update (``members=K``: :mod:`mlptrain.base.member_settings`) reads, for each element,
the member it belongs to from the tensor's stacked layout: tensor ``k`` of ``n`` elements is ``(K, ...)``
C-contiguous, so element ``j`` is member ``j / (n / K)``, an integer division by a compile-time constant::

    for (j = i; j < 802816 * K; j += N) { const int member = (int)(j / 802816LL); update(..., member); }

The overflow check only reads, and reads one dtype: :class:`NonfiniteScan` does it with 16-byte
loads (8 fp16 values each), faster than element by element.
"""

from __future__ import annotations

from collections.abc import Sequence
from string import Template
from typing import Any

import cupy as cp

from mlptrain.base.member_settings import member_index_cuda


def _flat(a: Any, what: str) -> Any:
    """A 1-D view of a C-contiguous array (the multi-tensor index is the flat element index)."""
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} of shape {a.shape} is not C-contiguous; the multi-tensor kernel needs flat views")
    return a.reshape(-1)


class MultiTensorKernel:
    """``body`` applied to every element of every tensor, in one launch.

    Args:
        name: kernel name (shows in profiles and graph dumps).
        roles: the per-tensor arrays, ``(name, type placeholder)``: ``[("g", "G"), ("p", "P")]``.
            Every tensor of a role has the role's dtype.
        sizes: element count of each tensor, in order.
        body: CUDA statements for one element, with ``$g``, ``$p`` ... standing for the element of
            each role (``g3[j]`` for tensor 3).
        extra_params: raw arrays and scalars after the tensors (``"raw float64 lr"``).
        loop_prep: statements each thread runs before its elements (read per-step scalars once).
        block_flag: ``(local bool, raw int32 array)``: after the elements, a block in which any
            thread's flag is true ORs 1 into ``array[0]`` (one atomic per block, not per element).
        epilogue: statements the last block to finish runs once, after every element is done.
        preamble: device functions the code calls.
        members: ``K > 0``: every tensor is ``K`` members stacked on its leading axis, and ``body`` reads
            ``member``, the member of its element (:func:`~mlptrain.base.member_settings.member_index_cuda`).

    Call it with the tensors role by role (``[g0, g1, ...], [p0, p1, ...]``), then the extras.
    """

    def __init__(
        self,
        name: str,
        roles: Sequence[tuple[str, str]],
        sizes: Sequence[int],
        body: str,
        *,
        extra_params: str = "",
        loop_prep: str = "",
        block_flag: tuple[str, str] | None = None,
        epilogue: str = "",
        preamble: str = "",
        members: int = 0,
    ) -> None:
        self.roles = list(roles)
        self.sizes = [int(s) for s in sizes]
        self.total = sum(self.sizes)
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"{name}: every tensor needs at least one element; sizes {self.sizes}")
        params = [f"raw {t} {r}{k}" for k in range(len(self.sizes)) for r, t in self.roles]
        # Enough threads to fill the GPU (2048 per SM), in blocks of 256; fewer for a small model.
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self.threads = min(-(-self.total // 256) * 256, sms * 2048)
        loops = []
        for k, n in enumerate(self.sizes):
            element = Template(body).substitute({r: f"{r}{k}[j]" for r, _ in self.roles})
            if members:  # the member of element j, from the stacked layout (K, ...)
                element = f"const int member = {member_index_cuda(n, members)}; {element}"
            loops.append(f"for (ptrdiff_t j = i; j < {n}LL; j += {self.threads}LL) {{ {element} }}")
        after = ""
        if block_flag is not None:
            flag, target = block_flag
            after += f"if (__syncthreads_or({flag}) && threadIdx.x == 0) atomicOr(&{target}[0], 1);"
        if epilogue:
            params.append("raw int32 blocks_done")
            after += f"""
            __syncthreads();  // every thread of this block is done
            if (threadIdx.x == 0) {{
                __threadfence();  // this block's writes are visible before it is counted
                if (atomicAdd(&blocks_done[0], 1) == (int)gridDim.x - 1) {{
                    __threadfence();
                    {epilogue}
                    blocks_done[0] = 0;  // ready for the next launch or graph replay
                }}
            }}
            """
        if extra_params:
            params.append(extra_params)
        self._kernel = cp.ElementwiseKernel(
            "",
            ", ".join(params),
            "\n".join(loops),
            name,
            loop_prep=loop_prep,
            after_loop=after,
            preamble=preamble,
            no_return=True,
        )
        self._blocks_done = cp.zeros(1, dtype=cp.int32) if epilogue else None

    def __call__(self, *args: Any) -> None:
        """Launch over the tensors (one list per role) followed by the extra arguments."""
        per_role, extras = args[: len(self.roles)], args[len(self.roles) :]
        flat: list[Any] = []
        for k, n in enumerate(self.sizes):
            for (r, _), tensors in zip(self.roles, per_role, strict=True):
                a = tensors[k]
                if a.size != n:
                    raise ValueError(f"{self._kernel.name}: {r}{k} has {a.size} elements; the kernel was built for {n}")
                flat.append(_flat(a, f"{r}{k}"))
        if self._blocks_done is not None:
            flat.append(self._blocks_done)
        self._kernel(*flat, *extras, size=self.threads, block_size=256)


_NONFINITE_LANES = """
// inf/NaN among the lanes of a 16-byte vector: an all-ones exponent.
__device__ __forceinline__ bool mt_bad16_lane(unsigned int h, unsigned int e) { return (h & e) == e; }
__device__ __forceinline__ bool mt_bad16(uint4 q, unsigned int e) {  // 8 fp16 (e = 0x7C00) or bf16 (0x7F80)
    const unsigned int w[4] = {q.x, q.y, q.z, q.w};
    bool bad = false;
    for (int k = 0; k < 4; ++k) bad |= mt_bad16_lane(w[k] & 0xFFFFu, e) || mt_bad16_lane(w[k] >> 16, e);
    return bad;
}
__device__ __forceinline__ bool mt_bad32(uint4 q) {  // 4 fp32
    return ((q.x & 0x7F800000u) == 0x7F800000u) || ((q.y & 0x7F800000u) == 0x7F800000u) ||
           ((q.z & 0x7F800000u) == 0x7F800000u) || ((q.w & 0x7F800000u) == 0x7F800000u);
}
"""

_LANES = {"float16": "mt_bad16(v[j], 0x7C00u)", "bfloat16": "mt_bad16(v[j], 0x7F80u)", "float32": "mt_bad32(v[j])"}


class NonfiniteScan:
    """``found = any element of the tensors is inf or NaN``, in one launch of 16-byte loads.

    The overflow check of an fp16 step reads every gradient once. Element by element (a
    :class:`MultiTensorKernel`, one 2-byte load per element) that is 1.9 M loads for
    784-1024-1024-10; here each thread loads 16-byte vectors (8 fp16 values) and tests their
    exponent bits, with a scalar loop for each tensor's last ``size % 8`` elements. Fewer,
    wider loads and a smaller grid (at most 4 blocks per SM) mean fewer instructions and fewer
    blocks counting into the last-block epilogue. Every tensor must start 16-byte aligned (CuPy's
    allocations do; :meth:`fits` says whether a list of arrays qualifies).
    """

    def __init__(self, name: str, sizes: Sequence[int], dtype: str) -> None:
        if dtype not in _LANES:
            raise ValueError(f"{name}: dtype {dtype} has no vector scan; expected one of {', '.join(_LANES)}")
        self.sizes = [int(n) for n in sizes]
        self.dtype = dtype
        per_vec = 4 if dtype == "float32" else 8
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        blocks = max(1, min(4 * sms, -(-sum(n // per_vec for n in self.sizes) // 256)))
        self.threads = blocks * 256
        scans = []
        for k, n in enumerate(self.sizes):
            v = n // per_vec
            scans.append(
                f"{{ const uint4* v = reinterpret_cast<const uint4*>(&g{k}[(ptrdiff_t)0]);\n"
                f"  for (ptrdiff_t j = i; j < {v}LL; j += {self.threads}LL) bad |= {_LANES[dtype]};\n"
                f"  for (ptrdiff_t j = {v * per_vec}LL + i; j < {n}LL; j += {self.threads}LL) "
                f"bad |= !isfinite((float)g{k}[j]); }}"
            )
        params = ", ".join(f"raw G g{k}" for k in range(len(self.sizes)))
        self._kernel = cp.ElementwiseKernel(
            "",
            params + ", raw int32 any_bad, raw int32 found, raw int32 blocks_done",
            "\n".join(scans),
            name,
            loop_prep="bool bad = false;",
            after_loop="""
            if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(&any_bad[0], 1);
            __syncthreads();
            if (threadIdx.x == 0) {
                __threadfence();
                if (atomicAdd(&blocks_done[0], 1) == (int)gridDim.x - 1) {  // the last block: publish, reset
                    __threadfence();
                    found[0] = atomicExch(&any_bad[0], 0);
                    blocks_done[0] = 0;
                }
            }
            """,
            preamble=_NONFINITE_LANES,
            no_return=True,
        )
        self._blocks_done = cp.zeros(1, dtype=cp.int32)

    @staticmethod
    def fits(arrays: Sequence[Any]) -> bool:
        """Whether the vector scan can read these arrays: a supported dtype, C-contiguous, 16-byte aligned."""
        return all(
            a.dtype.name in _LANES and a.flags.c_contiguous and a.data.ptr % 16 == 0 and a.dtype == arrays[0].dtype
            for a in arrays
        )

    def __call__(self, grads: Sequence[Any], any_bad: Any, found: Any) -> None:
        if [int(g.size) for g in grads] != self.sizes or not self.fits(grads) or grads[0].dtype.name != self.dtype:
            raise ValueError(f"{self._kernel.name}: built for {self.dtype} sizes {self.sizes}; use fits() first")
        flat = [_flat(g, f"g{k}") for k, g in enumerate(grads)]
        self._kernel(*flat, any_bad, found, self._blocks_done, size=self.threads, block_size=256)
