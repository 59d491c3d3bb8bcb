"""The GPU half of mlptrain: every module here imports CuPy (and nvmath) when it is imported.

The CPU modules never import CuPy or nvmath themselves: they compute with the array module
``xp`` they are given (:mod:`mlptrain.backend`), and reach this package only through imports
inside their GPU branches, so ``import mlptrain`` and the whole CPU path work without a GPU.

=================== ================================================================
module              what it owns
=================== ================================================================
``gemm``            :class:`NvmathGemm`: one planned nvmath ``Matmul`` per call site, epilogs
``plan_cache``      cuBLASLt algorithms kept on disk per GPU model and library version
``timing``          CUDA-event timing and graph capture of a function
``graph``           :class:`GraphedStep`: a step function replayed as one CUDA graph per shape
``probe``           the measured bias-gradient strategy of a model (``execution.bgrad=auto``)
``streams``         the second stream that the weight gradients run on
``multitensor``     one kernel over every parameter: the optimizer update, the overflow check
``kernels``         compiled element-wise kernels built from CUDA source the CPU modules write
``xent``            the softmax cross-entropy kernels
``head_kernel``     the output layer's input gradient as one small kernel
``torch_gemm``      nvmath GEMMs on torch tensors, for :mod:`mlptrain.torch` (imports nvmath, not CuPy)
``fp8_gemm``        precision=fp8: FP8 GEMMs with epilogs through the raw cuBLASLt bindings
``fp8_kernels``     precision=fp8: the FP8 casts (straight, transposed), amaxes and scale updates
``fp8_dgrad``       precision=fp8: DRELU_BGRAD after the plain FP8 GEMM (the mask, the bias gradient)
``nonfinite``       which of many tensors hold an inf or NaN, in one launch (or queued, read later)
``upload``          host arrays copied to the device through pinned staging buffers, two in flight
``torch_lt``        raw cuBLASLt plans on torch tensors (nvmath's layout rules, LtPlan), for ``torch_gemm``
``gather``          the data loader's batch gather, whole rows of any dtype
``prefetch``        a host-resident loader's batches: pinned slots, a copy stream, events per slot
``plain_kernels``   the header-free kernels (gather, nonfinite) compiled in one NVRTC call
``precompile``      the run's kernels compiled on threads before their first launch
``infer``           inference batches as replays of a CUDA graph (the forward pass passed in)
``infer_kernels``   inference's normalise and argmax kernels
``memory``          the step's live bytes by category beside the pools, and their high-water mark
``nccl``            :class:`NcclComm`: the communicator of data parallelism over NCCL
=================== ================================================================

These modules are engines: outside this package they import only the contracts they carry out
(:mod:`mlptrain.epilogs`, :mod:`mlptrain.epilogs_fp8`, :mod:`mlptrain.fp8`) and plain helpers
(:mod:`mlptrain.backend`, :mod:`mlptrain.files`, :mod:`mlptrain.cuda_source`), never the step, the
network, the builders or the precision policy (``tests/test_architecture.py`` lists today's exceptions).
"""
