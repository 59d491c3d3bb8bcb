"""What can stop a run, and the messages that say why: inf/NaN, running out of memory (signals, the
stop a run is asked for: :mod:`mlptrain.base.stopping`).

* :func:`nonfinite_error` and :func:`check_scaler`: inf/NaN in a loss, a gradient or a parameter
  stops the run naming the step and the tensors (a regression's loss beyond float32 names the targets'
  scale); with loss scaling (fp16, bf16, fp8) only a persistent overflow does, or one still going on
  at a checkpoint or the run's end (:func:`skipped_error`).
* :func:`out_of_memory`: a :class:`~mlptrain.base.errors.ResourceError` naming the sizes to lower.
* :func:`stop_if_data_changed`: a streamed split's file (``data.residency=stream``) changed under the run:
  ``last`` saved, and a :class:`~mlptrain.base.errors.DatasetError` naming the file and the change.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.base.backend import Backend
from mlptrain.base.errors import DatasetError, NonFiniteError, ResourceError
from mlptrain.config.schema import TrainConfig, ensemble_members
from mlptrain.run.checkpoint import Position
from mlptrain.step.trainer import Trainer


def nonfinite_tensors(tr: Trainer, *, grads: bool) -> list[str]:
    """Names of the gradients (if ``grads``) and parameters holding inf/NaN, in model order.

    On the GPU one kernel flags them all (:mod:`mlptrain.step.cuda.nonfinite`: one launch per dtype,
    compiled once per machine, not a CuPy reduction per tensor). On the CPU, where this runs
    every step, one dot product per tensor screens it (a sum of squares is finite only if every
    element is) and a flagged tensor is confirmed element-wise, since the dot product itself can
    overflow.
    """
    items = _checked(tr, grads)
    if tr.backend.is_gpu:
        from mlptrain.step.cuda.nonfinite import nonfinite_flags

        return [n for (n, _), bad in zip(items, nonfinite_flags([a for _, a in items]), strict=True) if bad]
    with np.errstate(over="ignore", invalid="ignore"):
        screens = [np.dot(a.ravel(), a.ravel()) for _, a in items]
    return [n for (n, a), s in zip(items, screens, strict=True) if not math.isfinite(s) and not np.isfinite(a).all()]


def _checked(tr: Trainer, grads: bool) -> list[tuple[str, Any]]:
    """``(name, array)`` of what the inf/NaN check reads: the gradients (if ``grads``), then the parameters."""
    params = tr.model.params
    items = [(f"{p.name} gradient", p.grad) for p in params if grads and p.grad is not None]
    return items + [(p.name, p.value) for p in params]


class IntervalChecks:
    """The checks of one log interval, queued on the device after its steps and read when the loop collects it.

    What :func:`nonfinite_error` and :func:`check_scaler` read from the device (which tensors hold
    inf/NaN, fp16's count of consecutive skipped steps), taken as the interval ends, so that the loop can
    read them one interval later without stopping the device (:class:`mlptrain.run.loop.Interval`). Without
    a GPU watch (the CPU) they are read at once.
    """

    def __init__(self, tr: Trainer, watch: Any = None) -> None:
        """``watch``: the GPU's :class:`~mlptrain.step.cuda.nonfinite.NonfiniteWatch`, kept by the caller (its
        pointer tables are made once); without one the checks are read now (the CPU)."""
        scaled = tr.scaler.enabled  # fp16: overflowing gradients are the scaler's to handle, not errors
        items = _checked(tr, grads=not scaled)
        self.names = [n for n, _ in items]
        self._skips: Any = None
        self._bad: list[str] | None = None
        if watch is None:  # read now (the CPU's checks cost a fraction of the per-step checks it runs anyway)
            self._bad = nonfinite_tensors(tr, grads=not scaled)
            self._skips = int(tr.scaler.consecutive_skips) if scaled else 0
            return
        if scaled:  # the count into page-locked memory, on the stream before the flags (whose event covers it)
            from mlptrain.step.cuda.nonfinite import copy_to_pinned

            self._skips = copy_to_pinned(tr.scaler.consecutive_skips)
        self._flags = watch.queue([a for _, a in items])

    @property
    def nonfinite(self) -> list[str]:
        """Names of the tensors that held inf/NaN when the interval ended (waits for the copy, GPU)."""
        if self._bad is None:
            self._bad = [n for n, bad in zip(self.names, self._flags.result(), strict=True) if bad]
        return self._bad

    @property
    def consecutive_skips(self) -> int:
        """fp16: steps skipped in a row up to the interval's end (0 without a loss scaler)."""
        if isinstance(self._skips, np.ndarray):
            self._flags.result()  # queued after the count's copy: once the flags are there, so is the count
        return int(self._skips or 0)


