"""The GPU half of :mod:`mlptrain.nn`: the GEMM engine, its plans, and the kernels of the loss, head and FP8.

=================== ================================================================
module              what it owns
=================== ================================================================
``gemm``            :class:`NvmathGemm`: one planned nvmath ``Matmul`` per call site, epilogs
``plan_cache``      cuBLASLt algorithms kept on disk per GPU model and library version
``cublaslt``        one raw ``cublasLtMatmul`` planned once (descriptor, layouts, heuristics, workspace):
                    FP8's plans (``fp8_gemm``) and the torch front end's (:mod:`mlptrain.torch.torch_lt`)
``streams``         the second stream that the weight gradients run on
``losses``          the softmax cross-entropy kernels (the twin of :mod:`mlptrain.nn.losses`)
``members``         an ensemble's per-member sums: each member's mean loss and count, the step's tally
                    (the twin of :mod:`mlptrain.nn.members`)
``head``            the output layer's input gradient as one small kernel: in the head's ``kernel``
                    mode it replaces the output layer's DRELU_BGRAD GEMM (:mod:`mlptrain.nn.head`)
``member_head``     the same for an ensemble's K members in one launch, each member's result the single
                    kernel's (:class:`mlptrain.nn.members.MemberHead`)
``fp8_gemm``        precision=fp8: FP8 GEMMs with epilogs through the raw cuBLASLt bindings
``fp8_kernels``     precision=fp8: the FP8 casts (straight, transposed), amaxes and scale updates
``epilogue_kernels`` DRELU(_BGRAD) and BGRADB's bias gradient after a plain GEMM, in mlptrain's kernels:
                    precision=fp8's, an ensemble's batched bf16 GEMMs, large single ones (execution.epilogue_kernels)
=================== ================================================================

Every module here imports CuPy (or nvmath) when it is imported; what that rule means for the rest of
the package (engines, no GPU needed to import mlptrain) is said once, in ``docs/architecture.md``.
"""
