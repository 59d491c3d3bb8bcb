"""The training loop: build everything from a config, train, evaluate, log.

:func:`train` is the whole job behind ``python -m mlptrain``. :class:`Trainer` holds the
pieces (backend, model, optimizer, loss scaler, loaders) so tests, benchmarks and checkpoints
can drive single steps.

One training step (:meth:`Trainer.step`), all on the device, with no host synchronisation::

    logits = model.forward(x)                       # fused: RELU_AUX_BIAS ... BIAS
    loss, dlogits, correct = loss_fn(logits, y, scale)
    model.backward(dlogits)                         # fused: DRELU(_BGRAD), BGRADB
    found_inf = scaler.check(grads)                 # fp16 only
    optimizer.step(lr, 1/scale, skip=found_inf)     # one fused kernel per parameter
    scaler.update()

The host reads metrics back only every ``log_every`` steps (one sync per interval).
"""

from __future__ import annotations

import logging
import math
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from mlptrain import __version__
from mlptrain.backend import Backend, get_backend
from mlptrain.config import TrainConfig, to_plain, validate
from mlptrain.data import Dataset, load_dataset
from mlptrain.errors import ConfigError, NonFiniteError
from mlptrain.execution import FusedExecution, NaiveExecution, NumpyGemm
from mlptrain.loader import DataLoader
from mlptrain.losses import LOSSES
from mlptrain.metrics import MetricsWriter
from mlptrain.network import MLP
from mlptrain.optim import lr_at, make_optimizer
from mlptrain.precision import LossScaler, get_precision

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


