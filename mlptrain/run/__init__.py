"""A training run on disk: train(), the epoch loop, resuming, the run directory, checkpoints, metrics.

=================== ================================================================
module              what it owns
=================== ================================================================
``run``             :func:`train`: check, accept, train
``loop``            the epoch loop: steps, the log interval, evaluation, checkpoints, stop requests
``interval``        a log interval: its metrics, inf/NaN checks and time
``resume``          where a run starts: fresh, or a resume planned from its checkpoint
``restore``         the settings of the run a resume continues
``rundir``          the run directory: its lock, what it holds, ``run.json``
``checkpoint``      the checkpoint file format
``saving``          ``Writer``: checkpoints written on a thread of their own
``metrics``         ``metrics.jsonl``: the writer, the reader, a resume's prefix
``sinks``           ``metrics.csv`` and TensorBoard
``faults``          inf/NaN diagnostics and out-of-memory messages
=================== ================================================================
"""
