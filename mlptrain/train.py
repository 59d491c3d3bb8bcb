"""The training loop: build everything from a config, train, evaluate, log.

:func:`train` is the whole job behind ``python -m mlptrain``. :class:`Trainer` holds the
pieces (backend, model, optimizer, loss scaler, loaders) so tests, benchmarks and checkpoints
can drive single steps.

One training step (:meth:`Trainer.step_uncaptured`), all on the device, with no host
synchronisation, so on the GPU it is captured once into a CUDA graph and replayed
(:mod:`mlptrain.graph`, ``graph=false`` to turn off)::

    logits = model.forward(x)                       # fused: RELU_AUX_BIAS ... BIAS (3 GEMMs)
    loss, dlogits, correct, db = loss_fn(logits, y, scale)  # 1-2 kernels; db: output bias gradient
    dz, db_below = head_input_grad(dlogits, W_out, relu_aux)  # small heads: 1 kernel, not a GEMM
    model.backward(dlogits, db, (dz, db_below))     # fused: DRELU(_BGRAD), BGRADB (4-5 GEMMs)
    found_inf = scaler.check(grads)                 # fp16 only: 1 kernel over all gradients
    optimizer.step(lr, 1/scale, skip=found_inf,     # 1 kernel over all parameters, whose last
                   tail=log.tail(loss, correct, B)) # block updates the loss scale and the lr
                                                    # and records the metrics on the device

For 784-1024-1024-10 in fp16 that is 7 GEMMs and 4 small kernels (scripts/step_kernels.py lists
them). The host reads metrics back only every ``log_every`` steps (one sync per interval), from the
device ring of :class:`~mlptrain.steplog.StepLog`.

What a run promises (docs/reliability.md): ``checkpoints/last.npz`` after every
``checkpoint_every`` epochs and every ``checkpoint_steps`` steps, ``best.npz`` when the
validation accuracy improves (:mod:`mlptrain.checkpoint`); ``resume=`` continues a run with the
same per-step losses, bit for bit on the CPU; the first Ctrl-C or SIGTERM finishes the step, saves
``last`` and raises :class:`TrainingInterrupted`, a second stops at once; an inf/NaN loss, gradient or
parameter stops the run naming the step and the tensor; running out of memory raises
:class:`~mlptrain.errors.ResourceError` naming the sizes to lower.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import platform
import signal
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from tqdm.auto import tqdm

from mlptrain import __version__, checkpoint
from mlptrain.backend import Backend, get_backend
from mlptrain.checkpoint import CHECKPOINT_DIR, Best, OutputError, Position
from mlptrain.config import TrainConfig, to_plain, validate
from mlptrain.data import Dataset, load_dataset
from mlptrain.errors import ConfigError, MlptrainError, NonFiniteError, ResourceError
from mlptrain.execution import FusedExecution, NaiveExecution, NumpyGemm
from mlptrain.head import cross_entropy_head, head_kernel_applies
from mlptrain.loader import DataLoader
from mlptrain.losses import LOSSES, small_head
from mlptrain.metrics import MetricsWriter
from mlptrain.network import MLP
from mlptrain.optim import LRSchedule, make_optimizer
from mlptrain.precision import LossScaler, get_precision
from mlptrain.steplog import StepLog

log = logging.getLogger(__name__)


def model_widths(cfg: TrainConfig, dataset: Dataset) -> list[int]:
    """``[in, hidden..., out]``, checking configured widths against the dataset."""
    m = cfg.model
    in_f, out_f = dataset.num_features, dataset.num_classes
    if m.in_features is not None and m.in_features != in_f:
        raise ConfigError(
            f"model.in_features={m.in_features} does not match dataset {dataset.name!r}, which has {in_f} "
            "features per sample; set model.in_features={in_f} or null (taken from the dataset)".replace(
                "{in_f}", str(in_f)
            )
        )
    if m.out_features is not None and m.out_features != out_f:
        raise ConfigError(
            f"model.out_features={m.out_features} does not match dataset {dataset.name!r}, which has "
            f"{out_f} classes; set model.out_features={out_f} or null"
        )
    return [in_f, *m.hidden, out_f]


def make_gemm(backend: Backend, precision: Any, autotune: bool, plan_cache: bool = True) -> Any:
    """The GEMM engine: planned nvmath Matmuls on the GPU, the NumPy epilog contract on the CPU."""
    if backend.is_gpu:
        from mlptrain.gpu import NvmathGemm, PlanCache

        cache = PlanCache(PlanCache.default_path()) if plan_cache else None
        return NvmathGemm(tf32=precision.tf32, autotune=autotune, plan_cache=cache)
    return NumpyGemm()


class Trainer:
    """Everything a run needs, built from a validated :class:`TrainConfig`."""

    def __init__(self, cfg: TrainConfig, dataset: Dataset | None = None, backend: Backend | None = None) -> None:
        validate(cfg)
        self.cfg = cfg
        self.backend = backend or get_backend(cfg.device.value)
        xp = self.xp = self.backend.xp
        self.precision = get_precision(cfg.precision.name.value, self.backend)
        self.dataset = dataset or load_dataset(cfg.data, seed=cfg.seed)
        self.widths = model_widths(cfg, self.dataset)

        # Independent host streams for init and data order, from one seed.
        init_seed, data_seed = np.random.SeedSequence(cfg.seed).spawn(2)
        self.gemm = make_gemm(self.backend, self.precision, cfg.execution.autotune, cfg.execution.plan_cache)
        if cfg.execution.mode.value == "fused":
            self.execution: FusedExecution | NaiveExecution = FusedExecution(self.gemm)
        else:
            self.execution = NaiveExecution(self.gemm, xp)
        self.model = MLP(
            self.widths,
            execution=self.execution,
            xp=xp,
            rng=np.random.default_rng(init_seed),
            param_dtype=self.precision.param_dtype,
            compute_dtype=self.precision.compute_dtype,
            relu=cfg.model.activation.value == "relu",
            init=cfg.model.init.value,
        )
        # Small heads on the GPU: a small kernel computes the output layer's input gradient
        # (mlptrain.head), instead of a K = classes GEMM that cuBLASLt cannot fuse with DRELU_BGRAD.
        self.head_kernel = (
            self.backend.is_gpu
            and cfg.execution.head_kernel
            and cfg.execution.mode.value == "fused"
            and cfg.model.loss.value == "cross_entropy"
            and cfg.model.activation.value == "relu"
            and len(self.widths) > 2
            and head_kernel_applies(cfg.data.batch_size, self.widths[-1])
        )
        if self.backend.is_gpu and cfg.execution.wgrad_stream:  # dW GEMMs concurrent with the dX chain
            self.model.use_wgrad_stream()
        d = cfg.data
        cdt = self.precision.compute_dtype
        data_seed_int = int(data_seed.generate_state(1)[0])
        self.train_loader = DataLoader(
            self.dataset.x_train,
            self.dataset.y_train,
            d.batch_size,
            xp=xp,
            dtype=cdt,
            shuffle=True,
            drop_last=d.drop_last,
            seed=data_seed_int,
        )
        self.eval_loaders = {
            split: DataLoader(x, y, d.eval_batch_size, xp=xp, dtype=cdt, shuffle=False, drop_last=False, seed=0)
            for split, x, y in (
                ("val", self.dataset.x_val, self.dataset.y_val),
                ("test", self.dataset.x_test, self.dataset.y_test),
            )
            if len(x) > 0
        }
        self.optimizer = make_optimizer(cfg.optimizer.name.value, self.model.params, cfg.optimizer)
        p = cfg.precision
        self.scaler = LossScaler(
            xp,
            enabled=self.precision.loss_scaling,
            init_scale=p.init_scale,
            growth_factor=p.growth_factor,
            backoff_factor=p.backoff_factor,
            growth_interval=p.growth_interval,
        )
        self.loss_fn = LOSSES[cfg.model.loss.value]
        # Small heads on the GPU: the loss kernel sums dlogits over the batch (the output bias
        # gradient) in its reduction pass, cheaper there than a BGRADB epilog on a GEMM with N =
        # classes (on the H200, 784-1024-1024-10 at batch 256, fp16: 10.7 us with BGRADB, 4.4 without).
        self.bias_grad_from_loss = (
            self.backend.is_gpu and cfg.execution.mode.value == "fused" and small_head(d.batch_size, self.widths[-1])
        )
        self.steps_per_epoch = len(self.train_loader)
        self.total_steps = self.steps_per_epoch * cfg.epochs
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        o = cfg.optimizer
        # The learning rate of each step, computed on the device from a device step counter.
        self.schedule = LRSchedule(
            xp,
            base_lr=o.lr,
            total_steps=self.total_steps,
            schedule=o.schedule.value,
            warmup_steps=o.warmup_steps,
            min_ratio=o.min_lr_ratio,
        )
        # Per-step metrics and the end-of-step bookkeeping, on the device (read every log_every steps).
        self.log = StepLog(xp, cfg.log_every, self.scaler, self.schedule)
        self.step_count = 0  # optimizer steps taken (host counter; skipped fp16 steps included)
        self.graphed: Any = None
        # The stream the training loop runs on: a non-default CUDA stream on the GPU (graph
        # capture needs one); on the CPU a context that does nothing.
        self.stream: Any = contextlib.nullcontext()
        if self.backend.is_gpu:
            self.backend.xp.cuda.Device().synchronize()  # set-up work on the default stream is done
            self.stream = self.backend.xp.cuda.Stream(non_blocking=True)
        self._choose_bgrad()  # on the GPU it may time the step, so after everything the step uses
        if self.backend.is_gpu:
            if cfg.graph is not False:
                from mlptrain.graph import GraphedStep

                self.graphed = GraphedStep(self)

    def _choose_bgrad(self) -> None:
        """Set where each hidden layer's bias gradient is reduced (``execution.bgrad``)."""
        choice = self.cfg.execution.bgrad.value
        if choice != "auto":
            self.model.set_bgrad(choice)
            return
        if not (self.backend.is_gpu and self.cfg.execution.mode.value == "fused" and len(self.widths) > 2):
            self.model.set_bgrad("bgradb")  # on the CPU (and in naive mode) the two do the same work
            return
        from mlptrain.gpu import PlanCache, choose_bgrad

        # Both strategies are exact; which is faster depends on the shapes and on how the
        # backward is scheduled: time this model's step both ways, on random data.
        ex = self.cfg.execution
        cdt, B, xp = self.precision.compute_dtype, self.cfg.data.batch_size, self.xp
        key = (
            f"step {'-'.join(map(str, self.widths))} batch {B} {np.dtype(cdt).name}"
            f"{' tf32' if self.precision.tf32 else ''}{' 2 streams' if ex.wgrad_stream else ''}"
            f"{' head kernel' if self.head_kernel else ''}"
        )
        store = PlanCache.default_path().with_suffix(".bgrad.json") if ex.plan_cache else None
        rng = xp.random.default_rng(0)
        x = rng.standard_normal((B, self.widths[0]), dtype=xp.float32).astype(cdt)  # (B, in)
        y = rng.integers(0, self.widths[-1], B)  # (B,) labels
        self.model.set_bgrad("drelu_bgrad")
        with self.stream:
            chosen = choose_bgrad(self.model, lambda: self.forward_backward(x, y), key, store=store)
        self.model.set_bgrad(chosen)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (host value, for logs)."""
        return self.schedule.host(step)

    def set_step(self, step: int) -> None:
        """Continue counting from ``step`` optimizer steps (resume)."""
        self.step_count = step
        self.schedule.set_step(step)

    def step(self, x: Any, y: Any) -> tuple[Any, Any]:
        """One optimizer step on batch ``x (B, in)``, ``y (B,)``; returns device ``(loss, correct)``.

        On the GPU (unless ``graph=false``) the step is replayed from a CUDA graph.
        """
        if self.graphed is not None:
            return self.graphed(x, y)
        return self.step_uncaptured(x, y)

    def batch_buffers(self, rows: int) -> tuple[Any, Any] | None:
        """Where the loader should gather a training batch of ``rows``: the CUDA graph's input
        buffers for that shape (saves the step a copy), or None (fresh arrays) without a graph."""
        if self.graphed is None:
            return None
        ld = self.train_loader
        return self.graphed.input_buffers((rows, ld.x.shape[1]), ld.x.dtype, (rows,), ld.y.dtype)

    def step_uncaptured(self, x: Any, y: Any, count: bool = True) -> tuple[Any, Any]:
        """The step's device work, launched op by op (and recorded once for the graph)."""
        loss, correct = self.forward_backward(x, y)
        skip = self.scaler.check([p.grad for p in self.model.params])  # fp16: any inf/NaN gradient
        lr, inv_scale = self.schedule.lr, self.scaler.inv_scale  # this step's
        if self.backend.is_gpu:  # one kernel: the update, then (its last block) the bookkeeping
            self.optimizer.step(lr, inv_scale, skip, tail=self.log.tail(loss, correct, len(y)))
        else:
            self.optimizer.step(lr, inv_scale, skip)
            self.log.end_step(loss, correct, len(y))  # scaler update, the next step's lr, the metrics
        if count:
            self.step_count += 1
        return loss, correct

    def forward_backward(self, x: Any, y: Any) -> tuple[Any, Any]:
        """Forward, loss and backward: every ``param.grad`` set; returns device ``(loss, correct)``."""
        logits = self.model.forward(x)  # (B, classes)
        if self.head_kernel:  # a smaller last batch fits the kernel too
            top, below = self.model.layers[-1], self.model.layers[-2]
            # the loss kernel, then one kernel for dZ_below = (dlogits @ W) * relu'(Z_below) and its sum
            loss, dlogits, correct, db_out, dz_below, db_below = cross_entropy_head(
                logits,
                y,
                self.scaler.scale,
                top.weight.compute,
                below.mask,
                bias_grad_below=not below.bias_grad_in_wgrad,
            )
            self.model.backward(dlogits, output_bias_grad=db_out, head_grad=(dz_below, db_below))
        elif self.bias_grad_from_loss:
            loss, dlogits, correct, db_out = self.loss_fn(logits, y, self.scaler.scale, bias_grad=True)
            self.model.backward(dlogits, output_bias_grad=db_out)
        else:
            loss, dlogits, correct = self.loss_fn(logits, y, self.scaler.scale)
            self.model.backward(dlogits)
        return loss, correct

    def evaluate(self, split: str) -> dict[str, float]:
        """Mean loss and accuracy over a whole split (syncs once at the end)."""
        xp = self.xp
        loader = self.eval_loaders[split]
        loss_sum = xp.zeros((), dtype=xp.float64)
        correct = xp.zeros((), dtype=xp.int64)
        for x, y in loader.epoch(0):
            logits = self.model.forward(x)
            loss, _, c = self.loss_fn(logits, y)
            loss_sum += loss * len(y)
            correct += c
        n = loader.num_samples
        return {f"{split}/loss": float(loss_sum) / n, f"{split}/acc": int(correct) / n}


