"""The training step: the model, its loss, its optimizer, and one step of them on the device.

A :class:`Trainer` is built from a valid config (:func:`mlptrain.step.build.trainer` turns each config
group into its object) and does one thing: train steps. The run around it (epochs, metrics,
checkpoints, interruption) is :func:`mlptrain.run.run.train`.

One step (:meth:`Trainer.step`), all on the device, with no host synchronisation, so on the GPU it
is captured once into a CUDA graph and replayed (``graph=false`` to turn off). Where it runs (the
stream, the graphs, the pools, the kernels compiling ahead) is the device runtime's
(:mod:`mlptrain.step.runtime`), apart from the step; the trainer is the step and its state::

    logits = model.forward(x)                            # fused: RELU_AUX_BIAS ... BIAS
    loss, correct = head.backward(model, logits, y, s)   # the loss kernel (and, small heads, the
                                                         # head kernel), then the network's backward:
                                                         # DRELU(_BGRAD), BGRADB
    skip = scaler.check(grads)                           # fp16 only: 1 kernel over all gradients
    optimizer.step(lr, 1/s, skip,                        # 1 kernel over all parameters, whose last
                   tail=log.tail(loss, correct, B))      # block updates the loss scale, the step
                                                         # count and the lr, and records the metrics

For 784-1024-1024-10 in fp16 that is 7 GEMMs and 4 small kernels (``benchmarks/probes/step_kernels.py``
lists them). The host reads the metrics back only every ``log_every`` steps, from the device ring
of :class:`~mlptrain.step.steplog.StepLog`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from mlptrain.base.backend import Backend
from mlptrain.base.cuda_source import Job
from mlptrain.base.timeline import mark
from mlptrain.config.schema import TrainConfig
from mlptrain.data import Dataset
from mlptrain.nn import fp8, scores
from mlptrain.step import bgrad, build, state_fit
from mlptrain.step.runtime import StepBatches

log = logging.getLogger(__name__)


class Trainer:
    """The step of a run, built from a valid :class:`TrainConfig` (:func:`mlptrain.config.schema.validate`).

    Args:
        cfg: the configuration.
        dataset: the data to train on (default: the one ``cfg.data`` names).
        backend: where to run (default: ``cfg.device``).
        comm: data parallelism (:mod:`mlptrain.distributed`): this trainer is one rank of
            ``comm.world``; it takes its shard of every training batch, and its gradients, loss and
            counts become the global batch's before each update (``distributed.gpus``, torchrun).
        precompile: GPU: the run's kernels, compiling on threads (:mod:`mlptrain.step.cuda.precompile`) since
            :func:`mlptrain.run.run.train` started them; by default the trainer starts them (unless
            ``execution.precompile=false``).
        member_data: an ensemble's loaders (:func:`mlptrain.step.build.trainer`: cross-validation's folds).
        member_seeds: an ensemble's run seed of each member (default ``seed + k``).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        dataset: Dataset | None = None,
        backend: Backend | None = None,
        *,
        comm: Any = None,
        precompile: Any = None,
        member_data: Any = None,
        member_seeds: list[int] | None = None,
    ) -> None:
        self.cfg = cfg
        # each part from its config group
        kw = {"member_data": member_data, "member_seeds": member_seeds}
        p = build.trainer(cfg, dataset, backend, comm=comm, precompile=precompile, **kw)
        self.backend, self.xp, self.precision, self.runtime = p.backend, p.backend.xp, p.precision, p.runtime
        self.dataset, self.widths, self.gemm, self.execution = p.dataset, p.widths, p.gemm, p.execution
        self.members = p.model.members  # an ensemble's (mlptrain.run.ensemble), 1 otherwise
        self.model, self.head, self.train_loader, self.eval_loaders = p.model, p.head, p.train_loader, p.eval_loaders
        self.grad_sync, self.optimizer, self.scaler = p.grad_sync, p.optimizer, p.scaler
        self.steps_per_epoch, self.total_steps = len(self.train_loader), p.total_steps
        self.clock, self.schedule, self.log = p.clock, p.schedule, p.log
        model = self.model
        self.runtime.prepare(
            self._launch, keep=model.step_arrays, restore=model.restore_step_arrays, release=self.release_step
        )
        # The batches as the step takes them: the graph's input buffers, or gathered by the step itself
        self.batches = StepBatches(self.runtime, self.train_loader, self.clock, data_parallel=comm is not None)
        # The loop writes each log interval's records while the device runs the next (mlptrain.run.loop.Interval)
        self.writes_metrics_late = self.runtime.queues_work and comm is None
        mark("model")
        self._finish_setup()
        mark("bgrad")

    def _finish_setup(self) -> None:
        """Once everything the step uses is built: its kernels queued, the bgrad choice, set-up's blocks freed."""
        # The kernels of the step and of evaluation compile on threads from now on. The bgrad probe waits for
        # them before it captures (on a first run it would otherwise compile the loss and the head kernel
        # itself, one after another, on this thread); the head kernel's source is the same for either choice.
        self.runtime.submit_precompile(self.precompile_jobs)
        bgrad.choose(self)  # on the GPU it may time the step, so after everything the step uses
        self.runtime.free_setup_blocks()  # blocks set-up freed (the probe's, the weights' init temporaries)
        if self.grad_sync is not None:  # after the probe: it times one rank's step alone
            self.grad_sync.overlap(self.model)  # each weight gradient all-reduced as soon as it is made (GPU)

    @property
    def stream(self) -> Any:
        """The runtime's stream: ``with trainer.stream:`` runs steps where the training loop runs them."""
        return self.runtime.stream

    @property
    def graphed(self) -> Any:
        """The runtime's CUDA graphs of the step (:class:`~mlptrain.step.cuda.graph.GraphedStep`), or None."""
        return self.runtime.graphed

    @property
    def memory_peak(self) -> Any:
        """The runtime's high-water mark of the pools (:class:`~mlptrain.step.cuda.memory.PeakTracker`), or None."""
        return self.runtime.memory_peak

    # --- the step ---------------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (skipped fp16 steps included): the host half of :attr:`clock`."""
        return self.clock.n

    def step(self, x: Any, y: Any) -> tuple[Any, Any]:
        """One optimizer step on batch ``x (B, in)``, ``y (B,)``; returns device ``(loss, correct)``.

        On the GPU (unless ``graph=false``) the step is replayed from a CUDA graph. The returned
        arrays belong to the step: a replay rewrites them.
        """
        tag = "gather" if self.batches.gathers(x) else None
        out = self.runtime.step(x, y, tag=tag)
        self.clock.tick()
        if self.batches.ahead_due(x, y, tag):
            self._capture_ahead()
        return out

    def _capture_ahead(self) -> None:
        """The graphs of the epoch's other batch shapes, captured before the loop meets them
        (:meth:`StepBatches.capture_ahead`): no step is taken, and what the forward changes under fp8 (the amax
        histories) is put back. The tail's batch size is made outside the capture."""
        fp8_state = fp8.state_dict(self.gemm)
        self.batches.capture_ahead(self.log.rows_value, self.forward_backward)
        fp8.load_state_dict(self.gemm, fp8_state)

    def release_step(self) -> None:
        """Drop the arrays the last step left: gradients, saved inputs and masks, and the GEMM plans'
        references to their last operands (their memory returns to the pool for the next step)."""
        self.model.release_step_arrays()
        self.gemm.release_operands()  # (the CPU's engine plans nothing: it has none)

    def _launch(self, x: Any, y: Any) -> tuple[Any, Any]:
        """The step's device work, launched op by op (what a CUDA graph records once)."""
        sync, rows = self.grad_sync, self.batch_rows(y)
        if self.batches.gathers(x):  # the batch of this step, read on the device from the step count (train_batches)
            self.train_loader.gather_in_step(x, y, self.clock.device)
        lr, inv_scale = self.schedule.lr, self.scaler.inv_scale  # this step's
        if sync is None:
            loss, correct = self.forward_backward(x, y)
        else:  # data parallel (mlptrain.distributed.dp): this rank's share, then the global batch's
            loss, correct = self.forward_backward(x, y, sync.grad_scale(self.scaler.scale, rows))
            loss, correct, rows, inv_scale = sync(self.model.params, loss, correct, rows, inv_scale)
        self.runtime.wait("update")
        skip = self.scaler.check([p.grad for p in self.model.params])  # fp16: any inf/NaN gradient
        # the update, then the bookkeeping (scaler update, the step count and lr, the metrics): on the GPU one
        # kernel, whose last block runs the bookkeeping
        logged = self.step_metrics(loss, correct, rows)
        self.log.after_update(lambda tail: self.optimizer.step(lr, inv_scale, skip, tail=tail), *logged, rows)
        return loss, correct

    def batch_rows(self, y: Any) -> int:
        """The rows of this process's batch ``y`` (an ensemble's: of each member's)."""
        return len(y)

    def step_metrics(self, loss: Any, correct: Any, rows: int) -> tuple[Any, Any]:
        """The 0-d ``(loss, correct)`` the step log records of this step's (an ensemble's: the members' mean)."""
        return loss, correct

    def forward_backward(self, x: Any, y: Any, grad_scale: Any = None) -> tuple[Any, Any]:
        """Forward, loss and backward: every ``param.grad`` set; returns device ``(loss, correct)``.

        ``grad_scale``: what the loss gradient is multiplied by (default: the loss scale)."""
        # (B, classes), handed over in a list: the loss writes dlogits over it and the backward frees it
        logits = [self.model.forward(x)]
        self.runtime.wait("loss")  # (the first time, the forward's GEMMs were planned meanwhile)
        return self.head.backward(self.model, logits, y, self.scaler.scale if grad_scale is None else grad_scale)

    def rows(self, y: Any) -> int:
        """The rows of the global batch whose shard ``y`` is (data parallel), else ``len(y)``."""
        return self.train_loader.global_rows if self.grad_sync is not None else self.batch_rows(y)

    def train_batches(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[Any, Any]]:
        """The training batches of ``epoch`` from ``start_batch``, as the step takes them (:meth:`StepBatches.epoch`:
        with a CUDA graph, the step gathers its own batch)."""
        return self.batches.epoch(epoch, start_batch)

    def batch_buffers(self, rows: int, tag: str | None = None) -> tuple[Any, Any] | None:
        """Where the loader should gather a training batch of ``rows``: the CUDA graph's input buffers for that
        shape, or None (fresh arrays) without a graph (:meth:`StepBatches.buffers`)."""
        return self.batches.buffers(rows, tag)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (host value, for logs)."""
        return self.schedule.host(step)

    def evaluate(self, split: str) -> dict[str, float]:
        """Mean loss and the scores users read over a whole split (syncs once at the end): a classification's
        accuracy, balanced accuracy, macro precision/recall/F1, log loss and (two classes) ROC AUC; a regression's
        RMSE, MAE and R² in the targets' units (:mod:`mlptrain.nn.scores`).

        Each batch's 0-d loss and count stay on the device until the last batch is queued, and so do the
        scores' sums (a confusion matrix, or per-target error sums; :class:`~mlptrain.nn.scores.SplitSums`);
        the loss sums are then taken on the host (float64, in batch order) and the scores' sums copied once.
        Data parallel: each rank evaluates its rows of the split and the sums are all-reduced.
        """
        self.runtime.finish_precompile()
        found = SplitScores(self)
        for x, y in self.eval_loaders[split].epoch(0):
            found.add(self.model.forward(x, keep=False), y)
        self.gemm.release_operands()  # the plans forget the last batch: its memory can go
        return found.result(split)

    def epoch_extras(self) -> dict[str, float]:
        """Values the epoch record adds besides the training sums and the splits' scores (an ensemble's members')."""
        return {}

    # --- kernels compiled ahead (mlptrain.step.cuda.precompile) --------------------------------------

    def precompile_jobs(self) -> list[Job]:
        """The kernels of the step and of evaluation, each declared by the component that writes it: the head's
        losses (and kernel), the optimizer's update with the step log's tail, the scaler's check."""
        cdt, train = self.precision.compute_dtype, self.train_loader
        batches = [(r, ld.y, ld is train) for ld in [train, *self.eval_loaders.values()] for r in ld.row_counts()]
        loss_dtype = np.float64 if np.dtype(cdt) == np.float64 else np.float32  # the loss's 0-d
        sc, shapes = self.scaler, [p.value.shape for p in self.model.params]
        fused = self.cfg.execution.mode.value == "fused"
        gemm_jobs = getattr(self.gemm, "precompile_jobs", None)  # the GPU's 16-bit engine: its epilogue kernels
        macs = bgrad.largest_macs(self.widths, self.cfg.data.batch_size)
        return [
            *(gemm_jobs(cdt, self.members > 1, macs) if gemm_jobs is not None and fused else []),
            *self.head.precompile_jobs(self.model, cdt, batches, sc.scale),
            *self.optimizer.precompile_jobs(
                cdt,
                (self.schedule.lr, sc.inv_scale, sc.found_inf),
                lambda: self.log.scratch_tail(loss_dtype, train.row_counts()[0]),
            ),
            *sc.precompile_jobs(cdt, shapes),
            self._scores_job([(r, y) for r, y, training in batches if not training]),
        ]

    def _scores_job(self, batches: list[tuple[int, Any]]) -> Job:
        """Evaluation's score sums (:class:`SplitScores`'s :class:`~mlptrain.nn.scores.SplitSums`) over ``batches``."""
        classes = self.widths[-1] if self.dataset.task == "classification" else None
        log_loss = classes is not None and self.head.loss_name != "cross_entropy"
        return scores.sums_job(self.xp, classes, log_loss, self.precision.compute_dtype, batches)

    # --- state ------------------------------------------------------------------------------

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``(arrays, meta)``: the state of training, as host arrays and JSON-ready values (syncs the device).

        Arrays: ``param/<name>`` (master copies), ``optim/<name>/<state>`` and ``optim/t``, and the
        data's normalisation (``data/shift``, ``data/scale``). Meta: the architecture and dtypes it
        fits, the bgrad strategies, the loss scaler's state, the data seed and the data's
        preprocessing. The step count is the run's position (:class:`mlptrain.run.checkpoint.Position`).
        """
        arrays = {f"param/{k}": v for k, v in self.model.state_dict().items()}
        arrays.update({f"optim/{k}": np.asarray(v) for k, v in self.optimizer.state_dict().items()})
        data_meta, data_arrays = self.dataset.preprocessing()
        arrays.update({**data_arrays, **fp8.state_dict(self.gemm)})  # precision=fp8: amax histories, scales
        cfg = self.cfg
        meta = {
            "steps_per_epoch": self.steps_per_epoch,
            "widths": self.widths,
            "param_dtype": np.dtype(self.precision.param_dtype).name,
            "compute_dtype": np.dtype(self.precision.compute_dtype).name,
            "precision": self.precision.name,
            "execution": cfg.execution.mode.value,
            "bgrad": self.model.bgrad,
            "optimizer": cfg.optimizer.name,
            "optimizer_state_dtype": self.optimizer.state_dtype.name,  # (optimizer.state_dtype; null: param_dtype)
            "scaler": self.scaler.state_dict() if self.scaler.enabled else None,
            "rng": {"seed": cfg.seed, "data_seed": self.train_loader.seed},
            "data": data_meta,
        }
        if self.model.embedding is not None:  # how predict folds it into the first layer (mlptrain.nn.embedding)
            meta["embedding"] = self.model.embedding.to_meta()
        return arrays, meta

    def load_state_dict(self, arrays: dict[str, np.ndarray], meta: dict[str, Any], *, step: int, where: str) -> None:
        """Continue from a state of :meth:`state_dict` at optimizer step ``step``, after checking that it fits.

        Raises:
            CheckpointError: another architecture, parameter dtype or optimizer, or missing,
                extra or misshapen arrays (``where`` names the checkpoint in the message).
        """
        state_fit.check(self, arrays, meta, where)
        if self.dataset.preprocessing_differs(arrays, where):
            log.warning("%s: the data is normalised differently than when the checkpoint was saved", where)
        self.model.load_state_dict({k[len("param/") :]: v for k, v in arrays.items() if k.startswith("param/")})
        optim = {k[len("optim/") :]: v for k, v in arrays.items() if k.startswith("optim/")}
        if widened := self.optimizer.load_state_dict(optim):  # (saved in bfloat16 before it was kept wide)
            master, names = self.optimizer.params[0].value.dtype.name, sorted({k.split("/")[-1] for k in widened})
            log.warning(
                "%s: its optimizer state %s is bfloat16, saved before Adam's second moment stayed in the master "
                "dtype under optimizer.state_dtype=bfloat16: widened to %s (exactly); the run goes on with it in %s",
                where,
                ", ".join(names),
                master,
                master,
            )
        if self.scaler.enabled and meta["scaler"] is not None:
            self.scaler.load_state_dict(meta["scaler"])
        fp8.load_state_dict(self.gemm, arrays)
        self.clock.set(step)
        self.schedule.sync()
        if meta.get("bgrad") and meta["bgrad"] != self.model.bgrad:
            # The strategies round differently: continue with the one the run was trained with.
            log.info("%s: using the checkpoint's bgrad strategies %s", where, meta["bgrad"])
            self.model.set_bgrad(meta["bgrad"])


def _gather_rows(comm: Any, binary: np.ndarray) -> np.ndarray:
    """Every rank's ``(2, n)`` columns, in rank order, on every rank: two all-reduces (the counts, then the
    columns, each rank's written at its offset of a zeroed array)."""
    counts = np.zeros(comm.world)
    counts[comm.rank] = binary.shape[1]
    comm.all_reduce([counts])
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    out = np.zeros((2, int(offsets[-1])))
    out[:, offsets[comm.rank] : offsets[comm.rank + 1]] = binary
    comm.all_reduce([out])
    return out


