"""NCCL through CuPy (``cupy.cuda.nccl``): the communicator of a data-parallel run on GPUs.

One process per GPU. Rank 0 makes a unique id (:meth:`NcclComm.new_id`, 128 bytes); every rank
receives it (from the launching process, or over :func:`mlptrain.distributed.launch.rendezvous`)
and joins with its rank. :meth:`NcclComm.all_reduce` sums arrays in place on CuPy's current
stream: NCCL's kernels are ordinary stream work, so a training step that all-reduces its gradients
can still be captured into a CUDA graph and replayed. NCCL's ring and tree all-reduces end with
every rank receiving the same result, so every rank holds the same bytes afterwards.
"""

from __future__ import annotations

import logging
from typing import Any

import cupy as cp
import numpy as np
from cupy.cuda import nccl

from mlptrain.base.errors import DeviceError

log = logging.getLogger(__name__)

UNIQUE_ID_BYTES = 128
# ncclDataType_t, fixed by NCCL's ABI (nccl.h; ncclBfloat16 since NCCL 2.10). Written out rather than read
# from cupy.cuda.nccl, whose constants exist only where CuPy could load libnccl: the module then imports
# everywhere (a CPU machine with the cu12 extra), and a missing library is one clear error when a
# communicator is made (:func:`_require_nccl`).
_DTYPES = {"int32": 2, "int64": 4, "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
_NCCL_SUM = 0  # ncclSum


def _require_nccl() -> None:
    """Raise DeviceError when CuPy could not load the NCCL library (it then lacks the communicator)."""
    if not hasattr(nccl, "NcclCommunicator"):
        raise DeviceError(
            "distributed.gpus needs NCCL, which CuPy could not load (libnccl.so.2); install it with "
            "pip install 'nvidia-nccl-cu12>=2.18,<3' (or nvidia-nccl-cu13 for the cu13 extra)"
        )


def device_count() -> int:
    """GPUs on this host."""
    return int(cp.cuda.runtime.getDeviceCount())


class NcclComm:
    """Rank ``rank`` of ``world`` GPUs, joined through ``unique_id`` (the bytes of :meth:`new_id`).

    ``device``: the GPU this rank runs on, made the current device of this process (default: the
    current one). Every later CuPy and nvmath call of the process then uses it.
    """

    def __init__(self, rank: int, world: int, unique_id: bytes, device: int | None = None) -> None:
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes; got {len(unique_id)}")
        if device is not None:
            cp.cuda.Device(device).use()
        _require_nccl()
        self.rank, self.world = rank, world
        self.stop_signal: Any = None  # the launcher's stop request, a shared integer (mlptrain.cli.launcher)
        try:  # CuPy 14 takes the id as bytes; older CuPy as a tuple of the C chars
            self._comm = nccl.NcclCommunicator(world, unique_id, rank)
        except TypeError:
            self._comm = nccl.NcclCommunicator(world, tuple(np.frombuffer(unique_id, dtype=np.int8).tolist()), rank)
        log.info("NCCL %s: rank %d of %d on GPU %d", nccl.get_version(), rank, world, cp.cuda.Device().id)

    @staticmethod
    def new_id() -> bytes:
        """A fresh unique id (rank 0 makes it; every rank needs the same one)."""
        _require_nccl()
        uid = nccl.get_unique_id()  # bytes (CuPy 14), or a tuple of 128 C chars as ints (older CuPy)
        return bytes(uid) if isinstance(uid, bytes | bytearray) else np.array(uid, dtype=np.int8).tobytes()

    def all_reduce(self, arrays: list[Any], stream: Any = None) -> None:
        """Sum each array over the ranks, in place, on the current stream (one NCCL group).

        ``stream``: run there instead, after the current stream's work so far, and make the current
        stream wait for it (a fork and a join, which a CUDA graph captures as edges).

        Device arrays must be contiguous. Host (NumPy) arrays are copied over and back (that
        synchronises: for evaluation's sums and the stop flag, never inside the training step).
        """
        if stream is not None:
            main = cp.cuda.get_current_stream()
            fork, join = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)
            fork.record(main)
            stream.wait_event(fork)
            with stream:
                self.all_reduce(arrays)
            join.record(stream)
            main.wait_event(join)
            return
        stream = cp.cuda.get_current_stream()
        host = [(a, cp.asarray(a)) for a in arrays if isinstance(a, np.ndarray)]
        device = [a for a in arrays if not isinstance(a, np.ndarray)] + [d for _, d in host]
        nccl.groupStart()
        try:
            for a in device:
                if not (a.flags.c_contiguous or a.flags.f_contiguous):
                    raise ValueError(f"all_reduce needs contiguous arrays; got {a.shape} strides {a.strides}")
                if a.dtype.name not in _DTYPES:
                    raise ValueError(f"all_reduce: NCCL has no {a.dtype.name}; expected one of {', '.join(_DTYPES)}")
                self._comm.allReduce(a.data.ptr, a.data.ptr, a.size, _DTYPES[a.dtype.name], _NCCL_SUM, stream.ptr)
        finally:
            nccl.groupEnd()
        for h, d in host:
            h[...] = d.get(stream=stream)

    def abort(self) -> None:
        """Stop every pending NCCL operation of this rank (a peer died or hung): nothing waits forever."""
        self._comm.abort()

    def close(self) -> None:
        self._comm.destroy()
