"""Data parallelism over NCCL: one process per GPU, each with its shard of every global batch.

Everything here sits below the run (the trainer, the loader and the loop use it); what starts the
processes, above the run, is :mod:`mlptrain.cli.launcher`.

* :mod:`~mlptrain.distributed.dp`: each rank's rows of a batch, and :class:`~mlptrain.distributed.dp.GradientSync`,
  which turns the ranks' gradients, losses and counts into the global batch's (per-layer all-reduces
  overlapped with the backward, inside the CUDA graph);
* :mod:`~mlptrain.distributed.comm`: the communicator interface, and ranks as threads for the CPU tests;
  the NCCL communicator is :mod:`mlptrain.distributed.cuda.nccl`;
* :mod:`~mlptrain.distributed.launch`: the launchers' environments, the TCP rendezvous of NCCL's id;
* :mod:`~mlptrain.distributed.control`: the stop every rank agrees on, the watchdog, the replica check.

docs/distributed.md is the user's guide.
"""