class SplitScores:
    """The scores of one split, batch by batch: :meth:`add` each batch's logits, :meth:`result` once at the end.

    Each batch's 0-d loss and count stay on the device until the last batch is queued, and so do the scores'
    sums (a confusion matrix, or per-target error sums; :class:`~mlptrain.nn.scores.SplitSums`); the loss sums
    are then taken on the host (float64, in batch order) and the scores' sums copied once. Data parallel: the
    sums are all-reduced over the ranks. An ensemble keeps one per member and one for the ensemble.
    """

    def __init__(self, tr: Trainer) -> None:
        self.tr = tr
        self.classification = tr.dataset.task == "classification"
        classes = tr.widths[-1] if self.classification else None
        self.cross_entropy = tr.head.loss_name == "cross_entropy"  # its loss is the log loss
        self.gathered = scores.SplitSums(tr.xp, classes, log_loss=self.classification and not self.cross_entropy)
        self.per_batch: list[tuple[Any, Any, int]] = []

    def add(self, logits: Any, y: Any) -> None:
        """One batch: ``logits (B, C)`` against ``y (B,)`` (or ``(B, T)``), nothing read back."""
        self.gathered.add(logits, y)  # (reads the logits before the loss does)
        self.per_batch.append((*self.tr.head.evaluate(logits, y), len(y)))

    def result(self, split: str, prefix: str = "") -> dict[str, float]:
        """``{prefix}{split}/loss`` and the scores (syncs the device)."""
        tr, to_host = self.tr, self.tr.backend.to_host
        loss_sum = 0.0
        for loss, _, rows in self.per_batch:
            h = to_host(loss)  # 0-d, the loss's dtype
            loss_sum += np.float64(h * h.dtype.type(rows))  # loss x rows in that dtype, as the device did
        correct = sum(int(to_host(c)) for _, c, _ in self.per_batch) if self.classification else 0
        extra, binary = self.gathered.host(to_host, tr.widths[-1])  # .asnumpy syncs the device (once each)
        sums = np.concatenate([[loss_sum, correct, sum(r for _, _, r in self.per_batch)], extra])
        if tr.grad_sync is not None:
            tr.grad_sync.comm.all_reduce([sums])  # every rank's rows: the whole split
            binary = None if binary is None else _gather_rows(tr.grad_sync.comm, binary)
        rows = int(sums[2])
        out = {f"{split}/loss": float(sums[0]) / sums[2]}
        if self.classification:
            out[f"{split}/acc"] = int(sums[1]) / rows
        ts = tr.dataset.target_scaling
        classes = tr.widths[-1] if self.classification else None
        cross_entropy_loss = out[f"{split}/loss"] if self.cross_entropy else None
        found = scores.scores(sums[3:], binary, classes, rows, cross_entropy_loss, None if ts is None else ts.scale)
        out.update({f"{split}/{k}": v for k, v in found.items()})
        return {prefix + k: v for k, v in out.items()}
