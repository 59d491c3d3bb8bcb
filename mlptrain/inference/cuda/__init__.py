"""The GPU half of inference: batches as replays of a CUDA graph, and their two kernels.

=================== ================================================================
module              what it owns
=================== ================================================================
``predictor``       inference batches as replays of a CUDA graph (the forward pass passed in; the
                    twin of :mod:`mlptrain.inference.predictor.predictor`)
``infer_kernels``   inference's normalise and argmax kernels
=================== ================================================================

Every module here imports CuPy (or nvmath) when it is imported; what that rule means for the rest of
the package (engines, no GPU needed to import mlptrain) is said once, in ``docs/architecture.md``.
"""
