"""The GPU half of data parallelism: NCCL.

=================== ================================================================
module              what it owns
=================== ================================================================
``nccl``            :class:`NcclComm`: the communicator of data parallelism over NCCL
=================== ================================================================

Every module here imports CuPy (or nvmath) when it is imported. The CPU modules never import CuPy
or nvmath themselves: they compute with the array module ``xp`` they are given (:mod:`mlptrain.base.backend`)
and reach a ``cuda/`` folder only through imports inside their GPU branches, so ``import mlptrain`` and
the whole CPU path work without a GPU. These modules are engines: outside the ``cuda/`` folders they
import only the contracts they carry out (:mod:`mlptrain.nn.epilogs`, :mod:`mlptrain.nn.epilogs_fp8`,
:mod:`mlptrain.nn.fp8`) and plain helpers of :mod:`mlptrain.base`, never the step, the network, the
builders or the precision policy (``tests/test_architecture.py`` lists today's exceptions).
"""
