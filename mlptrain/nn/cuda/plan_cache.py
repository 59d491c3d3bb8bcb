"""cuBLASLt algorithms remembered on disk, so that a second run plans its GEMMs instantly."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import cupy as cp
import numpy as np
from nvmath.bindings import cublasLt
from nvmath.linalg.advanced import Algorithm

from mlptrain.base.fs import atomic_write, cache_root

log = logging.getLogger(__name__)


class PlanCache:
    """cuBLASLt algorithms chosen per GEMM signature, kept on disk so a second run plans instantly.

    One ``.npz`` per GPU model and cuBLASLt version (an algorithm is only valid there), holding
    each algorithm as the bytes of ``Algorithm.as_numpy()``, keyed by a hash of the signature
    (shapes, strides, dtype, epilog, compute type) and whether it was autotuned. Written
    atomically; an unreadable file is ignored with a warning (it is only a cache).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._algos: dict[str, np.ndarray] = {}
        if path is not None and path.is_file():
            try:
                with np.load(path, allow_pickle=False) as npz:
                    self._algos = {k: npz[k] for k in npz.files}
            except Exception as exc:  # a cache must never stop a run
                log.warning("ignoring unreadable plan cache %s (%s)", path, exc)

    @staticmethod
    def default_path() -> Path:
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        gpu = "".join(c if c.isalnum() else "-" for c in name)
        return cache_root() / "plans" / f"{gpu}-cublaslt{cublasLt.get_version()}.npz"

    @staticmethod
    def key(signature: tuple, tf32: bool, tuned: bool) -> str:
        text = repr((signature, tf32))
        return ("tuned-" if tuned else "heur-") + hashlib.sha256(text.encode()).hexdigest()[:32]

    def get(self, signature: tuple, tf32: bool, tuned: bool) -> Algorithm | None:
        """The cached algorithm; with ``tuned=False`` a tuned one is preferred when present."""
        for t in (True, tuned) if not tuned else (True,):
            raw = self._algos.get(self.key(signature, tf32, t))
            if raw is not None:
                return Algorithm.from_numpy(raw.view(cublasLt.matmul_heuristic_result_dtype))
        return None

    def put(self, signature: tuple, tf32: bool, tuned: bool, algorithm: Algorithm) -> None:
        self._algos[self.key(signature, tf32, tuned)] = algorithm.as_numpy().view(np.uint8)
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, lambda f: np.savez(f, **self._algos))  # type: ignore[arg-type]
        except OSError as exc:
            log.warning("could not write the plan cache %s (%s)", self.path, exc)
