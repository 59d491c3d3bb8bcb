"""The GPU half of inference: batches as replays of a CUDA graph, and their two kernels.

=================== ================================================================
module              what it owns
=================== ================================================================
``predictor``       inference batches as replays of a CUDA graph (the forward pass passed in; the
                    twin of :mod:`mlptrain.inference.predictor.predictor`)
``infer_kernels``   inference's normalise and argmax kernels
=================== ================================================================

Every module here imports CuPy (or nvmath) when it is imported. The CPU modules never import CuPy
or nvmath themselves: they compute with the array module ``xp`` they are given (:mod:`mlptrain.base.backend`)
and reach a ``cuda/`` folder only through imports inside their GPU branches, so ``import mlptrain`` and
the whole CPU path work without a GPU. These modules are engines: outside the ``cuda/`` folders they
import only the contracts they carry out (:mod:`mlptrain.nn.epilogs`, :mod:`mlptrain.nn.epilogs_fp8`,
:mod:`mlptrain.nn.fp8`) and plain helpers of :mod:`mlptrain.base`, never the step, the network, the
builders or the precision policy (``tests/test_architecture.py`` lists today's exceptions).
"""
