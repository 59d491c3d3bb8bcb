"""The training step: the model, its loss, its optimizer, and one step of them on the device.

A :class:`Trainer` is built from a valid config (:mod:`mlptrain.build` turns each config group
into its object) and does one thing: train steps. The run around it (epochs, metrics,
checkpoints, interruption) is :func:`mlptrain.run.train`.

One step (:meth:`Trainer.step`), all on the device, with no host synchronisation, so on the GPU it
is captured once into a CUDA graph and replayed (:mod:`mlptrain.gpu.graph`, ``graph=false`` to
turn off)::

    logits = model.forward(x)                            # fused: RELU_AUX_BIAS ... BIAS
    loss, correct = head.backward(model, logits, y, s)   # the loss kernel (and, small heads, the
                                                         # head kernel), then the network's backward:
                                                         # DRELU(_BGRAD), BGRADB
    skip = scaler.check(grads)                           # fp16 only: 1 kernel over all gradients
    optimizer.step(lr, 1/s, skip,                        # 1 kernel over all parameters, whose last
                   tail=log.tail(loss, correct, B))      # block updates the loss scale, the step
                                                         # count and the lr, and records the metrics

For 784-1024-1024-10 in fp16 that is 7 GEMMs and 4 small kernels (``scripts/step_kernels.py``
lists them). The host reads the metrics back only every ``log_every`` steps, from the device ring
of :class:`~mlptrain.steplog.StepLog`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from mlptrain import bgrad, build, fp8, shell
from mlptrain.backend import Backend, get_backend
from mlptrain.config import TrainConfig
from mlptrain.data import Dataset, load_dataset, preprocess
from mlptrain.errors import CheckpointError
from mlptrain.losses import mse_in_units
from mlptrain.schedule import StepClock
from mlptrain.steplog import StepLog

log = logging.getLogger(__name__)


class Trainer:
    """The step of a run, built from a valid :class:`TrainConfig` (:func:`mlptrain.config.validate`).

    Args:
        cfg: the configuration.
        dataset: the data to train on (default: the one ``cfg.data`` names).
        backend: where to run (default: ``cfg.device``).
        comm: data parallelism (:mod:`mlptrain.distributed`): this trainer is one rank of
            ``comm.world``; it takes its shard of every training batch, and its gradients, loss and
            counts become the global batch's before each update (``distributed.gpus``, torchrun).
        precompile: GPU: the run's kernels, compiling on threads (:mod:`mlptrain.gpu.precompile`) since
            :func:`mlptrain.run.train` started them; by default the trainer starts them.
    """

    def __init__(
        self, cfg: TrainConfig, dataset: Dataset | None = None, backend: Backend | None = None, *, comm: Any = None,
        precompile: Any = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.backend = backend or get_backend(cfg.device.value)
        xp = self.xp = self.backend.xp
        self.precision = build.precision(cfg.precision, self.backend)
        # GPU: the run's CuPy kernels compile on threads from here on, each waited for before its first launch
        self._precompile = precompile if self.backend.is_gpu else None
        if self.backend.is_gpu and precompile is None:
            from mlptrain.gpu.precompile import start

            self._precompile = start(self.precision, resume=cfg.resume is not None)
        self.dataset = load_dataset(cfg.data) if dataset is None else preprocess(dataset, cfg.data)  # one path
        self.widths = build.widths(cfg.model, self.dataset)
        # Independent host streams for init and data order, from one seed.
        init_seed, data_seed = np.random.SeedSequence(cfg.seed).spawn(2)
        self.gemm = build.gemm(cfg.execution, self.backend, self.precision)
        self.execution = build.execution(cfg.execution, self.gemm, xp)
        self.await_kernels("setup")  # from here on: the parameters' cast (resuming: CuPy's fill)
        self.model = build.model(
            cfg.model, self.widths, self.execution, self.backend, self.precision,
            np.random.default_rng(init_seed),
        )  # fmt: skip
        two_streams = build.wgrad_stream(cfg.execution, self.widths, cfg.data.batch_size, comm is not None)
        if self.backend.is_gpu and two_streams:
            self.model.use_wgrad_stream()  # dW GEMMs concurrent with the dX chain
        self.head = build.head(cfg, self.backend, self.widths)
        if (units := self.dataset.target_units()) is not None:  # standardised targets (mse): losses in their units
            self.head.loss_fn = mse_in_units(xp.asarray(units))
        cdt = self.precision.compute_dtype
        shard = (comm.rank, comm.world) if comm is not None else None
        self.train_loader, self.eval_loaders = build.loaders(
            cfg.data, self.dataset, xp, cdt, int(data_seed.generate_state(1)[0]), shard
        )
        self.grad_sync: Any = None
        if comm is not None:
            from mlptrain.distributed.dp import GradientSync

            self.grad_sync = GradientSync(comm, cfg.data.batch_size, xp, int(cfg.distributed.bucket_mib * 2**20))
        self.optimizer = build.optimizer(cfg.optimizer, self.model.params)
        self.scaler = build.scaler(cfg.precision, xp, self.precision)
        self.steps_per_epoch = len(self.train_loader)
        self.total_steps = self.steps_per_epoch * cfg.epochs
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.clock = StepClock(xp)  # the one step counter of the run
        self.schedule = build.schedule(cfg.optimizer, xp, self.clock, self.total_steps)
        # Per-step metrics and the end-of-step bookkeeping, on the device (read every log_every steps).
        self.log = StepLog(xp, cfg.log_every, self.scaler, self.schedule)
        self._device_runtime(comm is None)
        bgrad.choose(self)  # on the GPU it may time the step, so after everything the step uses
        if self.backend.is_gpu:  # blocks set-up freed (the probe's, temporaries of the weights' init) go back
            xp.get_default_memory_pool().free_all_blocks()  # to the device: the step allocates from its own pool
        if self.grad_sync is not None and self.backend.is_gpu:  # after the probe: it times one rank's step alone
            self.grad_sync.overlap(self.model)  # each layer's weight gradient all-reduced as soon as it is made
        if self._precompile is not None:  # the kernels of the step and of evaluation, planned from what was built
            from mlptrain.gpu.precompile import step_jobs

            self._precompile.submit(step_jobs(self), last=True)

    def _device_runtime(self, one_process: bool) -> None:
        """The stream the training loop runs on, the step's CUDA graph and the pools' high-water mark.

        On the GPU a non-default CUDA stream (graph capture needs one); on the CPU a context that does nothing.
        """
        cfg, xp = self.cfg, self.xp
        self.stream: Any = contextlib.nullcontext()
        self.graphed: Any = None
        self.memory_peak: Any = None  # GPU: high-water mark of the pools (mlptrain.gpu.memory)
        if self.backend.is_gpu:
            from mlptrain.gpu.memory import PeakTracker

            xp.cuda.Device().synchronize()  # set-up work on the default stream is done
            self.stream = xp.cuda.Stream(non_blocking=True)
            self.memory_peak = PeakTracker(lambda: self.graphed.pool_bytes() if self.graphed is not None else 0)
        # Each training batch gathered by the step itself (train_batches): where the step is one replayed graph
        # and one process trains (data parallel ranks gather theirs as they did); tests turn it on, on the CPU.
        self.gathers_in_step = self.backend.is_gpu and cfg.graph is not False and one_process
        self._own_batches: dict[int, tuple[Any, Any]] = {}  # rows -> the buffers such a step gathers into
        if self.backend.is_gpu and cfg.graph is not False:
            from mlptrain.gpu.graph import GraphedStep

            model = self.model
            self.graphed = GraphedStep(
                self._launch, keep=model.step_arrays, restore=model.restore_step_arrays, release=self.release_step
            )

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
        if self._precompile is not None and self.cfg.execution.autotune:
            self.finish_precompile()  # autotune times GEMM candidates in CUDA graphs while it plans them
        gathers = self._gathers(x)
        if self.graphed is not None:
            out = self.graphed(x, y, tag="gather" if gathers else None)
        else:
            self.release_step()  # the last step's arrays go before this step allocates its own
            out = self._launch(x, y)
        self.clock.tick()
        if self._precompile is not None:  # that was the first step, never captured: every capture comes later
            self.finish_precompile()
        return out

    def release_step(self) -> None:
        """Drop the arrays the last step left: gradients, saved inputs and masks, and the GEMM plans'
        references to their last operands (their memory returns to the pool for the next step)."""
        self.model.release_step_arrays()
        if self.backend.is_gpu:
            self.gemm.release_operands()

    def _launch(self, x: Any, y: Any) -> tuple[Any, Any]:
        """The step's device work, launched op by op (what a CUDA graph records once)."""
        sync, rows = self.grad_sync, len(y)
        if self._gathers(x):  # the batch of this step, read on the device from the step count (train_batches)
            self.train_loader.gather_in_step(x, y, self.clock.device)
        lr, inv_scale = self.schedule.lr, self.scaler.inv_scale  # this step's
        if sync is None:
            loss, correct = self.forward_backward(x, y)
        else:  # data parallel (mlptrain.distributed.dp): this rank's share, then the global batch's
            loss, correct = self.forward_backward(x, y, sync.grad_scale(self.scaler.scale, rows))
            loss, correct, rows, inv_scale = sync(self.model.params, loss, correct, rows, inv_scale)
        self.await_kernels("update")
        skip = self.scaler.check([p.grad for p in self.model.params])  # fp16: any inf/NaN gradient
        if self.backend.is_gpu:  # one kernel: the update, then (its last block) the bookkeeping
            self.optimizer.step(lr, inv_scale, skip, tail=self.log.tail(loss, correct, rows))
        else:
            self.optimizer.step(lr, inv_scale, skip)
            self.log.end_step(loss, correct, rows)  # scaler update, the step count and lr, the metrics
        return loss, correct

    def forward_backward(self, x: Any, y: Any, grad_scale: Any = None) -> tuple[Any, Any]:
        """Forward, loss and backward: every ``param.grad`` set; returns device ``(loss, correct)``.

        ``grad_scale``: what the loss gradient is multiplied by (default: the loss scale)."""
        # (B, classes), handed over in a list: the loss writes dlogits over it and the backward frees it
        logits = [self.model.forward(x)]
        self.await_kernels("loss")  # (the first time, the forward's GEMMs were planned meanwhile)
        return self.head.backward(self.model, logits, y, self.scaler.scale if grad_scale is None else grad_scale)

    def rows(self, y: Any) -> int:
        """The rows of the global batch whose shard ``y`` is (data parallel), else ``len(y)``."""
        return self.train_loader.global_rows if self.grad_sync is not None else len(y)

    def train_batches(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[Any, Any]]:
        """The training batches of ``epoch`` from ``start_batch``, as the loop steps through them.

        Where the step is a replayed CUDA graph (:attr:`gathers_in_step`), the loader gathers nothing: it puts
        the epoch's order on the device once, and each step's first kernels gather its batch into the graph's
        input buffers, reading the step count on the device (:meth:`DataLoader.gather_in_step`). Replaying a
        step is then one graph launch, the batch included. Otherwise the loader gathers each batch into the
        graph's buffers (or fresh arrays) before the step.
        """
        ld = self.train_loader
        if not self.gathers_in_step:
            yield from ld.epoch(epoch, start_batch, out=self.batch_buffers)
            return
        ld.place_order(epoch, start_batch, self.step_count)
        for rows in ld.batch_rows(start_batch):
            if rows not in self._own_batches:
                self._own_batches[rows] = self.batch_buffers(rows, tag="gather") or self._host_buffers(rows)
            yield self._own_batches[rows]

    def _gathers(self, x: Any) -> bool:
        """Whether the step on ``x`` gathers its own batch: ``x`` is a buffer :meth:`train_batches` yields."""
        own = self._own_batches.get(len(x))
        return own is not None and own[0] is x

    def batch_buffers(self, rows: int, tag: str | None = None) -> tuple[Any, Any] | None:
        """Where the loader should gather a training batch of ``rows``: the CUDA graph's input
        buffers for that shape (saves the step a copy), or None (fresh arrays) without a graph.
        ``tag``: the graphs of steps that gather their own batch (:meth:`train_batches`) are others."""
        self.await_kernels("batch")  # the loader gathers next
        if self.graphed is None:
            return None
        ld = self.train_loader
        shapes = ((rows, ld.x.shape[1]), ld.x.dtype, (rows, *ld.y.shape[1:]), ld.y.dtype)
        return self.graphed.input_buffers(*shapes, tag=tag)

    def _host_buffers(self, rows: int) -> tuple[Any, Any]:
        """Batch arrays for steps that gather their own batch without a graph (the CPU, in tests)."""
        ld, xp = self.train_loader, self.xp
        return xp.empty((rows, ld.x.shape[1]), ld.x.dtype), xp.empty((rows, *ld.y.shape[1:]), ld.y.dtype)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (host value, for logs)."""
        return self.schedule.host(step)

    def evaluate(self, split: str) -> dict[str, float]:
        """Mean loss (and, for a classification, accuracy) over a whole split (syncs once at the end).

        Each batch's 0-d loss and count stay on the device until the last batch is queued; the sums
        are then taken on the host (float64, in batch order), so evaluating compiles no kernel of its own.
        Data parallel: each rank evaluates its rows of the split and the sums are all-reduced.
        """
        self.finish_precompile()
        loader = self.eval_loaders[split]
        per_batch = []
        for x, y in loader.epoch(0):
            per_batch.append((*self.head.evaluate(self.model.forward(x, keep=False), y), len(y)))
        if self.backend.is_gpu:
            self.gemm.release_operands()  # the plans forget the last batch: its memory can go
        to_host = self.backend.to_host
        loss_sum = 0.0
        for loss, _, rows in per_batch:
            h = to_host(loss)  # 0-d, the loss's dtype
            loss_sum += np.float64(h * h.dtype.type(rows))  # loss x rows in that dtype, as the device did
        classification = self.dataset.task == "classification"
        correct = sum(int(to_host(c)) for _, c, _ in per_batch) if classification else 0
        sums = np.array([loss_sum, correct, loader.num_samples], dtype=np.float64)
        if self.grad_sync is not None:
            self.grad_sync.comm.all_reduce([sums])  # every rank's rows: the whole split
        out = {f"{split}/loss": float(sums[0]) / sums[2]}
        if classification:
            out[f"{split}/acc"] = int(sums[1]) / int(sums[2])
        return out

    # --- kernels compiled ahead (mlptrain.gpu.precompile) --------------------------------------

    def await_kernels(self, stage: str | None = None) -> None:
        """Wait for the kernels of ``stage`` (None: all) compiling ahead: before their first launch."""
        if self._precompile is not None:
            self._precompile.wait(stage)

    def finish_precompile(self) -> None:
        """Wait for every kernel compiling ahead and end the threads, before any capture: :meth:`step` calls
        it after the first step (graphs are captured after uncaptured warm-up steps), :meth:`evaluate` first."""
        pre, self._precompile = self._precompile, None
        if pre is not None:
            pre.close()

    # --- state ------------------------------------------------------------------------------

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``(arrays, meta)``: the state of training, as host arrays and JSON-ready values (syncs the device).

        Arrays: ``param/<name>`` (master copies), ``optim/<name>/<state>`` and ``optim/t``, and the
        data's normalisation (``data/shift``, ``data/scale``). Meta: the architecture and dtypes it
        fits, the bgrad strategies, the loss scaler's state, the data seed and the data's
        preprocessing. The step count is the run's position (:class:`mlptrain.checkpoint.Position`).
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
            "scaler": self.scaler.state_dict() if self.scaler.enabled else None,
            "rng": {"seed": cfg.seed, "data_seed": self.train_loader.seed},
            "data": data_meta,
        }
        return arrays, meta

    def load_state_dict(self, arrays: dict[str, np.ndarray], meta: dict[str, Any], *, step: int, where: str) -> None:
        """Continue from a state of :meth:`state_dict` at optimizer step ``step``, after checking that it fits.

        Raises:
            CheckpointError: another architecture, parameter dtype or optimizer, or missing,
                extra or misshapen arrays (``where`` names the checkpoint in the message).
        """
        self._check_fits(arrays, meta, where)
        if self.dataset.preprocessing_differs(arrays, where):
            log.warning("%s: the data is normalised differently than when the checkpoint was saved", where)
        self.model.load_state_dict({k[len("param/") :]: v for k, v in arrays.items() if k.startswith("param/")})
        self.optimizer.load_state_dict({k[len("optim/") :]: v for k, v in arrays.items() if k.startswith("optim/")})
        if self.scaler.enabled and meta["scaler"] is not None:
            self.scaler.load_state_dict(meta["scaler"])
        fp8.load_state_dict(self.gemm, arrays)
        self.clock.set(step)
        self.schedule.sync()
        if meta.get("bgrad") and meta["bgrad"] != self.model.bgrad:
            # The strategies round differently: continue with the one the run was trained with.
            log.info("%s: using the checkpoint's bgrad strategies %s", where, meta["bgrad"])
            self.model.set_bgrad(meta["bgrad"])

    def _check_fits(self, arrays: dict[str, np.ndarray], m: dict[str, Any], where: str) -> None:
        if m["widths"] != self.widths:
            raise CheckpointError(
                f"{where} is for model {_w(m['widths'])} but this run builds {_w(self.widths)}; "
                f"resume with {shell.override('model.hidden', m['widths'][1:-1])} or start a new run"
            )
        want_dtype = np.dtype(self.precision.param_dtype).name
        if m["param_dtype"] != want_dtype:
            raise CheckpointError(
                f"{where} holds {m['param_dtype']} parameters (precision={m['precision']}) but this run uses "
                f"precision={self.precision.name} with {want_dtype} parameters; resume with precision={m['precision']}"
            )
        if m["optimizer"] != self.cfg.optimizer.name:
            raise CheckpointError(
                f"{where} holds {m['optimizer']} optimizer state but this run uses "
                f"optimizer={self.cfg.optimizer.name}; resume with optimizer={m['optimizer']}"
            )
        expected = {f"param/{p.name}": (tuple(p.value.shape), want_dtype) for p in self.model.params}
        expected.update({f"optim/{k}": (tuple(v.shape), None) for k, v in self.optimizer.state_dict().items()})
        expected.update(fp8.expected_arrays(self.gemm, arrays))
        for key, (shape, dtype) in expected.items():
            a = arrays.get(key)
            if a is None:
                raise CheckpointError(f"{where} has no {key!r} (optimizer settings such as momentum changed?)")
            if a.shape != shape or (dtype is not None and a.dtype.name != dtype):
                raise CheckpointError(
                    f"{where}: {key!r} is {a.dtype.name}{list(a.shape)}, expected {dtype or a.dtype.name}{list(shape)}"
                )
        extra = sorted(k for k in set(arrays) - set(expected) if not k.startswith("data/"))
        if extra:
            raise CheckpointError(
                f"{where} has state this run does not use: {', '.join(extra)} (optimizer settings changed?)"
            )


def _w(widths: list[int]) -> str:
    return "-".join(map(str, widths))
