"""One training step and its state: the trainer, its builders and runtime, optimizers, precision.

=================== ================================================================
module              what it owns
=================== ================================================================
``trainer``         ``Trainer``: the step and its state
``build``           one builder per config group
``runtime``         the device runtime apart from the step (stream, graphs, pools, precompile)
``optim``           SGD, Adam, AdamW: the NumPy update and the CUDA update of one element
``precision``       precision policies, ``LossScaler``
``schedule``        ``StepClock`` (the one step counter) and ``LRSchedule``
``steplog``         the end of a step in one kernel: loss scale, step count, rate, metrics ring
``bgrad``           where each hidden layer's bias gradient is reduced (``execution.bgrad``)
``memory``          what a step holds by formula (the twin of ``cuda/memory``)
``state_fit``       whether a checkpoint's state fits the trainer
``checks``          what the schema's types cannot check: ranges, settings silently ignored
``choices``         which schema field names which registry
``cuda/``           the step on the GPU: graphs, the multi-tensor kernels, precompiling, probes
=================== ================================================================
"""