def make_gemm(backend: Backend, precision: Any, autotune: bool) -> Any:
    """The GEMM engine: planned nvmath Matmuls on the GPU, the NumPy epilog contract on the CPU."""
    if backend.is_gpu:
        from mlptrain.gpu import NvmathGemm

        return NvmathGemm(tf32=precision.tf32, autotune=autotune)
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
        self.gemm = make_gemm(self.backend, self.precision, cfg.execution.autotune)
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
        self.model.set_bgrad(self._choose_bgrad())
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
        self.steps_per_epoch = len(self.train_loader)
        self.total_steps = self.steps_per_epoch * cfg.epochs
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.lr = xp.zeros((), dtype=xp.float64)  # this step's learning rate, on the device
        self.step_count = 0  # optimizer steps taken (host counter; skipped fp16 steps included)

    def _choose_bgrad(self) -> str:
        choice = self.cfg.execution.bgrad.value
        if choice != "auto":
            return choice
        # Both strategies are exact. Measured on the H200 (docs/benchmarks.md), BGRADB in the
        # weight-gradient GEMM beat DRELU_BGRAD at every benchmarked shape, so it is the default.
        return "bgradb"

    def lr_at(self, step: int) -> float:
        o = self.cfg.optimizer
        return lr_at(
            step,
            base_lr=o.lr,
            total_steps=self.total_steps,
            schedule=o.schedule.value,
            warmup_steps=o.warmup_steps,
            min_ratio=o.min_lr_ratio,
        )

    def step(self, x: Any, y: Any) -> tuple[Any, Any]:
        """One optimizer step on batch ``x (B, in)``, ``y (B,)``; returns device ``(loss, correct)``."""
        self.lr.fill(self.lr_at(self.step_count))
        logits = self.model.forward(x)  # (B, classes)
        loss, dlogits, correct = self.loss_fn(logits, y, self.scaler.scale)
        self.model.backward(dlogits)
        params = self.model.params
        skip = self.scaler.check([p.grad for p in params])
        self.optimizer.step(self.lr, self.scaler.inv_scale, skip)
        self.scaler.update()
        self.step_count += 1
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
    """Train as ``cfg`` says, writing ``run.json`` and ``metrics.jsonl`` into ``out_dir``.

    Returns the summary record (also the last line of ``metrics.jsonl``).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tr = Trainer(cfg)
    xp, backend = tr.xp, tr.backend
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
    _write_run_record(out_dir, tr)

    log_every = cfg.log_every
    B = cfg.data.batch_size
    buf_loss = xp.zeros(log_every, dtype=xp.float64)  # per-step losses of the interval, on the device
    buf_correct = xp.zeros(log_every, dtype=xp.int64)
    buf_skip = xp.zeros(log_every, dtype=xp.int32)  # fp16: the step overflowed and was skipped
    buf_size = np.zeros(log_every, dtype=np.int64)
    buf_lr = np.zeros(log_every)
    progress_disable = None if cfg.progress is None else not cfg.progress
    t_start = time.perf_counter()
    summary: dict[str, Any] = {}
    with MetricsWriter(out_dir / "metrics.jsonl") as metrics:
        epochs = tqdm(range(cfg.epochs), desc="epoch", unit="epoch", position=0, disable=progress_disable)
        last_flush, pending, done = time.perf_counter(), 0, False
        for epoch in epochs:
            t_epoch = time.perf_counter()
            ep_loss = xp.zeros((), dtype=xp.float64)
            ep_correct = xp.zeros((), dtype=xp.int64)
            ep_n = 0
            bar = tqdm(
                tr.train_loader.epoch(epoch),
                total=tr.steps_per_epoch,
                desc=f"train {epoch + 1}/{cfg.epochs}",
                unit="batch",
                leave=False,
                position=1,
                disable=progress_disable,
            )
            for x, y in bar:
                i = pending
                buf_lr[i] = tr.lr_at(tr.step_count)
                loss, correct = tr.step(x, y)
                buf_loss[i] = loss
                buf_correct[i] = correct
                buf_skip[i] = tr.scaler.found_inf
                buf_size[i] = len(y)
                ep_loss += loss * len(y)
                ep_correct += correct
                ep_n += len(y)
                pending += 1
                done = tr.step_count >= tr.total_steps
                if pending == log_every or done:
                    # The only host sync of the interval: read back its per-step metrics.
                    losses, corrects = backend.to_host(buf_loss[:pending]), backend.to_host(buf_correct[:pending])
                    skipped = backend.to_host(buf_skip[:pending])
                    now = time.perf_counter()
                    sps = int(buf_size[:pending].sum()) / (now - last_flush)
                    step_ms = (now - last_flush) * 1e3 / pending
                    scale = float(tr.scaler.scale) if tr.scaler.enabled else None
                    first = tr.step_count - pending
                    for j in range(pending):
                        if not math.isfinite(losses[j]) and not tr.scaler.enabled:
                            raise NonFiniteError(
                                f"the training loss became {losses[j]} at step {first + j} (epoch {epoch}) in "
                                f"{tr.precision.name}; lower optimizer.lr (now {buf_lr[j]:.3g}) or use warm-up"
                            )
                        rec: dict[str, Any] = {
                            "kind": "step",
                            "step": first + j,
                            "epoch": epoch,
                            "train/loss": float(losses[j]),
                            "train/acc": int(corrects[j]) / int(buf_size[j]),
                            "lr": float(buf_lr[j]),
                        }
                        if scale is not None:
                            rec["loss_scale"] = scale
                            rec["skipped"] = bool(skipped[j])
                        if j == pending - 1:
                            rec.update(samples_per_s=sps, step_time_ms=step_ms)
                        metrics.write(**rec)
                    if tr.scaler.enabled and int(tr.scaler.consecutive_skips) >= cfg.precision.max_consecutive_skips:
                        raise NonFiniteError(
                            f"fp16 gradients overflowed on {int(tr.scaler.consecutive_skips)} consecutive steps up to "
                            f"step {tr.step_count - 1} (loss scale now {float(tr.scaler.scale):.3g}); the model "
                            "diverged: lower optimizer.lr or use precision=bf16"
                        )
                    bar.set_postfix(loss=f"{losses[-1]:.4f}", sps=f"{sps:,.0f}", refresh=False)
                    pending, last_flush = 0, time.perf_counter()
                if done:
                    break
            rec = {
                "kind": "epoch",
                "epoch": epoch,
                "step": tr.step_count,
                "train/loss": float(ep_loss) / max(ep_n, 1),
                "train/acc": int(ep_correct) / max(ep_n, 1),
            }
            for split in tr.eval_loaders:
                rec.update(tr.evaluate(split))
            rec["time_s"] = time.perf_counter() - t_epoch
            metrics.write(**rec)
            epochs.set_postfix(
                {k: f"{v:.4f}" for k, v in rec.items() if k in ("train/loss", "val/acc", "test/acc")}, refresh=False
            )
            last_flush = time.perf_counter()  # evaluation time is not training throughput
            if done:
                break
        wall = time.perf_counter() - t_start
        summary = {
            "kind": "summary",
            "steps": tr.step_count,
            "epochs": epoch + 1,
            "wall_s": wall,
            "samples_per_s": tr.step_count * B / wall,
            **{k: v for k, v in rec.items() if "/" in k},
        }
        metrics.write(**summary)
    line = (
        f"mlptrain: {tr.dataset.name} {'-'.join(map(str, tr.widths))} {cfg.execution.mode.value} "
        f"{tr.precision.name} on {backend.device}: {summary['epochs']} epochs, {tr.step_count} steps in {wall:.1f} s"
    )
    if "test/acc" in summary:
        line += f" | test acc {summary['test/acc']:.4f} loss {summary['test/loss']:.4f}"
    log.info(line)
    print(line, flush=True)
    return summary


def _write_run_record(out_dir: Path, tr: Trainer) -> None:
    import json

    record = {
        "mlptrain": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "device": tr.backend.describe(),
        "widths": tr.widths,
        "bgrad": tr.model.bgrad,
        "params": tr.model.num_params,
        "config": to_plain(tr.cfg),
    }
    if tr.backend.is_gpu:
        import cupy
        import nvmath

        record.update(cupy=cupy.__version__, nvmath=nvmath.__version__)
    (out_dir / "run.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
