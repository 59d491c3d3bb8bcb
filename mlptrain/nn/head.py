"""The output head: how the loss and the output layer's gradients are computed, decided once.

The output layer sits between two kinds of work. Below it the network is GEMMs with epilogs;
above it is the loss. Where the head is small (MNIST: batch 256, 10 classes) the GEMMs of the
output layer's backward are latency, not work, and two of them can be done better by the loss
side on the GPU:

=============== ========================================================================
mode            what happens after the forward pass
=============== ========================================================================
``gemm``        the loss gives ``dlogits``; the network runs the output layer's backward as
                GEMMs: the weight gradient with BGRADB (its bias gradient) and the input
                gradient with DRELU or DRELU_BGRAD. The CPU, naive execution, large heads.
``loss_bias``   as ``gemm``, but the loss kernel also sums ``dlogits`` over the batch in its
                reduction pass: the output bias gradient, so the weight-gradient GEMM needs
                no BGRADB epilog, which costs that small GEMM more than the sum costs the loss
                (docs/benchmarks.md, "Figures moved out of the code"). GPU, fused, one-block losses.
``kernel``      as ``loss_bias``, and the output layer's input gradient (K = classes, where
                cuBLASLt runs DRELU_BGRAD as three kernels) comes from one small kernel that
                also sums the layer below's bias gradient (:mod:`mlptrain.nn.cuda.head`).
                GPU, fused, cross-entropy, ReLU below, ``execution.head_kernel=true``.
=============== ========================================================================

Every mode computes the same gradients (the GPU tests hold the kernels to the NumPy epilog
contract); they differ in rounding order only. The trainer and the benchmarks call
:class:`OutputHead`; nothing else decides.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from mlptrain.base.backend import get_array_module
from mlptrain.base.cuda_source import Job
from mlptrain.nn.losses import LOSSES, class_weighted, row_weighted
from mlptrain.nn.network import MLP, HeadGrads

HEAD_MODES = ("gemm", "loss_bias", "kernel")


class OutputHead:
    """The loss of the logits and the part of the output layer's backward the loss side does.

    Args:
        loss: a name of :data:`mlptrain.nn.losses.LOSSES` (``cross_entropy``, ``mse``, or a registered one).
        mode: one of :data:`HEAD_MODES` (see the module docstring); :meth:`choose` picks it.
    """

    def __init__(self, loss: str, mode: str = "gemm") -> None:
        if loss not in LOSSES:
            raise ValueError(f"loss {loss!r} is unknown; expected one of {', '.join(LOSSES)}")
        if mode not in HEAD_MODES:
            raise ValueError(f"head mode {mode!r} is unknown; expected one of {', '.join(HEAD_MODES)}")
        if mode == "kernel" and not LOSSES[loss].head_kernel:
            raise ValueError(f"the head kernel follows the cross-entropy loss kernel; use mode 'loss_bias' for {loss}")
        self.loss_name = loss
        self.loss_fn = LOSSES[loss].fn
        self.mode = mode
        self.class_weight: list[float] | None = None  # model.class_weight, as trained (run.json, the log)
        self.step_loss: Any = None  # the training step's loss where it differs from loss_fn (weigh_rows)

    def weigh_classes(self, class_weight: np.ndarray, xp: Any) -> None:
        """Weight each row's cross-entropy by its class: ``class_weight (C,)`` float32, uploaded here once.

        Every mode takes the weights: the loss kernels scale each row's ``dlogits`` (and its sum, the output
        bias gradient of ``loss_bias`` and ``kernel``) by ``w[y_i] / sum w``, and the head kernel of ``kernel``
        only multiplies the ``dlogits`` it is given by the output weight, so no mode changes.
        """
        if not LOSSES[self.loss_name].head_kernel:  # the cross-entropy's kernels are the ones that take weights
            raise ValueError(
                f"model.class_weight weights the cross_entropy loss; model.loss={self.loss_name} takes none"
            )
        self.loss_fn = class_weighted(xp.asarray(class_weight, dtype=xp.float32))
        self.class_weight = [float(w) for w in class_weight]

    def weigh_rows(self, classification: bool) -> None:
        """Weight each training row by its weight (``data.weight``), carried as the last column of the training
        batches' targets (:func:`mlptrain.nn.losses.row_weighted`): the step's loss becomes ``sum_i w_i l_i /
        sum_i w_i``. Call it after the loss is final (class weights, the targets' units); evaluation's loss
        (:meth:`evaluate`, whose batches carry no weights) stays :attr:`loss_fn`.

        On the GPU the weighted loss runs as array operations, in every mode: the loss kernels take class weights
        only, and the head kernel of ``kernel`` only multiplies the ``dlogits`` it is given by the output weight.
        """
        self.step_loss = row_weighted(self.loss_fn, classification)

    @property
    def train_loss(self) -> Any:
        """The training step's loss function: :attr:`loss_fn`, or its row-weighted twin (:meth:`weigh_rows`)."""
        return self.loss_fn if self.step_loss is None else self.step_loss

    @classmethod
    def choose(
        cls, *, loss: str, gpu: bool, fused: bool, relu: bool, widths: list[int], batch_size: int, head_kernel: bool
    ) -> OutputHead:
        """The fastest mode that applies, for batches of ``batch_size`` (smaller last batches fit too)."""
        if not (gpu and fused):
            return cls(loss, "gemm")
        from mlptrain.nn.cuda.head import head_kernel_applies
        from mlptrain.nn.cuda.losses import small_head

        classes = widths[-1]
        if not small_head(batch_size, classes):
            return cls(loss, "gemm")
        kernel = head_kernel and LOSSES[loss].head_kernel and relu and len(widths) > 2
        return cls(loss, "kernel" if kernel and head_kernel_applies(batch_size, classes) else "loss_bias")

    def grads(
        self, model: MLP, logits: Any, y: Any, grad_scale: Any, *, inplace: bool = False
    ) -> tuple[Any, Any, Any, HeadGrads]:
        """``(loss, correct, dlogits (B, C), head grads)``: the loss side of the backward, on the device.

        ``gemm``: the loss only; ``loss_bias``: with the output bias gradient; ``kernel``: also the
        output layer's input gradient by ``nn/cuda/head.py``'s kernel, in place of its DRELU_BGRAD GEMM.

        ``inplace``: ``dlogits`` is written over ``logits`` (the training step's logits are not needed after).
        """
        if self.mode == "gemm":
            loss, dlogits, correct = self.train_loss(logits, y, grad_scale, inplace=inplace)
            return loss, correct, dlogits, HeadGrads()
        loss, dlogits, correct, db_out = self.train_loss(logits, y, grad_scale, bias_grad=True, inplace=inplace)
        if self.mode == "loss_bias":
            return loss, correct, dlogits, HeadGrads(bias_grad=db_out)
        from mlptrain.nn.cuda.head import head_input_grad

        top, below = model.layers[-1], model.layers[-2]
        weight = top.weight.for_gemm(cast=False)  # (C, H)
        if weight.dtype != dlogits.dtype:  # precision=fp8: the float32 master (Param.gemm_casts), in 16 bits here
            weight = weight.astype(dlogits.dtype)
        # one kernel: dZ_below = (dlogits @ W) * relu'(Z_below), and its sum over the batch
        dz_below, db_below = head_input_grad(dlogits, weight, below.mask, bias_grad_below=not below.bias_grad_in_wgrad)
        return loss, correct, dlogits, HeadGrads(bias_grad=db_out, input_grad=dz_below, input_bias_grad=db_below)

    def backward(self, model: MLP, logits: Any, y: Any, grad_scale: Any) -> tuple[Any, Any]:
        """The loss, then every gradient of ``model``; returns the device ``(loss, correct)``.

        Where the training step's backward starts: :meth:`grads` gives the loss, ``dlogits (B, C)``
        and what the loss side did of the output layer's backward (:class:`HeadGrads`), then
        :meth:`MLP.backward <mlptrain.nn.network.MLP.backward>` does the rest, layer by layer
        (the math of each layer: :class:`mlptrain.nn.layers.Linear`). In mode ``kernel`` the output
        layer's input-gradient GEMM, ``dZ_below = (dlogits @ W) * relu'(Z_below)`` with DRELU_BGRAD
        (DRELU), is not run: ``nn/cuda/head.py``'s kernel (:func:`mlptrain.nn.cuda.head.head_input_grad`)
        computes it, and the layer below's bias gradient, here, and the network takes it as given.

        The logits are consumed: their gradient is written over them. Handed over as a one-element
        list (``[logits]``, emptied here), no reference stays behind, and the backward frees
        ``dlogits`` as soon as the output layer's GEMMs have read it (:meth:`MLP.backward`).
        """
        z = logits.pop() if isinstance(logits, list) else logits
        loss, correct, dlogits, head = self.grads(model, z, y, grad_scale, inplace=True)
        handoff = [dlogits]  # the only reference, once z and dlogits are gone
        del z, dlogits
        model.backward(handoff, head)
        return loss, correct

    def evaluate(self, logits: Any, y: Any) -> tuple[Any, Any]:
        """The device ``(loss, correct)`` of ``logits (B, C)`` against ``y (B,)``, no gradient needed."""
        loss, _, correct = self.loss_fn(logits, y)
        return loss, correct

    # --- compiled ahead (mlptrain.step.cuda.precompile) -------------------------------------------------

    def precompile_jobs(self, model: MLP, dtype: Any, batches: list[tuple[int, Any, bool]], scale: Any) -> list[Job]:
        """The kernels of :meth:`backward` and :meth:`evaluate`, compiled ahead by the very calls on zeros.

        ``batches``: ``(rows, y, training)`` for each batch shape of the run, training or evaluation (``y``: the
        loader's targets, for their dtype and shape); ``dtype``: the logits'; ``scale``: the loss scale (0-d).
        """
        dtype, outputs = np.dtype(dtype), model.widths[-1]
        rows = sorted({r for r, _, _ in batches}, reverse=True)
        jobs = []
        if rows:  # the scratch: logits, their gradient (and float32 copies)
            sizes = ", ".join(map(str, rows))
            run = functools.partial(self._compile_losses, outputs, dtype, batches, scale)
            name = f"{self.loss_name} of {dtype.name} logits, {outputs} outputs, batches of {sizes} rows"
            jobs.append(Job(name, "loss", run, scratch=rows[0] * outputs * 16))
        train = [r for r, _, training in batches if training]
        if self.mode == "kernel" and train:  # (an ensemble's head hands over evaluation's batches only)
            run = functools.partial(self._compile_kernel, model, dtype, train)
            jobs.append(Job(f"mlptrain_head_dgrad ({outputs} classes, {dtype.name})", "loss", run))
        return jobs

    def _compile_losses(self, outputs: int, dtype: Any, batches: list[tuple[int, Any, bool]], scale: Any) -> None:
        """The step's loss (scaled; with the output bias gradient where the head takes it) and evaluation's."""
        xp = get_array_module(scale)
        scale = xp.zeros_like(scale)
        for r, y_like, training in batches:
            logits, y = xp.zeros((r, outputs), dtype), xp.zeros((r, *y_like.shape[1:]), y_like.dtype)
            if training:  # grads()
                self.train_loss(logits, y, scale, bias_grad=self.mode != "gemm")
            else:
                self.evaluate(logits, y)

    def _compile_kernel(self, model: MLP, dtype: Any, rows: list[int]) -> None:
        """The head kernel (:meth:`grads` in mode ``kernel``) for each training batch size."""
        from mlptrain.nn.cuda.head import compile_ahead

        top, below = model.layers[-1], model.layers[-2]
        compile_ahead(top.weight.value.shape, dtype, rows, bias_grad_below=not below.bias_grad_in_wgrad)
