"""What the numbered examples share: the device to run on and the GEMM engine that goes with it.

``python examples/0N_....py`` runs on the GPU where CuPy and nvmath-python can use one, else on the
CPU with the NumPy engine, which implements the same epilog contract (``--device cpu|gpu`` to choose).
"""

from __future__ import annotations

import argparse
from typing import Any

from mlptrain.base.backend import Backend, get_backend
from mlptrain.nn.execution import NumpyGemm


def parse_device(description: str) -> Backend:
    """``--device auto|cpu|gpu`` from the command line, as a backend (auto: the GPU when there is one)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    return get_backend(parser.parse_args().device)


def gemm_engine(be: Backend) -> Any:
    """A planned nvmath ``Matmul`` per call site on the GPU (cuBLASLt epilogs); the NumPy contract on the CPU."""
    if be.is_gpu:
        from mlptrain.nn.cuda.gemm import NvmathGemm

        return NvmathGemm()
    return NumpyGemm()