def nonfinite_error(
    tr: Trainer,
    losses: np.ndarray,
    lrs: np.ndarray,
    epoch: int,
    *,
    each_step: bool,
    saved: str,
    checks: IntervalChecks | None = None,
    last_step: int | None = None,
) -> NonFiniteError | None:
    """The error for the first inf/NaN loss of the last ``len(losses)`` steps, or any inf/NaN tensor.

    ``each_step``: checked after every step (the CPU), so the step that made them is known;
    otherwise checked once per log interval. ``saved`` says where the last checkpoint is.
    ``checks``: the tensors as the interval ended (:class:`IntervalChecks`; default: checked now), and
    ``last_step`` the interval's last step (default: the trainer's last).
    """
    scaled = tr.scaler.enabled  # fp16: overflowing gradients are the scaler's to handle, not errors
    bad = [] if scaled else [j for j, v in enumerate(losses) if not math.isfinite(v)]
    tensors = (checks or IntervalChecks(tr)).nonfinite
    if not bad and not tensors:
        return None
    last = tr.step_count - 1 if last_step is None else last_step
    j = bad[0] if bad else len(losses) - 1
    step = last + 1 - len(losses) + j
    if each_step:  # checked after every step: this step made them
        where, after = f"at step {step}", ""
    elif bad:
        where, after = f"at step {step}", f" after step {last}"
    else:
        where, after = f"by step {step}", f" (checked every {tr.cfg.log_every} steps)"
    what = [f"the training loss is {losses[j]}"] if bad else []
    if tensors:
        what.append(f"inf/NaN{after} in " + ", ".join(tensors))
    fix = f"lower optimizer.lr (now {lrs[j]:.3g}) or use warm-up (optimizer.warmup_steps)"
    if tr.members > 1 and (diverged := nonfinite_members(tr)):
        fix = members_fix(tr.cfg, diverged, fix)
    if bad and (zeros := zero_weight_rows(tr)) is not None:
        fix = (
            f"{zeros} of the {len(tr.dataset.y_train)} training rows weigh 0 (data.weight, or sample_weight), and a "
            "batch of only such rows has no weighted mean (0/0); raise the batch size (data.batch_size, batch_size), "
            f"or leave the zero-weight rows out; else {fix}"
        )
    elif bad and (top := targets_beyond_float32(tr)) is not None:
        fix = (
            f"it overflowed float32 (max {F32_MAX:.3g}) because of the targets' scale: they reach |y| = {top:.3g}, "
            "whose square is beyond it, and the loss is in the targets' units; normalise the targets (express "
            "them in larger units, divided by a power of ten) so that their squares fit"
        )
    return NonFiniteError(
        f"non-finite values {where} (epoch {epoch + 1}, {tr.precision.name}): {'; '.join(what)}; {fix}{saved}"
    )