def train(cfg: TrainConfig, out_dir: Path) -> dict[str, Any]:
    """Train as ``cfg`` says, writing ``run.json``, ``metrics.jsonl`` and ``checkpoints/`` into ``out_dir``.

    With ``cfg.resume`` set, continue the run of that checkpoint (see :mod:`mlptrain.checkpoint`).
    Returns the summary record (also the last line of ``metrics.jsonl``).

    Raises:
        TrainingInterrupted: Ctrl-C; ``last`` was saved first (a second Ctrl-C raises a plain
            KeyboardInterrupt at once).
        CheckpointError: the checkpoint to resume from is missing, corrupt or does not fit.
        OutputError: ``out_dir`` cannot be written, or holds a run this one would overwrite.
        NonFiniteError: a loss, gradient or parameter became inf/NaN (the message names it).
        ResourceError: out of memory (the message says which sizes to lower).
    """
    validate(cfg)
    out_dir = Path(out_dir)
    _make_dirs(out_dir)
    backend = get_backend(cfg.device.value)
    tr: Trainer | None = None
    try:
        tr = Trainer(cfg, backend=backend)
        start, best, records, resumed_from = _prepare(tr, out_dir)
        log.info(
            "mlptrain %s: %s, dataset %s (%d train / %d val / %d test), model %s (%s params), %s, %s, bgrad %s",
            __version__,
            backend.describe(),
            tr.dataset.name,
            len(tr.dataset.y_train),
            len(tr.dataset.y_val),
            len(tr.dataset.y_test),
            "-".join(map(str, tr.widths)),
            f"{tr.model.num_params:,}",
            cfg.execution.mode.value,
            tr.precision.name,
            ",".join(tr.model.bgrad) or "-",
        )
        if resumed_from is not None:
            log.info(
                "resuming from %s at step %d (epoch %d, batch %d)", resumed_from, start.step, start.epoch, start.batch
            )
        _write_run_record(out_dir, tr, resumed_from, start.step)
        with _StopRequest() as stop, _Metrics(out_dir / "metrics.jsonl", records) as metrics, tr.stream:
            summary = _loop(tr, out_dir, start, best, metrics, stop, resumed_from)
    except MemoryError as exc:
        if isinstance(exc, MlptrainError):
            raise
        raise _out_of_memory(exc, cfg, backend, tr, out_dir) from exc
    line = (
        f"mlptrain: {tr.dataset.name} {'-'.join(map(str, tr.widths))} {cfg.execution.mode.value} "
        f"{tr.precision.name} on {backend.device}: {summary['epochs']} epochs, {tr.step_count} steps in "
        f"{summary['wall_s']:.1f} s"
    )
    if "test/acc" in summary:
        line += f" | test acc {summary['test/acc']:.4f} loss {summary['test/loss']:.4f}"
    log.info(line)
    print(line, flush=True)
    return summary


