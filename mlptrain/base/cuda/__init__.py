"""Kernel plumbing on the GPU: compiling the CUDA source the CPU modules write, and timing it.

=================== ================================================================
module              what it owns
=================== ================================================================
``kernels``         compiled element-wise kernels built from CUDA source the CPU modules write
``plain_kernels``   the header-free kernels (gather, nonfinite) compiled in one NVRTC call
``timing``          CUDA-event timing and graph capture of a function
=================== ================================================================

Every module here imports CuPy (or nvmath) when it is imported; what that rule means for the rest of
the package (engines, no GPU needed to import mlptrain) is said once, in ``docs/architecture.md``.
"""
