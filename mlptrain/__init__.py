"""mlptrain: MLP training on cuBLASLt fused matmul epilogs (nvmath-python), with a NumPy CPU engine.

Importing mlptrain never needs a GPU: CuPy and nvmath are imported only when a GPU is used
(:mod:`mlptrain.backend`).
"""

__version__ = "0.1.0"
