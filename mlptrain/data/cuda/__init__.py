"""The GPU half of the data loaders: batch gathers, uploads, a host-resident loader's copies.

=================== ================================================================
module              what it owns
=================== ================================================================
``gather``          the data loader's batch gather, whole rows of any dtype
``upload``          host arrays copied to the device through pinned staging buffers, two in flight
``host_loader``     a host-resident loader's batches: pinned slots, a copy stream, events per slot
                    (the twin of :mod:`mlptrain.data.host_loader`)
=================== ================================================================

Every module here imports CuPy (or nvmath) when it is imported; what that rule means for the rest of
the package (engines, no GPU needed to import mlptrain) is said once, in ``docs/architecture.md``.
"""
