"""What can stop a run, and the messages that say why: inf/NaN, running out of memory (signals, the
stop a run is asked for: :mod:`mlptrain.stopping`).

* :func:`nonfinite_error` and :func:`check_scaler`: inf/NaN in a loss, a gradient or a parameter
  stops the run naming the step and the tensors; in fp16 only a persistent overflow does.
* :func:`out_of_memory`: a :class:`~mlptrain.errors.ResourceError` naming the sizes to lower.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from mlptrain.backend import Backend
from mlptrain.config import TrainConfig
from mlptrain.errors import NonFiniteError, ResourceError
from mlptrain.trainer import Trainer


def nonfinite_tensors(tr: Trainer, *, grads: bool) -> list[str]:
    """Names of the gradients (if ``grads``) and parameters holding inf/NaN, in model order.

    On the GPU one kernel flags them all (:mod:`mlptrain.gpu.nonfinite`: one launch per dtype,
    compiled once per machine, not a CuPy reduction per tensor). On the CPU, where this runs
    every step, one dot product per tensor screens it (a sum of squares is finite only if every
    element is) and a flagged tensor is confirmed element-wise, since the dot product itself can
    overflow.
    """
    params = tr.model.params
    items = [(f"{p.name} gradient", p.grad) for p in params if grads and p.grad is not None]
    items += [(p.name, p.value) for p in params]
    if tr.backend.is_gpu:
        from mlptrain.gpu.nonfinite import nonfinite_flags

        return [n for (n, _), bad in zip(items, nonfinite_flags([a for _, a in items]), strict=True) if bad]
    with np.errstate(over="ignore", invalid="ignore"):
        screens = [np.dot(a.ravel(), a.ravel()) for _, a in items]
    return [n for (n, a), s in zip(items, screens, strict=True) if not math.isfinite(s) and not np.isfinite(a).all()]


def nonfinite_error(
    tr: Trainer, losses: np.ndarray, lrs: np.ndarray, epoch: int, *, each_step: bool, saved: str
) -> NonFiniteError | None:
    """The error for the first inf/NaN loss of the last ``len(losses)`` steps, or any inf/NaN tensor now.

    ``each_step``: checked after every step (the CPU), so the step that made them is known;
    otherwise checked once per log interval. ``saved`` says where the last checkpoint is.
    """
    scaled = tr.scaler.enabled  # fp16: overflowing gradients are the scaler's to handle, not errors
    bad = [] if scaled else [j for j, v in enumerate(losses) if not math.isfinite(v)]
    tensors = nonfinite_tensors(tr, grads=not scaled)
    if not bad and not tensors:
        return None
    j = bad[0] if bad else len(losses) - 1
    step = tr.step_count - len(losses) + j
    if each_step:  # checked after every step: this step made them
        where, after = f"at step {step}", ""
    elif bad:
        where, after = f"at step {step}", f" after step {tr.step_count - 1}"
    else:
        where, after = f"by step {step}", f" (checked every {tr.cfg.log_every} steps)"
    what = [f"the training loss is {losses[j]}"] if bad else []
    if tensors:
        what.append(f"inf/NaN{after} in " + ", ".join(tensors))
    return NonFiniteError(
        f"non-finite values {where} (epoch {epoch}, {tr.precision.name}): {'; '.join(what)}; lower "
        f"optimizer.lr (now {lrs[j]:.3g}) or use warm-up (optimizer.warmup_steps){saved}"
    )


def check_scaler(tr: Trainer) -> None:
    """fp16: stop after ``precision.max_consecutive_skips`` consecutive overflowing (skipped) steps."""
    max_skips = tr.cfg.precision.max_consecutive_skips
    if not tr.scaler.enabled or int(tr.scaler.consecutive_skips) < max_skips:
        return
    grads = [n for n in nonfinite_tensors(tr, grads=True) if n.endswith(" gradient")]
    raise NonFiniteError(
        f"{tr.precision.name} gradients overflowed on {int(tr.scaler.consecutive_skips)} consecutive steps up to step "
        f"{tr.step_count - 1} (loss scale now {float(tr.scaler.scale):.3g}; last step's inf/NaN: "
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
    note = f"; the last checkpoint {last} is intact" if last is not None and last.is_file() else ""
    return ResourceError(
        f"out of memory on the {backend.device} {where} ({type(exc).__name__}: {str(exc) or 'no details'}) with "
        f"data.batch_size={d.batch_size}, data.eval_batch_size={d.eval_batch_size}, {model}, "
        f"precision={cfg.precision.name}, execution={cfg.execution.mode.value}; {lower}{note}"
    )
