"""An ensemble's loss and its prediction: per-member losses over stacked logits, and the members' mean.

The members train independently: member ``k``'s loss is the single model's loss of its logits
``(B, C)`` against its own batch's targets, and its ``dlogits`` the single model's, so the batched
backward (:class:`mlptrain.nn.batched.BatchedMLP`) gives every member the gradients it would get alone.
:class:`MemberHead` computes them member by member, into the stacked ``dlogits (K, B, C)`` (written over
the logits, as the single head does), and returns the losses and counts as ``(K,)`` arrays. On the GPU the
plain cross-entropy takes every member at once, and its per-member sums are the kernels of
:mod:`mlptrain.nn.cuda.members`, this module's GPU half (with the step's per-member tally).

Where a single model's head would take the head kernel (:meth:`mlptrain.nn.head.OutputHead.choose`: GPU, fused,
cross-entropy, ReLU below, a small head), :class:`MemberHead` is in mode ``kernel``: the output layer's input
gradient of every member, ``dZ_below (K, B, H)`` with DRELU(_BGRAD), is one launch of
:func:`mlptrain.nn.cuda.member_head.member_input_grad` in place of the batched GEMM and its mask-and-sum pass.

The ensemble predicts the members' mean: the mean probability of a classification (the mean of the
softmaxes, whose log :func:`ensemble_logits` returns, so that the usual scores read it as logits: its
argmax is the ensemble's class and its cross-entropy the ensemble's log loss), the mean output of a
regression, and of a classification trained with a regression loss (``model.loss=mse`` on one-hot classes,
whose outputs are no logits: :func:`mean_of_probabilities`).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from mlptrain.base.backend import get_array_module
from mlptrain.base.cuda_source import Job
from mlptrain.nn.head import OutputHead
from mlptrain.nn.losses import regression_losses, softmax_cross_entropy
from mlptrain.nn.network import MLP, HeadGrads

MEMBER_HEAD_MODES = ("gemm", "kernel")  # no "loss_bias": the members' loss kernels sum no bias gradient


class MemberHead(OutputHead):
    """The loss of each member's logits, and in head mode ``kernel`` the output layer's input gradient.

    Modes (:data:`MEMBER_HEAD_MODES`): ``gemm``, the network's batched GEMMs do the output layer's backward
    (BGRADB for its bias gradient, DRELU(_BGRAD) for its input gradient); ``kernel``, as ``gemm`` but the input
    gradient, and the layer below's bias gradient with ``drelu_bgrad``, come from the members' head kernel
    (:func:`mlptrain.nn.cuda.member_head.member_input_grad`). No ``loss_bias``: the members' loss kernels sum no bias
    gradient, so the output layer's weight-gradient GEMM keeps its BGRADB in both modes.
    """

    def __init__(self, loss: str, mode: str = "gemm") -> None:
        if mode not in MEMBER_HEAD_MODES:
            raise ValueError(f"an ensemble's head mode {mode!r} is unknown; expected one of {MEMBER_HEAD_MODES}")
        super().__init__(loss, mode)
        self.member_losses: list[Any] | None = None  # member k's own loss function (its targets' units), if set
        self.sums: Any = None  # GPU: the members' sums beside the backward (nn/cuda/members.MemberSums), once stepped

    @classmethod
    def choose(
        cls, *, loss: str, gpu: bool, fused: bool, relu: bool, widths: list[int], batch_size: int, head_kernel: bool
    ) -> MemberHead:
        """``kernel`` where one member alone would take it (:meth:`OutputHead.choose` decides, for every head),
        else ``gemm``: on the CPU, in naive execution, for large heads, with ``execution.head_kernel=false``."""
        single = OutputHead.choose(
            loss=loss, gpu=gpu, fused=fused, relu=relu, widths=widths, batch_size=batch_size, head_kernel=head_kernel
        )
        return cls(loss, "kernel" if single.mode == "kernel" else "gemm")

    def backward(self, model: MLP, logits: Any, y: Any, grad_scale: Any) -> tuple[Any, Any]:
        """:meth:`OutputHead.backward`; on the GPU the members' means run on a stream of their own beside it (nothing
        in the backward waits for them), which the current stream waits for on the way out
        (:class:`mlptrain.nn.cuda.members.MemberSums`)."""
        if get_array_module(logits[0] if isinstance(logits, list) else logits) is np:  # (no reference kept)
            return super().backward(model, logits, y, grad_scale)
        if self.sums is None:
            from mlptrain.nn.cuda.members import MemberSums

            self.sums = MemberSums()
        with self.sums.beside():
            return super().backward(model, logits, y, grad_scale)

    def grads(
        self, model: MLP, logits: Any, y: Any, grad_scale: Any, *, inplace: bool = False
    ) -> tuple[Any, Any, Any, HeadGrads]:
        """``(loss (K,), correct (K,), dlogits (K, B, C), head grads)``: :meth:`losses`, then in mode ``kernel`` the
        output layer's input gradient of every member by one kernel, in place of its batched DRELU(_BGRAD) GEMM::

            dZ_below[k] (B, H) = (dlogits[k] (B, C) @ W[k] (C, H)) * relu'(Z_below[k]),   db_below[k] = sum_B

        which ``MLP._input_grad`` (``nn/network.py``) takes as given, the ``(K, H)`` bias gradient as the layer
        below's (its bias is ``(K, H)``)."""
        loss, correct, dlogits = self.losses(logits, y, grad_scale, inplace=inplace)
        if self.mode != "kernel":
            return loss, correct, dlogits, HeadGrads()
        from mlptrain.nn.cuda.member_head import member_input_grad

        top, below = model.layers[-1], model.layers[-2]
        weight = top.weight.for_gemm(cast=False)  # (K, C, H) the kept compute copy (an ensemble casts none on use)
        dz_below, db_below = member_input_grad(
            dlogits, weight, below.mask, bias_grad_below=not below.bias_grad_in_wgrad
        )
        return loss, correct, dlogits, HeadGrads(input_grad=dz_below, input_bias_grad=db_below)

    def losses(self, logits: Any, y: Any, grad_scale: Any, *, inplace: bool = False) -> tuple[Any, Any, Any]:
        """``(loss (K,), correct (K,), dlogits (K, B, C))``: member ``k``'s loss of ``logits[k]`` against ``y[k]``,
        each the single loss function's call (with ``inplace``, written over ``logits[k]``).

        On the GPU the plain cross-entropy runs over all members at once: fp16/bf16/fp32 logits in two launches,
        a row kernel over the ``K * B`` rows (a thread a row up to 16 classes) and one block that sums each member's
        rows into the ``(K,)`` losses and counts (:func:`mlptrain.nn.cuda.losses.member_cross_entropy_gpu`,
        :mod:`mlptrain.nn.cuda.members`); float64 ones as array operations (:func:`stacked_cross_entropy`: the row
        kernel computes in float32), where one call per member launches K loss kernels."""
        xp = get_array_module(logits)
        if xp is not np and self.loss_fn is softmax_cross_entropy and self.member_losses is None:
            if logits.dtype != xp.float64:
                from mlptrain.nn.cuda.losses import member_cross_entropy_gpu

                sums = self.sums if self.sums is not None and self.sums.active else None  # (the step's backward)
                loss, dlogits, correct = member_cross_entropy_gpu(logits, y, grad_scale, inplace=inplace, sums=sums)
            else:
                loss, dlogits, correct = stacked_cross_entropy(logits, y, grad_scale, inplace=inplace)
            return loss, correct, dlogits
        losses, counts, grads = [], [], []
        for k in range(logits.shape[0]):
            fn = self.loss_fn if self.member_losses is None else self.member_losses[k]
            loss, dlogits, correct = fn(logits[k], y[k], grad_scale, inplace=inplace)
            losses.append(loss)
            counts.append(correct)
            grads.append(dlogits)
        dlogits = logits if inplace else xp.stack(grads)  # in place: each member's written over its logits
        return xp.stack(losses), xp.stack(counts), dlogits

    def evaluate(self, logits: Any, y: Any) -> tuple[Any, Any]:
        """The ``(loss, correct)`` of one set of ``logits (B, C)`` (a member's, or :func:`ensemble_logits`)."""
        return super().evaluate(logits, y)

    def precompile_jobs(self, model: MLP, dtype: Any, batches: list[tuple[int, Any, bool]], scale: Any) -> list[Job]:
        """The kernels of :meth:`evaluate` (the single head's, on one member's ``(B, C)`` logits) and of :meth:`grads`
        over the members' stacked ``(K, B, C)`` logits (:meth:`losses`, and in mode ``kernel`` the members' head
        kernel), compiled ahead by the very calls on zeros (``batches``: :meth:`OutputHead.precompile_jobs`)."""
        jobs = super().precompile_jobs(model, dtype, [b for b in batches if not b[2]], scale)
        train = [(r, y_like) for r, y_like, training in batches if training]
        if train:
            k, outputs, dtype = model.members, model.widths[-1], np.dtype(dtype)
            sizes = ", ".join(str(r) for r, _ in train)
            run = functools.partial(self._compile_step_losses, model, dtype, train, scale)
            name = f"{self.loss_name} of {k} members' {dtype.name} logits, {outputs} outputs, batches of {sizes} rows"
            jobs.append(Job(name, "loss", run, scratch=k * max(r for r, _ in train) * outputs * 16))
            if self.mode == "kernel":
                run = functools.partial(self._compile_member_kernel, model, dtype, [r for r, _ in train])
                name = f"mlptrain_member_head_dgrad ({k} members, {outputs} classes, {dtype.name})"
                jobs.append(Job(name, "loss", run))
        return jobs

    def _compile_step_losses(self, model: MLP, dtype: Any, train: list[tuple[int, Any]], scale: Any) -> None:
        """:meth:`losses` as the training step calls it (in place), on zero logits ``(K, rows, C)`` of each batch."""
        xp = get_array_module(scale)
        scale = xp.zeros_like(scale)
        k, outputs = model.members, model.widths[-1]
        for r, y_like in train:
            logits, y = xp.zeros((k, r, outputs), dtype), xp.zeros((k, r, *y_like.shape[1:]), y_like.dtype)
            self.losses(logits, y, scale, inplace=True)

    def _compile_member_kernel(self, model: MLP, dtype: Any, rows: list[int]) -> None:
        """The members' head kernel (:meth:`grads` in mode ``kernel``) for each training batch size."""
        from mlptrain.nn.cuda.member_head import compile_members_ahead

        top, below = model.layers[-1], model.layers[-2]
        compile_members_ahead(top.weight.value.shape, dtype, rows, bias_grad_below=not below.bias_grad_in_wgrad)