def _loop(
    tr: Trainer,
    out_dir: Path,
    start: Position,
    best: Best,
    metrics: _Metrics,
    stop: _StopRequest,
    resumed_from: Path | None,
) -> dict[str, Any]:
    """Epochs from ``start`` to the end: steps, metrics, evaluation, checkpoints, Ctrl-C."""
    cfg = tr.cfg
    ckpt_dir = out_dir / CHECKPOINT_DIR
    interval = _Interval(tr, cfg.log_every)
    # CPU: check the loss and every tensor after each step (no device to sync), naming the exact step.
    # GPU: check at the interval's one sync, so a step never waits for the host.
    each_step = not tr.backend.is_gpu
    last_saved: tuple[Path, int] | None = (resumed_from, start.step) if resumed_from is not None else None

    def save(name: str, pos: Position) -> None:
        nonlocal last_saved
        arrays, meta = checkpoint.capture(tr, pos, metrics_records=metrics.records, best=best)
        path = ckpt_dir / f"{name}.npz"
        checkpoint.save(path, arrays, meta)
        if name == "last":
            last_saved = (path, pos.step)

    def saved_note() -> str:
        return "" if last_saved is None else f"; the last checkpoint, {last_saved[0]} (step {last_saved[1]}), is intact"

    def interrupt(pos: Position) -> NoReturn:
        if last_saved != (ckpt_dir / "last.npz", pos.step):
            save("last", pos)
        assert last_saved is not None
        name = signal.Signals(stop.signum).name
        metrics.write(kind="interrupted", step=pos.step, epoch=pos.epoch, checkpoint=str(last_saved[0]), signal=name)
        message = (
            f"interrupted at step {pos.step} (epoch {pos.epoch}, {name}); checkpoint saved to {last_saved[0]}; "
            f"continue with: python -m mlptrain <the same overrides> hydra.run.dir={out_dir} resume=last"
        )
        log.warning(message)
        raise TrainingInterrupted(message, last_saved[0], pos.step, stop.signum)

    def check_finite(losses: np.ndarray, lrs: np.ndarray, epoch: int) -> None:
        """Raise NonFiniteError for the first inf/NaN loss of ``losses`` or any inf/NaN tensor now."""
        scaled = tr.scaler.enabled  # fp16: overflowing gradients are the scaler's to handle, not errors
        bad = [] if scaled else [j for j, v in enumerate(losses) if not math.isfinite(v)]
        tensors = _nonfinite_tensors(tr, grads=not scaled)
        if not bad and not tensors:
            return
        j = bad[0] if bad else len(losses) - 1
        step = tr.step_count - len(losses) + j
        if each_step:  # checked after every step: this step made them
            where, after = f"at step {step}", ""
        elif bad:
            where, after = f"at step {step}", f" after step {tr.step_count - 1}"
        else:
            where, after = f"by step {step}", f" (checked every {cfg.log_every} steps)"
        what = [f"the training loss is {losses[j]}"] if bad else []
        if tensors:
            what.append(f"inf/NaN{after} in " + ", ".join(tensors))
        raise NonFiniteError(
            f"non-finite values {where} (epoch {epoch}, {tr.precision.name}): {'; '.join(what)}; lower "
            f"optimizer.lr (now {lrs[j]:.3g}) or use warm-up (optimizer.warmup_steps){saved_note()}"
        )

    progress_disable = None if cfg.progress is None else not cfg.progress
    t_start = time.perf_counter()
    epochs = tqdm(
        range(start.epoch, cfg.epochs),
        initial=start.epoch,
        total=cfg.epochs,
        desc="epoch",
        unit="epoch",
        position=0,
        disable=progress_disable,
    )
    done = False
    rec: dict[str, Any] = {}
    epoch = start.epoch
    for epoch in epochs:
        t_epoch = time.perf_counter()
        pos = start if epoch == start.epoch else Position(epoch, 0, tr.step_count)
        tr.log.start_epoch(pos.loss_sum, pos.correct)  # the epoch's running sums, on the device
        ep_n, batch = pos.samples, pos.batch
        bar = tqdm(
            tr.train_loader.epoch(epoch, batch, out=tr.batch_buffers),
            initial=batch,
            total=tr.steps_per_epoch,
            desc=f"train {epoch + 1}/{cfg.epochs}",
            unit="batch",
            leave=False,
            position=1,
            disable=progress_disable,
        )
        for x, y in bar:
            lr = tr.lr_at(tr.step_count)
            loss, correct = tr.step(x, y)
            interval.add(len(y), lr)  # host only: the step recorded its metrics on the device
            ep_n += len(y)
            batch += 1
            done = tr.step_count >= tr.total_steps
            if each_step:
                try:
                    check_finite(np.array([float(loss)]), np.array([lr]), epoch)
                except NonFiniteError:
                    interval.flush(metrics, epoch)  # the records up to the bad step, then the error
                    raise
            ckpt_due = cfg.checkpoint_steps > 0 and tr.step_count % cfg.checkpoint_steps == 0 and not done
            if interval.pending == cfg.log_every or done or ckpt_due or stop.requested:
                losses, lrs = interval.flush(metrics, epoch)  # the only host sync of the interval
                if not each_step:
                    check_finite(losses, lrs, epoch)
                _check_scaler(tr, cfg.precision.max_consecutive_skips)
                bar.set_postfix(loss=f"{losses[-1]:.4f}", sps=f"{interval.samples_per_s:,.0f}", refresh=False)
            if (ckpt_due or stop.requested) and not done:
                here = Position(epoch, batch, tr.step_count, float(tr.log.epoch_loss), int(tr.log.epoch_correct), ep_n)
                if stop.requested:
                    interrupt(here)
                save("last", here)
                interval.restart_clock()  # saving is not training throughput
            if done:
                break
        if interval.pending:  # the epoch's step records come before its epoch record
            losses, lrs = interval.flush(metrics, epoch)
            if not each_step:
                check_finite(losses, lrs, epoch)
            _check_scaler(tr, cfg.precision.max_consecutive_skips)
        rec = {
            "kind": "epoch",
            "epoch": epoch,
            "step": tr.step_count,
            "train/loss": float(tr.log.epoch_loss) / max(ep_n, 1),
            "train/acc": int(tr.log.epoch_correct) / max(ep_n, 1),
        }
        for split in tr.eval_loaders:
            rec.update(tr.evaluate(split))
        rec["time_s"] = time.perf_counter() - t_epoch
        # A checkpoint after a whole epoch resumes at the next one, its epoch record written; one
        # after a partial epoch (max_steps) resumes inside it, before its epoch record.
        whole = batch == tr.steps_per_epoch
        if whole:
            here = Position(epoch + 1, 0, tr.step_count)
            metrics.write(**rec)
        else:
            here = Position(epoch, batch, tr.step_count, float(tr.log.epoch_loss), int(tr.log.epoch_correct), ep_n)
        improved = best.improves(rec[best.metric])
        if improved:
            best = Best(best.metric, rec[best.metric], epoch, tr.step_count)
        if done or stop.requested or (cfg.checkpoint_every > 0 and (epoch + 1) % cfg.checkpoint_every == 0):
            save("last", here)
        if improved:
            save("best", here)
        if not whole:
            metrics.write(**rec)
        epochs.set_postfix(
            {k: f"{v:.4f}" for k, v in rec.items() if k in ("train/loss", "val/acc", "test/acc")}, refresh=False
        )
        interval.restart_clock()  # evaluation and saving are not training throughput
        if done:
            break
        if stop.requested:
            interrupt(here)
    wall = time.perf_counter() - t_start
    summary = {
        "kind": "summary",
        "steps": tr.step_count,
        "epochs": epoch + 1,
        "wall_s": wall,
        "samples_per_s": (tr.step_count - start.step) * cfg.data.batch_size / wall,
        **{k: v for k, v in rec.items() if "/" in k},
    }
    metrics.write(**summary)
    return summary


