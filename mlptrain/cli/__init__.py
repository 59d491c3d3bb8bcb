"""The command line: ``python -m mlptrain`` (Hydra), the launcher, and the small commands beside training.

=================== ================================================================
module              what it owns
=================== ================================================================
``main``            ``python -m mlptrain``: the Hydra app over the typed schema
``help``            ``python -m mlptrain --help``: the schema's settings and the registered names
``hydra_errors``    Hydra's and OmegaConf's errors as one line
``launcher``        ``distributed.gpus=N``: one training process per GPU of this host
``sweep``           a multirun's ``summary.md`` and ``summary.csv``
``commands``        the commands' ``key=value`` arguments and ``--help``
``predict``         ``python -m mlptrain predict``: score a file of raw inputs
``evaluate``        ``python -m mlptrain evaluate``: a checkpoint's scores
``export``          ``python -m mlptrain export``: safetensors and ONNX
``plot``            ``python -m mlptrain plot``: curves and confusion figures
=================== ================================================================

``python -m mlptrain.predict`` (``.evaluate``, ``.export``, ``.plot``) still runs these modules:
:mod:`mlptrain` aliases the old names to them.
"""
