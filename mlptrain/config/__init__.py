"""The configuration: the typed schema, its keys, and overrides a shell passes unchanged.

=================== ================================================================
module              what it owns
=================== ================================================================
``schema``          the typed schema Hydra validates against (``TrainConfig``, one dataclass per group)
``keys``            the settings' dotted keys, and the real key for one that is none
``shell``           Hydra overrides written so that a POSIX shell passes them unchanged
=================== ================================================================
"""