class _Interval:
    """The steps of one log interval: host-side sizes and rates; their metrics are in ``tr.log`` on the device."""

    def __init__(self, tr: Trainer, log_every: int) -> None:
        self.tr = tr
        self.size = np.zeros(log_every, dtype=np.int64)
        self.lr = np.zeros(log_every)
        self.pending = 0
        self.samples_per_s = 0.0
        self.restart_clock()

    def restart_clock(self) -> None:
        self.started = time.perf_counter()

    def add(self, batch_size: int, lr: float) -> None:
        self.size[self.pending] = batch_size
        self.lr[self.pending] = lr
        self.pending += 1

    def flush(self, metrics: MetricsWriter, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Write one ``step`` record per pending step (one host sync); return their losses and lrs."""
        n, tr = self.pending, self.tr
        first = tr.step_count - n
        got = tr.log.read(first, n)  # syncs the device
        now = time.perf_counter()
        self.samples_per_s = int(self.size[:n].sum()) / (now - self.started)
        step_ms = (now - self.started) * 1e3 / n
        for j in range(n):
            rec: dict[str, Any] = {
                "kind": "step",
                "step": first + j,
                "epoch": epoch,
                "train/loss": float(got["loss"][j]),
                "train/acc": int(got["correct"][j]) / int(self.size[j]),
                "lr": float(self.lr[j]),
            }
            if tr.scaler.enabled:
                rec["loss_scale"] = float(got["scale"][j])
                rec["skipped"] = bool(got["skip"][j])
            if j == n - 1:
                rec.update(samples_per_s=self.samples_per_s, step_time_ms=step_ms)
            metrics.write(**rec)
        self.pending = 0
        self.restart_clock()
        return got["loss"], self.lr[:n].copy()


class _Metrics(MetricsWriter):
    """``metrics.jsonl``, appended to, counting its records (a checkpoint stores the count)."""

    def __init__(self, path: Path, records: int) -> None:
        try:
            super().__init__(path, append=True)  # the resume preparation left exactly `records` records
        except OSError as exc:
            raise OutputError(f"cannot open {path} for writing ({exc}); choose a writable hydra.run.dir") from exc
        self.records = records

    def __enter__(self) -> _Metrics:
        return self

    def write(self, **record: Any) -> None:
        try:
            super().write(**record)
        except OSError as exc:
            raise OutputError(
                f"cannot write {self.path} ({exc}); free disk space or choose another hydra.run.dir"
            ) from exc
        self.records += 1


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) stopped the run after ``checkpoint`` was saved at ``step``; the message
    says how to resume. ``signum`` is the signal (the CLI exits with 128 + signum)."""

    def __init__(self, message: str, checkpoint: Path, step: int, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint
        self.step = step
        self.signum = int(signum)


class _StopRequest:
    """SIGINT or SIGTERM while training: the first sets ``requested`` (the loop saves and stops after
    the step), a second raises KeyboardInterrupt at once. SIGTERM is what job schedulers and
    ``docker stop`` send before they kill. Installed in the main thread only; restored on exit.

    The handler only sets a flag: printing or logging from a signal handler can re-enter a stream.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self.signum = int(signal.SIGINT)  # the signal that asked to stop
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, previous in self._previous.items():
            if previous is None:  # installed from outside Python
                previous = signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL
            signal.signal(s, previous)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.signum = signum


def _make_dirs(out_dir: Path) -> None:
    """Create ``out_dir`` and its ``checkpoints/`` before anything is built: a bad path fails first."""
    try:
        (out_dir / CHECKPOINT_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(
            f"cannot create the output directory {out_dir} ({type(exc).__name__}: {exc}); choose a writable "
            "hydra.run.dir"
        ) from exc


def _prepare(tr: Trainer, out_dir: Path) -> tuple[Position, Best, int, Path | None]:
    """Load the checkpoint to resume from, or check that ``out_dir`` holds no run; then set up metrics.jsonl.

    Nothing in ``out_dir`` is changed until the checkpoint has been read and fits the model.
    Returns the start position, the best metric so far, the records metrics.jsonl holds, and the
    checkpoint resumed from (None for a fresh run).
    """
    cfg = tr.cfg
    best = Best("val/acc" if "val" in tr.eval_loaders else "train/acc")
    metrics = out_dir / "metrics.jsonl"
    if cfg.resume is None:
        checkpoint.refuse_overwrite(out_dir, hint="continue it with resume=last")
        checkpoint.keep_metrics_prefix(metrics, 0)
        return Position(), best, 0, None
    path = checkpoint.resolve(cfg.resume, out_dir)
    ckpt = checkpoint.load(path)
    pos, saved_best = checkpoint.restore(tr, ckpt)
    if pos.step >= tr.total_steps:
        raise ConfigError(
            f"checkpoint {path} is at step {pos.step}, at or past the end of this run ({tr.total_steps} steps: "
            f"epochs={cfg.epochs}, max_steps={cfg.max_steps}); raise epochs or max_steps to train further"
        )
    n = ckpt.meta["metrics_records"]
    if path.resolve().parent == (out_dir / CHECKPOINT_DIR).resolve():
        checkpoint.refuse_rollback(path, pos)
        kept = checkpoint.keep_metrics_prefix(metrics, n)
    else:
        checkpoint.refuse_overwrite(out_dir, hint=f"resume into a new hydra.run.dir with resume={path}")
        source = path.parent.parent / "metrics.jsonl" if path.parent.name == CHECKPOINT_DIR else None
        kept = checkpoint.keep_metrics_prefix(metrics, n, source=source)
    return pos, saved_best or best, kept, path


def _nonfinite_tensors(tr: Trainer, *, grads: bool) -> list[str]:
    """Names of the gradients (if ``grads``) and parameters holding inf/NaN, in model order (one sync).

    One reduction per tensor screens it: a sum of squares (a dot product on the CPU, where this
    runs every step) is finite only if every element is, and a flagged tensor is confirmed
    element-wise, since the reduction itself can overflow.
    """
    params = tr.model.params
    items = [(f"{p.name} gradient", p.grad) for p in params if grads and p.grad is not None]
    items += [(p.name, p.value) for p in params]
    xp = tr.xp
    screens: Any
    if tr.backend.is_gpu:
        screens = tr.backend.to_host(xp.stack([a.sum(dtype=xp.float64) for _, a in items]))  # syncs the device
    else:
        screens = [np.dot(a.ravel(), a.ravel()) for _, a in items]
    return [n for (n, a), s in zip(items, screens, strict=True) if not math.isfinite(s) and not xp.isfinite(a).all()]


def _check_scaler(tr: Trainer, max_skips: int) -> None:
    """fp16: stop after ``max_skips`` consecutive overflowing (skipped) steps."""
    if not tr.scaler.enabled or int(tr.scaler.consecutive_skips) < max_skips:
        return
    grads = [n for n in _nonfinite_tensors(tr, grads=True) if n.endswith(" gradient")]
    raise NonFiniteError(
        f"fp16 gradients overflowed on {int(tr.scaler.consecutive_skips)} consecutive steps up to step "
        f"{tr.step_count - 1} (loss scale now {float(tr.scaler.scale):.3g}; last step's inf/NaN: "
        f"{', '.join(grads) or 'none'}); the model diverged: lower optimizer.lr or use precision=bf16"
    )


def _out_of_memory(
    exc: MemoryError, cfg: TrainConfig, backend: Backend, tr: Trainer | None, out_dir: Path
) -> ResourceError:
    """A ResourceError naming the sizes to lower, after freeing CuPy's cached blocks."""
    if backend.is_gpu:
        try:
            backend.xp.get_default_memory_pool().free_all_blocks()
            backend.xp.get_default_pinned_memory_pool().free_all_blocks()
        except Exception:  # pragma: no cover - best effort while reporting
            pass
    d = cfg.data
    if tr is None:
        where, model = "while building the model and copying the data", f"model.hidden={list(cfg.model.hidden)}"
    else:
        where = f"at step {tr.step_count}"
        model = f"model {'-'.join(map(str, tr.widths))} ({tr.model.num_params:,} parameters)"
    last = out_dir / CHECKPOINT_DIR / "last.npz"
    note = f"; the last checkpoint {last} is intact" if last.is_file() else ""
    return ResourceError(
        f"out of memory on the {backend.device} {where} ({type(exc).__name__}: {str(exc) or 'no details'}) with "
        f"data.batch_size={d.batch_size}, data.eval_batch_size={d.eval_batch_size}, {model}, "
        f"precision={cfg.precision.name.value}, execution={cfg.execution.mode.value}; lower data.batch_size or "
        f"model.hidden (data.eval_batch_size if it ran out while evaluating){note}"
    )


def _write_run_record(out_dir: Path, tr: Trainer, resumed_from: Path | None, step: int) -> None:
    record: dict[str, Any] = {
        "mlptrain": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "device": tr.backend.describe(),
        "widths": tr.widths,
        "bgrad": tr.model.bgrad,
        "params": tr.model.num_params,
        "config": to_plain(tr.cfg),
    }
    if resumed_from is not None:
        record["resumed_from"] = {"checkpoint": str(resumed_from), "step": step}
    if tr.backend.is_gpu:
        import cupy
        import nvmath

        record.update(cupy=cupy.__version__, nvmath=nvmath.__version__)
    path = out_dir / "run.json"
    try:
        path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise OutputError(
            f"cannot write {path} ({type(exc).__name__}: {exc}); choose a writable hydra.run.dir"
        ) from exc
