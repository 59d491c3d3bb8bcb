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
                also sums the layer below's bias gradient (:mod:`mlptrain.gpu.head_kernel`).
                GPU, fused, cross-entropy, ReLU below, ``execution.head_kernel=true``.
=============== ========================================================================

Every mode computes the same gradients (the GPU tests hold the kernels to the NumPy epilog
contract); they differ in rounding order only. The trainer and the benchmarks call
:class:`OutputHead`; nothing else decides.
"""

from __future__ import annotations

from typing import Any

from mlptrain.losses import LOSSES
from mlptrain.network import MLP, HeadGrads

HEAD_MODES = ("gemm", "loss_bias", "kernel")


class OutputHead:
    """The loss of the logits and the part of the output layer's backward the loss side does.

    Args:
        loss: ``cross_entropy`` or ``mse``.
        mode: one of :data:`HEAD_MODES` (see the module docstring); :meth:`choose` picks it.
    """

    def __init__(self, loss: str, mode: str = "gemm") -> None:
        if loss not in LOSSES:
            raise ValueError(f"loss {loss!r} is unknown; expected one of {', '.join(LOSSES)}")
        if mode not in HEAD_MODES:
            raise ValueError(f"head mode {mode!r} is unknown; expected one of {', '.join(HEAD_MODES)}")
        if mode == "kernel" and loss != "cross_entropy":
            raise ValueError("the head kernel follows the cross-entropy loss kernel; use mode 'loss_bias' for mse")
        self.loss_name = loss
        self.loss_fn = LOSSES[loss]
        self.mode = mode

    @classmethod
    def choose(
        cls, *, loss: str, gpu: bool, fused: bool, relu: bool, widths: list[int], batch_size: int, head_kernel: bool
    ) -> OutputHead:
        """The fastest mode that applies, for batches of ``batch_size`` (smaller last batches fit too)."""
        if not (gpu and fused):
            return cls(loss, "gemm")
        from mlptrain.gpu.head_kernel import head_kernel_applies
        from mlptrain.gpu.xent import small_head

        classes = widths[-1]
        if not small_head(batch_size, classes):
            return cls(loss, "gemm")
        kernel = head_kernel and loss == "cross_entropy" and relu and len(widths) > 2
        return cls(loss, "kernel" if kernel and head_kernel_applies(batch_size, classes) else "loss_bias")

    def grads(
        self, model: MLP, logits: Any, y: Any, grad_scale: Any, *, inplace: bool = False
    ) -> tuple[Any, Any, Any, HeadGrads]:
        """``(loss, correct, dlogits (B, C), head grads)``: the loss side of the backward, on the device.

        ``inplace``: ``dlogits`` is written over ``logits`` (the training step's logits are not needed after)."""
        if self.mode == "gemm":
            loss, dlogits, correct = self.loss_fn(logits, y, grad_scale, inplace=inplace)
            return loss, correct, dlogits, HeadGrads()
        loss, dlogits, correct, db_out = self.loss_fn(logits, y, grad_scale, bias_grad=True, inplace=inplace)
        if self.mode == "loss_bias":
            return loss, correct, dlogits, HeadGrads(bias_grad=db_out)
        from mlptrain.gpu.head_kernel import head_input_grad

        top, below = model.layers[-1], model.layers[-2]
        # one kernel: dZ_below = (dlogits @ W) * relu'(Z_below), and its sum over the batch
        dz_below, db_below = head_input_grad(
            dlogits, top.weight.for_gemm(cast=False), below.mask, bias_grad_below=not below.bias_grad_in_wgrad
        )
        return loss, correct, dlogits, HeadGrads(bias_grad=db_out, input_grad=dz_below, input_bias_grad=db_below)

    def backward(self, model: MLP, logits: Any, y: Any, grad_scale: Any) -> tuple[Any, Any]:
        """The loss, then every gradient of ``model``; returns the device ``(loss, correct)``.

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
