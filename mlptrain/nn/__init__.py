"""The model and its fused math: the epilog contract, execution, layers, the network, the head, losses.

=================== ================================================================
module              what it owns
=================== ================================================================
``epilogs``         the cuBLASLt epilog contract in NumPy: the CPU engine and the GPU's oracle
``epilogs_fp8``     the same contract in FP8 (the casts, the scaled GEMM)
``fp8``             per-tensor delayed scaling and the GEMM engine that quantises each operand
``execution``       fused and naive execution of a layer's GEMMs; ``Gemm``, ``NumpyGemm``, ``ACTIVATIONS``
``layers``          ``Linear``: one layer's forward and backward (the math, the epilogs); ``Param``: what it owns
``network``         ``MLP``: the chain of layers, forward and backward
``head``            ``OutputHead``: how the loss and the output layer's gradients are computed
``losses``          softmax cross-entropy and MSE through ``xp``; ``LOSSES``
``scores``          the scores users read (balanced accuracy, F1, ROC AUC, log loss; RMSE, MAE, R²) from sums
``cuda/``           the same concepts on the GPU (the GEMM engine, the loss and head kernels, FP8)
=================== ================================================================

Where to read one layer, forward and backward (the math first, each step with its cuBLASLt epilog):

* the layer: :class:`~mlptrain.nn.layers.Linear` in ``layers.py``. Its docstring is the math;
  ``forward`` is one GEMM (RELU_AUX_BIAS), ``param_grads`` and ``grad_below`` the backward's two
  (BGRADB for ``dW`` and ``db``; DRELU or DRELU_BGRAD for ``dZ_below = (dZ @ W) * relu'(Z_below)``).
  Each is one call of :class:`~mlptrain.nn.execution.FusedExecution` (``execution.py``), which picks
  the epilog (the naive twin beside it does the same math unfused).
* the forward of the network: :meth:`MLP.forward <mlptrain.nn.network.MLP.forward>` (``network.py``).
* the backward of a training step: :meth:`OutputHead.backward <mlptrain.nn.head.OutputHead.backward>`
  (``head.py``: the loss and ``dlogits``), then :meth:`MLP.backward <mlptrain.nn.network.MLP.backward>`
  (``network.py``: the math in its docstring, then the engineering in its helpers: memory frees, the
  weight gradients on a side stream). For small GPU heads the output layer's DRELU_BGRAD GEMM is
  replaced by one kernel in ``cuda/head.py``, called from ``OutputHead.grads``.
"""