def stacked_cross_entropy(logits: Any, y: Any, grad_scale: Any = 1.0, *, inplace: bool = False) -> tuple:
    """:func:`~mlptrain.nn.losses.softmax_cross_entropy` of every member at once: ``logits (K, B, C)``, labels
    ``y (K, B)``; returns ``(loss (K,), dlogits (K, B, C), correct (K,))``, member k's the single function's (the
    same formulas over the last axis; equal to rounding, not bit for bit: the CPU calls the single function)."""
    xp = get_array_module(logits)
    _, b, c = logits.shape
    z = logits.astype(xp.float64 if logits.dtype == xp.float64 else xp.float32)  # (K, B, C), a copy
    z -= z.max(axis=-1, keepdims=True)
    e = xp.exp(z)
    s = e.sum(axis=-1, keepdims=True)  # (K, B, 1)
    onehot = xp.arange(c) == y[..., None]  # (K, B, C) bool
    loss = (xp.log(s[..., 0]) - (z * onehot).sum(axis=-1)).mean(axis=-1)  # (K,)
    correct = (logits.argmax(axis=-1) == y).sum(axis=-1)  # (K,)
    e /= s  # softmax
    e -= onehot
    e *= grad_scale / b if isinstance(grad_scale, float) else grad_scale * (1.0 / b)
    if inplace:
        logits[...] = e
        return loss, logits, correct
    return loss, e.astype(logits.dtype, copy=False), correct