def nonfinite_members(tr: Trainer) -> list[int]:
    """An ensemble's members whose loss of the epoch so far (``member_loss (K,)``, the sums of
    :class:`~mlptrain.run.ensemble.EnsembleTrainer`), parameters or gradients (``k`` of the stacked ``(K, ...)``)
    hold inf/NaN: read back to the host, once, when the run stops for them."""
    sums = getattr(tr, "member_loss", None)
    bad = {int(k) for k in np.flatnonzero(~np.isfinite(tr.backend.to_host(sums)))} if sums is not None else set()
    for p in tr.model.params:
        for a in (p.value, p.grad):
            if a is not None:
                finite = np.isfinite(tr.backend.to_host(a)).reshape(tr.members, -1).all(axis=1)  # (K,)
                bad.update(int(k) for k in np.flatnonzero(~finite))
    return sorted(bad)


def members_fix(cfg: TrainConfig, diverged: list[int], fix: str) -> str:
    """What to lower when an ensemble's ``diverged`` members stopped the run: their ``ensemble.lr`` (and
    ``ensemble.weight_decay``) values in a batched sweep, else ``fix`` (``optimizer.lr``, every member's)."""
    swept = {key: v for key in ("lr", "weight_decay") if (v := getattr(cfg.ensemble, key)) is not None}
    plural = "s" * (len(diverged) > 1)
    if not swept:
        return f"member{plural} {', '.join(map(str, diverged))} diverged; {fix}"

    def values(k: int) -> str:  # member k's swept settings: "ensemble.lr[2]=20"
        return ", ".join(f"ensemble.{key}[{k}]={v[k]:g}" for key, v in swept.items())

    who = ", ".join(f"{k} ({values(k)})" for k in diverged)
    lower = " or ".join(f"ensemble.{key}={list(v)}" for key, v in swept.items())
    return f"member{plural} {who} diverged; lower {lower} or use warm-up (optimizer.warmup_steps)"


def zero_weight_rows(tr: Trainer) -> int | None:
    """How many training rows weigh 0 (row weights: ``data.weight``, ``sample_weight``), or None where none does:
    a batch of only such rows has the weighted mean ``0 / 0``, a NaN loss (scikit-learn's MLP raises
    ZeroDivisionError there)."""
    w = tr.dataset.w_train
    zeros = 0 if w is None else int((np.asarray(w) == 0).sum())
    return zeros or None


F32_MAX = float(np.finfo(np.float32).max)


def targets_beyond_float32(tr: Trainer) -> float | None:
    """A regression's largest ``|y|`` (in the targets' units) when its square overflows float32, else None:
    the loss (in the targets' units) then overflows whatever the learning rate."""
    ds = tr.dataset
    if ds.task != "regression" or len(ds.y_train) == 0:
        return None
    y = np.asarray(ds.y_train, dtype=np.float64)
    if ds.target_scaling is not None:  # standardised: back to the targets' units
        y = y * ds.target_scaling.scale + ds.target_scaling.shift
    top = float(np.max(np.abs(y)))
    return top if top * top > F32_MAX else None


def skipped_error(tr: Trainer, last_loss: float, saved: str) -> NonFiniteError | None:
    """Loss scaling (fp16, bf16, fp8): the error for a checkpoint, or the run's end, reached while the steps
    are being skipped with an inf/NaN loss. Skipping waits out a transient overflow; a run that ends or
    checkpoints inside a run of them (too short to reach ``max_consecutive_skips``) has diverged, and stops
    as fp32 does: the model's forward overflows, so nothing of it is saved (the last checkpoint stays)."""
    if not tr.scaler.enabled or math.isfinite(last_loss):
        return None
    skips = int(tr.scaler.consecutive_skips)  # syncs the device (the checkpoint does anyway)
    if skips == 0:
        return None
    step = tr.step_count - 1
    return NonFiniteError(
        f"non-finite values at step {step} (epoch {step // tr.steps_per_epoch + 1}, {tr.precision.name}): the "
        f"training loss is {last_loss} and the last {skips} steps were skipped (inf/NaN gradients), so no "
        f"checkpoint is written; lower optimizer.lr (now {tr.lr_at(step):.3g}) or use warm-up "
        f"(optimizer.warmup_steps){saved}"
    )


