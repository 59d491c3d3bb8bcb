"""The ground floor: what every part of mlptrain uses, importing nothing of mlptrain above it.

=================== ================================================================
module              what it owns
=================== ================================================================
``backend``         the array module and the device: where the CPU side meets CuPy
``errors``          every user-facing exception
``fs``              ``atomic_write``, the one way a file is written; the cache folder
``registry``        ``Registry`` (the named options of one concept) and ``Range``
``stopping``        the stop a run can be asked for: the ``Stop`` protocol, ``StopRequest``
``timeline``        where a run's wall clock goes, from the process's start
``cuda_source``     pieces of CUDA source the CPU modules write (plain Python), ``Job``
``member_settings`` an ensemble's per-member rates, weight decay, frozen flags; the stacked layout
``cuda/``           compiling and timing kernels: ``kernels``, ``plain_kernels``, ``timing``
=================== ================================================================
"""
