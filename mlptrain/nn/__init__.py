"""The model and its fused math: the epilog contract, execution, layers, the network, the head, losses.

=================== ================================================================
module              what it owns
=================== ================================================================
``epilogs``         the cuBLASLt epilog contract in NumPy: the CPU engine and the GPU's oracle
``epilogs_fp8``     the same contract in FP8 (the casts, the scaled GEMM)
``fp8``             per-tensor delayed scaling and the GEMM engine that quantises each operand
``execution``       fused and naive execution of a layer's GEMMs; ``Gemm``, ``NumpyGemm``, ``ACTIVATIONS``
``layers``          ``Param`` and ``Linear``: what a layer owns and the calls it makes per step
``network``         ``MLP``: the chain of layers, forward and backward
``head``            ``OutputHead``: how the loss and the output layer's gradients are computed
``losses``          softmax cross-entropy and MSE through ``xp``; ``LOSSES``
``cuda/``           the same concepts on the GPU (the GEMM engine, the loss and head kernels, FP8)
=================== ================================================================
"""
