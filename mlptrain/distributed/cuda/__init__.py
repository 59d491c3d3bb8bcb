"""The GPU half of data parallelism: NCCL.

=================== ================================================================
module              what it owns
=================== ================================================================
``nccl``            :class:`NcclComm`: the communicator of data parallelism over NCCL
=================== ================================================================

Every module here imports CuPy (or nvmath) when it is imported; what that rule means for the rest of
the package (engines, no GPU needed to import mlptrain) is said once, in ``docs/architecture.md``.
"""