def mean_of_probabilities(task: str, loss: str) -> bool:
    """Whether an ensemble of ``task`` trained with ``loss`` averages its members' probabilities (a classification
    by cross-entropy: its outputs are logits) or their outputs (a regression, or classes trained with ``mse``
    on one-hot targets, scored by that loss as the members are)."""
    return task == "classification" and loss not in regression_losses()


def ensemble_logits(logits: Any, probabilities: bool) -> Any:
    """The ensemble's prediction from the members' ``logits (K, B, C)`` as ``(B, C)`` logits.

    ``probabilities`` (:func:`mean_of_probabilities`: a classification by cross-entropy):
    ``log(mean_k softmax(logits_k))``, the log of the mean probability (its softmax is that mean, so the scores
    and the cross-entropy read it as they read one model's logits); otherwise (a regression, or classes trained
    with a regression loss) the mean output. Computed in float64 where the logits are float64, else float32.
    """
    xp = get_array_module(logits)
    wide = logits.astype(xp.float64 if logits.dtype == xp.float64 else xp.float32)
    if not probabilities:
        return wide.mean(axis=0)
    top = wide.max(axis=-1, keepdims=True)  # (K, B, 1), for a stable softmax
    e = xp.exp(wide - top)
    p = e / e.sum(axis=-1, keepdims=True)  # (K, B, C) each member's probabilities
    return xp.log(xp.maximum(p.mean(axis=0), xp.finfo(p.dtype).tiny))  # (B, C); tiny: no log(0) = -inf


class MemberMean:
    """An ensemble used as one model: :meth:`forward` takes ``x (B, in)`` and returns the ensemble's ``(B, C)``
    (:func:`ensemble_logits`), every member's forward one batched GEMM per layer on the same rows. What
    predict and evaluate score a checkpoint of ``ensemble.size > 1`` with (:mod:`mlptrain.inference.predictor`).
    """

    def __init__(self, model: Any, probabilities: bool) -> None:
        self.model = model  # a mlptrain.nn.batched.BatchedMLP
        self.probabilities = probabilities  # the mean probability, or the mean output (mean_of_probabilities)
        self.widths = model.widths

    @property
    def members(self) -> int:
        return int(self.model.members)

    @property
    def layers(self) -> list[Any]:
        """The members' stacked layers (``weight.value (K, out, in)``): what the exports read."""
        return list(self.model.layers)

    def forward(self, x: Any, keep: bool = False) -> Any:
        """``x (B, in) -> (B, C)``: the members' mean probability as log-probabilities, or their mean output."""
        if keep:
            raise ValueError("an ensemble's mean is for inference: train the members (BatchedMLP), keep=False here")
        xp = get_array_module(x)
        logits = self.model.forward(xp.stack([x] * self.members), keep=False)  # (K, B, in) -> (K, B, C)
        return ensemble_logits(logits, self.probabilities).astype(logits.dtype)
