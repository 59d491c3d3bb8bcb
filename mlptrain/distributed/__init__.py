"""Data parallelism: the logic of a step split across ranks, independent of the transport.

Issue #18 asks for data-parallel training on NCCL. What is here is the part that does not depend on
NCCL and that the CPU can check: how each rank takes its shard of every global batch
(:func:`~mlptrain.distributed.dp.shard_rows`), how the ranks' gradients become the gradient of the
global batch (:class:`~mlptrain.distributed.dp.GradientSync`), and a communicator of in-process ranks
(:class:`~mlptrain.distributed.comm.LocalGroup`) that the tests run it with, and what launchers tell
a process (``torchrun``'s and ``mpirun``'s environment) with the TCP rendezvous that will carry
NCCL's unique id (:mod:`~mlptrain.distributed.launch`). The NCCL communicator, the launcher of
``distributed.gpus=N`` and the bucketed all-reduce inside the CUDA graph are not built yet; no
command-line option reaches this package.
"""
