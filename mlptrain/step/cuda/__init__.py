"""The GPU half of the training step: its CUDA graph, one-launch kernels, precompiling, measurements.

=================== ================================================================
module              what it owns
=================== ================================================================
``graph``           :class:`GraphedStep`: a step function replayed as one CUDA graph per shape
``multitensor``     one kernel over every parameter: the optimizer update, the overflow check
``nonfinite``       which of many tensors hold an inf or NaN, in one launch (or queued, read later)
``precompile``      the run's kernels compiled on threads before their first launch
``bgrad``           the measured bias-gradient strategy (``execution.bgrad=auto``; the twin of
                    :mod:`mlptrain.step.bgrad`)
``memory``          the step's live bytes by category beside the pools, and their high-water mark
=================== ================================================================

Every module here imports CuPy (or nvmath) when it is imported; what that rule means for the rest of
the package (engines, no GPU needed to import mlptrain) is said once, in ``docs/architecture.md``.
"""
