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

Every module here imports CuPy (or nvmath) when it is imported. The CPU modules never import CuPy
or nvmath themselves: they compute with the array module ``xp`` they are given (:mod:`mlptrain.base.backend`)
and reach a ``cuda/`` folder only through imports inside their GPU branches, so ``import mlptrain`` and
the whole CPU path work without a GPU. These modules are engines: outside the ``cuda/`` folders they
import only the contracts they carry out (:mod:`mlptrain.nn.epilogs`, :mod:`mlptrain.nn.epilogs_fp8`,
:mod:`mlptrain.nn.fp8`) and plain helpers of :mod:`mlptrain.base`, never the step, the network, the
builders or the precision policy (``tests/test_architecture.py`` lists today's exceptions).
"""
