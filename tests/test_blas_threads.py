"""BLAS threads sized to the work (#27): a CPU run of small GEMMs steps on one thread, a large one keeps the default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg
from threadpoolctl import threadpool_info, threadpool_limits

from mlptrain.base.backend import BLAS_ONE_THREAD_BELOW, Backend, get_backend
from mlptrain.run.run import train
from mlptrain.step.trainer import Trainer


def _blas_threads() -> set[int]:
    """The thread counts of the BLAS libraries loaded (NumPy's, and others' such as SciPy's or torch's)."""
    return {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}


def test_a_small_runs_steps_see_one_blas_thread_and_the_default_comes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default digits model (a step of 1e7 GEMM FLOPs): before, every step ran on the library's threads."""
    seen: list[set[int]] = []
    step = Trainer.step

    def watched(self: Trainer, x: Any, y: Any) -> Any:
        seen.append(_blas_threads())
        return step(self, x, y)

    monkeypatch.setattr(Trainer, "step", watched)
    with threadpool_limits(limits=2, user_api="blas"):  # the library's default on a 2-core machine
        train(make_cfg(epochs=1), tmp_path / "run")
        after = _blas_threads()
    assert len(seen) == 21 and all(threads == {1} for threads in seen), seen[:3]
    assert after == {2}


def test_a_step_of_gigaflops_keeps_the_librarys_default() -> None:
    cpu = get_backend("cpu")
    with threadpool_limits(limits=2, user_api="blas"):
        with cpu.blas_threads(BLAS_ONE_THREAD_BELOW) as limit:
            assert limit is None and _blas_threads() == {2}
        with cpu.blas_threads(BLAS_ONE_THREAD_BELOW / 10) as limit:
            assert limit == 1 and _blas_threads() == {1}
        assert _blas_threads() == {2}
        with Backend("gpu", np).blas_threads(1.0) as limit:  # the GPU's steps use no host BLAS
            assert limit is None and _blas_threads() == {2}
