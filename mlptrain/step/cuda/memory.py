"""What a training step holds in GPU memory, by category, beside what CuPy's pools hold.

Two views of the same memory:

* **Live bytes by category**, from the objects that own them (each array counted once, by its
  device pointer): the fp32 master weights, the compute copies the GEMMs read (fp16/bf16), the
  gradients, the optimizer state, the layer inputs saved for the weight gradients, the relu_aux
  masks, the batch the graph reads, the dataset on the device, and the cuBLASLt workspaces of the
  planned GEMMs (nvmath allocates one per planned ``Matmul`` from the current CuPy allocator).
* **The pools**: CuPy's default pool and the private pool of each CUDA graph, ``used`` (arrays
  alive now) and ``total`` (reserved from the device: used plus cached free blocks). A graph's
  free blocks are not waste: they are the step's temporaries (the activations' gradients, the
  logits and their gradient), which the captured kernels write on every replay.

``peak_bytes`` is the largest ``total`` over the samples :class:`PeakTracker` took; pools only grow
between ``free_all_blocks`` calls, so sampling before each of those and at the end gives the high-
water mark of reserved memory, the figure PyTorch reports as ``max_memory_reserved``.

For an MLP of widths ``w_0 .. w_L`` at batch ``B`` the categories follow a formula
(:func:`mlptrain.step.memory.expected_bytes`), and the step's own arrays peak at what
:func:`mlptrain.step.memory.expected_step_peak` computes from the backward's schedule; the GPU
tests hold the account and a step's allocations to them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import cupy as cp

from mlptrain.step.memory import expected_bytes, expected_step_peak

__all__ = ["PeakTracker", "account", "describe", "expected_bytes", "expected_step_peak"]

GIB = 2**30


def _unique_bytes(arrays: Iterable[Any], seen: set[int]) -> int:
    total = 0
    for a in arrays:
        if a is None or a.size == 0 or a.data.ptr in seen:
            continue
        seen.add(a.data.ptr)
        total += int(a.nbytes)
    return total


class PeakTracker:
    """High-water mark of the bytes CuPy's pools reserve (default pool plus ``extra()``, the graph pools)."""

    def __init__(self, extra: Callable[[], int] = lambda: 0) -> None:
        self.extra = extra
        self.peak = 0
        self.where = "start"

    def reserved(self) -> int:
        return int(cp.get_default_memory_pool().total_bytes()) + int(self.extra())

    def sample(self, where: str, extra: int = 0) -> int:
        """The bytes reserved now (plus ``extra``, a pool the tracker does not know of), kept if a new peak."""
        now = self.reserved() + extra
        if now > self.peak:
            self.peak, self.where = now, where
        return now


def account(trainer: Any) -> dict[str, Any]:
    """Bytes live by category and the pools' state for ``trainer`` (a GPU :class:`~mlptrain.step.trainer.Trainer`)."""
    model, seen = trainer.model, set[int]()
    params = model.params
    layers = model.layers
    graphed = trainer.runtime.graphed
    batch = graphed.input_arrays() if graphed is not None else []
    loaders = (trainer.train_loader, *trainer.eval_loaders.values())
    cats = {
        "master_weights": _unique_bytes((p.value for p in params), seen),
        "compute_copies": _unique_bytes((p.compute for p in params if p.has_compute_copy), seen)
        + (model.cast_buffer.nbytes if model.cast_buffer is not None else 0),  # compute_copy=cast: the shared buffer
        "gradients": _unique_bytes((p.grad for p in params), seen),
        "optimizer_state": _unique_bytes((v for st in trainer.optimizer.state.values() for v in st.values()), seen),
        "batch": _unique_bytes(batch, seen),
        "saved_inputs": _unique_bytes((layer.x for layer in layers), seen),
        "relu_aux": _unique_bytes((layer.mask for layer in layers), seen),
        # Resident splits live on the device; a host-resident one (data.residency=host) only its batch slots.
        "dataset": _unique_bytes([a for ld in loaders if ld.resident for a in (ld.x, ld.y)], seen),
        "host_batch_slots": sum(ld.device_bytes for ld in loaders if not ld.resident),
        "gemm_workspaces": trainer.gemm.workspace_bytes(),
    }
    default = cp.get_default_memory_pool()
    pools = {
        "default_used": int(default.used_bytes()),
        "default_total": int(default.total_bytes()),
        "graph_used": graphed.pool_used_bytes() if graphed else 0,
        "graph_total": graphed.pool_bytes() if graphed else 0,
    }
    reserved = pools["default_total"] + pools["graph_total"]
    peak = trainer.runtime.memory_peak
    peak.sample("account")
    return {
        "live_bytes": cats,
        "live_total": sum(cats.values()),
        "pools": pools,
        "reserved_bytes": reserved,
        "peak_bytes": peak.peak,
        "peak_at": peak.where,
    }


def describe(acc: dict[str, Any]) -> str:
    """The account as a few lines of text (GiB)."""
    cats = ", ".join(f"{k} {v / GIB:.3f}" for k, v in acc["live_bytes"].items() if v)
    p = acc["pools"]
    return (
        f"live {acc['live_total'] / GIB:.3f} GiB ({cats})\n"
        f"pools: default {p['default_used'] / GIB:.3f} used / {p['default_total'] / GIB:.3f} reserved, "
        f"graphs {p['graph_used'] / GIB:.3f} used / {p['graph_total'] / GIB:.3f} reserved; "
        f"peak {acc['peak_bytes'] / GIB:.3f} GiB ({acc['peak_at']})"
    )