def check_scaler(tr: Trainer, checks: IntervalChecks | None = None, last_step: int | None = None) -> None:
    """fp16: stop after ``precision.max_consecutive_skips`` consecutive overflowing (skipped) steps.

    ``checks``: the count as a log interval ended, its last step ``last_step`` (default: read now)."""
    max_skips = tr.cfg.precision.max_consecutive_skips
    if not tr.scaler.enabled:
        return
    skips = int(tr.scaler.consecutive_skips) if checks is None else checks.consecutive_skips
    if skips < max_skips:
        return
    last = tr.step_count - 1 if last_step is None else last_step
    grads = [n for n in nonfinite_tensors(tr, grads=True) if n.endswith(" gradient")]
    raise NonFiniteError(
        f"{tr.precision.name} gradients overflowed on {skips} consecutive steps up to step "
        f"{last} (loss scale now {float(tr.scaler.scale):.3g}; last step's inf/NaN: "
        f"{', '.join(grads) or 'none'}); the model diverged: lower optimizer.lr or use precision=bf16"
    )


def out_of_memory(
    exc: MemoryError, cfg: TrainConfig, backend: Backend, tr: Trainer | None, last: Path | None
) -> ResourceError:
    """A ResourceError naming the sizes to lower, after freeing CuPy's cached blocks.

    ``tr`` is None when memory ran out while loading the data or building the model; ``last`` is
    the last checkpoint written, if any.
    """
    try:
        backend.free_cached_memory()
    except Exception:  # pragma: no cover - best effort while reporting
        pass
    d = cfg.data
    if tr is None:
        where = "while loading the dataset, building the model and copying the data"
        model = f"model.hidden={list(cfg.model.hidden)}"
        lower = "lower data.batch_size or model.hidden, or use a smaller dataset (data.samples, data.path)"
    else:
        where = f"at step {tr.step_count}"
        model = f"model {'-'.join(map(str, tr.widths))} ({tr.model.num_params:,} parameters)"
        lower = "lower data.batch_size or model.hidden (data.eval_batch_size if it ran out while evaluating)"
    if (members := ensemble_members(cfg)) > 1:  # K members: every array of the step K times one model's
        key = "ensemble.folds" if cfg.ensemble.folds else "ensemble.size"
        model = f"{key}={members} (members of {model} each)"
        lower = f"lower {key} (the members), {lower.removeprefix('lower ')}"
    note = f"; the last checkpoint {last} is intact" if last is not None and last.is_file() else ""
    return ResourceError(
        f"out of memory on the {backend.device} {where} ({type(exc).__name__}: {str(exc) or 'no details'}) with "
        f"data.batch_size={d.batch_size}, data.eval_batch_size={d.eval_batch_size}, {model}, "
        f"precision={cfg.precision.name}, execution={cfg.execution.mode.value}; {lower}{note}"
    )


def stop_if_data_changed(loop: Any, pos: Position) -> None:
    """At an epoch's start (``pos``): if a file a split streams from changed since it was read (its size, mtime or
    inode, :meth:`mlptrain.data.rows.NormalisedRows.check_source`), save ``last`` at ``pos`` as any stop does and
    raise the :class:`DatasetError` that names the file and the change (``loop``: the
    :class:`mlptrain.run.loop.Loop`)."""
    tr = loop.tr
    try:
        for ld in [tr.train_loader, *tr.eval_loaders.values()]:
            check = getattr(ld.x, "check_source", None)  # a streamed split's (a host array has none)
            if check is not None:
                check()
    except DatasetError as exc:
        last = loop.run_dir.checkpoint("last")
        if loop.last_saved != (last, pos.step):
            loop.save("last", pos)
        loop.writer.wait()  # on disk before the message says so
        raise DatasetError(f"{exc}; the last checkpoint, {last} (step {pos.step}), is saved") from None
