"""One builder per config group: where each part of the configuration becomes its object.

============== ===================================== =========================================
config group   builder                               object
============== ===================================== =========================================
``device``     :func:`mlptrain.base.backend.get_backend`  :class:`~mlptrain.base.backend.Backend`
``precision``  :func:`precision`                     :class:`~mlptrain.step.precision.Precision`,
               :func:`scaler`                        :class:`~mlptrain.step.precision.LossScaler`
``execution``  :func:`gemm`, :func:`execution`       the GEMM engine, fused or naive execution
``model``      :func:`widths`, :func:`model`,        :class:`~mlptrain.nn.network.MLP`,
               :func:`head`                          :class:`~mlptrain.nn.head.OutputHead`
``data``       :func:`loaders`                       :class:`~mlptrain.data.loader.DataLoader` per split
``optimizer``  :func:`optimizer`, :func:`schedule`   the optimizer, the learning-rate schedule
============== ===================================== =========================================

The builders take the config group they build from (typed, already validated) and the objects they
need; :func:`trainer` calls them in order, for :class:`mlptrain.step.trainer.Trainer`. The options of
``optimizer``, ``precision``, ``model.loss`` and ``model.activation`` are rows of their registries
(:mod:`mlptrain.base.registry`): the builders look the row up, so a registered option needs no branch
here. Adding a setting means adding it to the schema (:mod:`mlptrain.config.schema`), its range or the
options it applies to (:mod:`mlptrain.step.checks`, or the registry row), and the builder of its group.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from mlptrain.base.backend import Backend, get_backend
from mlptrain.base.errors import ConfigError
from mlptrain.base.timeline import mark
from mlptrain.config.schema import (
    DataConfig,
    ExecutionConfig,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    TrainConfig,
    ensemble_members,
)
from mlptrain.data import Dataset, load_dataset, preprocess
from mlptrain.data.host_loader import HostLoader, residency
from mlptrain.data.loader import DataLoader
from mlptrain.data.member_loader import same_rows
from mlptrain.data.prepare import task_for_loss
from mlptrain.data.rows import NormalisedRows
from mlptrain.distributed.dp import GradientSync, shard_rows
from mlptrain.nn import embedding
from mlptrain.nn.batched import BatchedMLP, BatchedNumpyGemm
from mlptrain.nn.execution import FusedExecution, NaiveExecution, NumpyGemm
from mlptrain.nn.head import OutputHead
from mlptrain.nn.losses import LOSSES, class_weights, mse_in_units
from mlptrain.nn.members import MemberHead
from mlptrain.nn.network import MLP
from mlptrain.step.optim import OPTIMIZERS, Optimizer
from mlptrain.step.precision import LossScaler, Precision, get_precision
from mlptrain.step.runtime import Runtime, device_runtime
from mlptrain.step.schedule import LRSchedule, StepClock
from mlptrain.step.steplog import StepLog

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainerParts:
    """What a :class:`~mlptrain.step.trainer.Trainer` steps with, each built from its config group (:func:`trainer`)."""

    backend: Backend
    precision: Precision
    runtime: Runtime  # where the step runs (mlptrain.step.runtime), prepared by the trainer
    dataset: Dataset
    widths: list[int]
    gemm: Any
    execution: FusedExecution | NaiveExecution
    model: MLP
    head: OutputHead
    train_loader: DataLoader  # an ensemble's: a MemberLoader, each member's batches stacked
    eval_loaders: dict[str, DataLoader]
    grad_sync: GradientSync | None  # data parallel: this rank's gradients made the global batch's
    optimizer: Optimizer
    scaler: LossScaler
    total_steps: int
    clock: StepClock  # the one step counter of the run
    schedule: LRSchedule
    log: StepLog  # per-step metrics and the end-of-step bookkeeping, on the device (read every log_every steps)


def trainer(
    cfg: TrainConfig,
    dataset: Dataset | None,
    backend: Backend | None,
    *,
    comm: Any,
    precompile: Any,
    member_data: Callable[..., tuple[DataLoader, dict]] | None = None,
    member_seeds: list[int] | None = None,
) -> TrainerParts:
    """The parts of a trainer (its arguments: :class:`~mlptrain.step.trainer.Trainer`), built in order.
    ``member_data``: an ensemble's loaders (default :func:`~mlptrain.data.member_loader.same_rows`; folds:
    :class:`mlptrain.run.folds.Folds`); ``member_seeds``: member k's run seed (default ``seed + k``)."""
    backend = backend or get_backend(cfg.device.value)
    xp, prec = backend.xp, precision(cfg.precision, backend)
    # GPU: the run's CuPy kernels compile on threads from here on, each waited for before its first launch
    runtime = device_runtime(
        backend,
        prec,
        precompile=precompile,
        ahead=cfg.execution.precompile,  # GPU: kernels compile on threads from here, each awaited before its launch
        resume=cfg.resume is not None,
        graph=cfg.graph is not False,
        autotune=cfg.execution.autotune,
    )
    data_cfg = task_for_loss(cfg.data, cfg.model.loss)  # a regression loss makes a file's task a regression
    data = load_dataset(data_cfg) if dataset is None else preprocess(dataset, cfg.data)  # one path
    mark("data")
    sizes = widths(cfg.model, data)
    members = ensemble_members(cfg)  # > 1: an ensemble, member k seeded as a single run of seed + k (docs/ensembles.md)
    engine = gemm(cfg.execution, backend, prec, members)
    ex = execution(cfg.execution, engine, xp)
    runtime.wait("setup")  # from here on: the parameters' cast (resuming: CuPy's fill)
    run_seeds = member_seeds or [cfg.seed + k for k in range(members)]  # (sklearn's cross_val_predict: one seed)
    net = model(cfg.model, sizes, ex, backend, prec, [seeds(s)[0] for s in run_seeds], data)
    two_streams = wgrad_stream(cfg.execution, sizes, cfg.data.batch_size * members, comm is not None)  # every member's
    runtime.wgrad_stream(net, two_streams)  # GPU: dW GEMMs concurrent with the dX chain
    out = head(cfg, backend, sizes, members)
    if (units := data.target_units()) is not None:  # standardised targets (mse): losses in their units
        out.loss_fn = mse_in_units(xp.asarray(units))
    if cfg.model.class_weight is not None:
        _weigh_classes(out, cfg.model.class_weight, data, xp)
    if data.w_train is not None:  # data.weight: the training batches carry each row's weight (last, once the loss is)
        out.weigh_rows(data.task == "classification")
    shard = (comm.rank, comm.world) if comm is not None else None
    data_seeds = [seeds(s)[1] for s in run_seeds]
    train, evaluation = loaders(cfg.data, data, xp, prec.compute_dtype, data_seeds[0], shard)
    if members > 1:  # member k's batches in the order of the single run of seed + k (folds: of its own rows)
        make = member_data or same_rows
        train, evaluation = make(cfg.data, data, xp, prec.compute_dtype, data_seeds, train, evaluation)
    bucket = int(cfg.distributed.bucket_mib * 2**20)  # data parallel: this rank's gradients all-reduced in buckets
    sync = None if comm is None else GradientSync(comm, cfg.data.batch_size, xp, bucket)
    opt, loss_scaler = optimizer(cfg.optimizer, net.params), scaler(cfg.precision, xp, prec)
    total_steps = len(train) * cfg.epochs
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    clock = StepClock(xp)
    lr = schedule(cfg.optimizer, xp, clock, total_steps)
    return TrainerParts(
        backend=backend,
        precision=prec,
        runtime=runtime,
        dataset=data,
        widths=sizes,
        gemm=engine,
        execution=ex,
        model=net,
        head=out,
        train_loader=train,
        eval_loaders=evaluation,
        grad_sync=sync,
        optimizer=opt,
        scaler=loss_scaler,
        total_steps=total_steps,
        clock=clock,
        schedule=lr,
        log=StepLog(xp, cfg.log_every, loss_scaler, lr),
    )


def seeds(seed: int) -> tuple[np.random.Generator, int]:
    """The initial weights' generator and the data order's seed of a run of ``seed``: independent host streams,
    from one seed. Member ``k`` of an ensemble takes those of ``seed + k``."""
    init_seed, data_seed = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(init_seed), int(data_seed.generate_state(1)[0])


def precision(cfg: PrecisionConfig, backend: Backend) -> Precision:
    """``precision.name`` on ``backend`` (half precision and TF32 need the GPU), and its ``compute_copy``
    (``auto``: the precision's own)."""
    base = get_precision(cfg.name, backend)
    return dataclasses.replace(
        base,
        compute_copy=base.compute_copy if cfg.compute_copy.value == "auto" else cfg.compute_copy.value,
        amax_history=cfg.amax_history,
        margin=cfg.margin,
    )


def scaler(cfg: PrecisionConfig, xp: Any, prec: Precision) -> LossScaler:
    """Dynamic loss scaling for fp16; fp8: a scale of 1 that never changes, checked every step (an inf/NaN
    gradient skips the step); a scale of 1 that is never checked otherwise."""
    if prec.checked:
        return LossScaler(xp, enabled=True, init_scale=1.0, growth_factor=1.0, backoff_factor=1.0)
    return LossScaler(
        xp,
        enabled=prec.loss_scaling,
        init_scale=cfg.init_scale,
        growth_factor=cfg.growth_factor,
        backoff_factor=cfg.backoff_factor,
        growth_interval=cfg.growth_interval,
    )


def gemm(cfg: ExecutionConfig, backend: Backend, prec: Precision, members: int = 1) -> Any:
    """The GEMM engine: planned nvmath Matmuls on the GPU, the NumPy epilog contract on the CPU; fp8: FP8 casts and
    GEMMs around it (:class:`mlptrain.nn.fp8.Fp8Gemm`), which stays for what FP8 cannot run. An ensemble's GEMMs
    (``members > 1``) are batched: nvmath takes the stacks, the CPU :class:`~mlptrain.nn.batched.BatchedNumpyGemm`."""
    if not backend.is_gpu:
        engine: Any = NumpyGemm() if members == 1 else BatchedNumpyGemm()
    else:
        from mlptrain.nn.cuda.gemm import NvmathGemm
        from mlptrain.nn.cuda.plan_cache import PlanCache

        cache = PlanCache(PlanCache.default_path()) if cfg.plan_cache else None
        engine = NvmathGemm(tf32=prec.tf32, autotune=cfg.autotune, plan_cache=cache, workspace_mib=cfg.workspace_mib)
        engine.epilogue_kernels = cfg.epilogue_kernels  # (execution.epilogue_kernels)
    return fp8_gemm(cfg, backend, prec, engine) if prec.fp8 else engine


def fp8_gemm(cfg: ExecutionConfig, backend: Backend, prec: Precision, engine: Any) -> Any:
    """``precision=fp8``: cuBLASLt's FP8 GEMMs on the GPU (:mod:`mlptrain.nn.cuda.fp8_gemm`), the FP8 contract
    emulated on the CPU; either casts each operand with its delayed scale."""
    from mlptrain.nn.fp8 import Fp8Gemm, Fp8Scaling

    if backend.is_gpu:
        from mlptrain.nn.cuda.fp8_gemm import GpuFp8Gemm
        from mlptrain.nn.cuda.fp8_kernels import GpuFp8Scaling

        on_gpu = GpuFp8Scaling(amax_history=prec.amax_history, margin=prec.margin)
        mode = cfg.mode.value
        return GpuFp8Gemm(engine, on_gpu, mode, dtype=prec.compute_dtype, workspace_mib=cfg.workspace_mib)
    scaling = Fp8Scaling(backend.xp, amax_history=prec.amax_history, margin=prec.margin)
    return Fp8Gemm(engine, scaling, mode=cfg.mode.value, dtype=prec.compute_dtype)


def execution(cfg: ExecutionConfig, engine: Any, xp: Any) -> FusedExecution | NaiveExecution:
    """``execution.mode``: epilogs in the GEMMs, or plain GEMMs and separate array operations."""
    return FusedExecution(engine) if cfg.mode.value == "fused" else NaiveExecution(engine, xp)


def widths(cfg: ModelConfig, dataset: Dataset) -> list[int]:
    """``[in, hidden..., out]``, checking configured widths and the loss against the dataset."""
    in_f, out_f = dataset.num_features, dataset.num_outputs
    if dataset.task == "regression" and not LOSSES[cfg.loss].regression:
        raise ConfigError(
            f"dataset {dataset.name!r} is a regression (targets {', '.join(dataset.target_names or [])}) but "
            f"model.loss={cfg.loss}; set model.loss=mse"
        )
    if cfg.in_features is not None and cfg.in_features != in_f:
        raise ConfigError(
            f"model.in_features={cfg.in_features} does not match dataset {dataset.name!r}, which has {in_f} "
            f"features per sample; set model.in_features={in_f} or null (taken from the dataset)"
        )
    if cfg.out_features is not None and cfg.out_features != out_f:
        raise ConfigError(
            f"model.out_features={cfg.out_features} does not match dataset {dataset.name!r}, which has "
            f"{out_f} {'classes' if dataset.task == 'classification' else 'targets'}; set model.out_features={out_f} "
            "or null"
        )
    return [in_f, *cfg.hidden, out_f]


def model(
    cfg: ModelConfig,
    sizes: list[int],
    ex: FusedExecution | NaiveExecution,
    backend: Backend,
    prec: Precision,
    rngs: list[np.random.Generator],
    data: Dataset | None = None,
) -> MLP:
    """The MLP of ``sizes``, initialised from ``rngs[0]`` (the trainer decides its streams: :func:`wgrad_stream`);
    with more, an ensemble: member k initialised from ``rngs[k]`` (:class:`~mlptrain.nn.batched.BatchedMLP`)."""
    if len(rngs) > 1:
        kw = {"activation": cfg.activation, "init": cfg.init.value}
        return BatchedMLP(
            sizes,
            execution=ex,
            xp=backend.xp,
            rngs=rngs,
            param_dtype=prec.param_dtype,
            compute_dtype=prec.compute_dtype,
            **kw,
        )
    return MLP(
        sizes,
        execution=ex,
        xp=backend.xp,
        rng=rngs[0],
        param_dtype=prec.param_dtype,
        compute_dtype=prec.compute_dtype,
        activation=cfg.activation,
        init=cfg.init.value,
        compute_copy=prec.compute_copy,
        fp8_weights=prec.fp8,
        embedding=embedding.from_config(cfg, data, rngs[0], backend.xp, prec),  # model.embedding_dim
    )


# Below this many GEMM FLOPs per step, execution.wgrad_stream=null runs the weight gradients on a second
# stream: a small step's GEMMs leave the GPU idle enough for two streams to overlap, while a large
# step's GEMMs fill it and one stream peaks lower (docs/benchmarks.md, "Figures moved out of the code").
TWO_STREAMS_MAX_FLOPS = 1e11


def wgrad_stream(ex_cfg: Any, sizes: list[int], batch: int, data_parallel: bool) -> bool:
    """Whether the weight-gradient GEMMs run on a second stream, concurrent with the input-gradient chain.

    ``execution.wgrad_stream`` when set; by default where the step is latency-bound (small GEMMs leave
    the GPU room for a second one) or data parallel (each layer's all-reduce starts on that stream).
    """
    if ex_cfg.wgrad_stream is not None:
        return bool(ex_cfg.wgrad_stream)
    return data_parallel or step_flops(sizes, batch) < TWO_STREAMS_MAX_FLOPS


def step_flops(sizes: list[int], batch: int) -> int:
    """GEMM FLOPs of one training step: three GEMMs of ``2 x batch x in x out`` per layer."""
    return 6 * batch * sum(a * b for a, b in zip(sizes, sizes[1:], strict=False))


def head(cfg: TrainConfig, backend: Backend, sizes: list[int], members: int = 1) -> OutputHead:
    """How the loss and the output layer's gradients are computed: ``OutputHead.choose`` (ensembles: ``MemberHead``)."""
    return (OutputHead if members == 1 else MemberHead).choose(
        loss=cfg.model.loss,
        gpu=backend.is_gpu,
        fused=cfg.execution.mode.value == "fused",
        relu=cfg.model.activation == "relu",
        widths=sizes,
        batch_size=cfg.data.batch_size,
        head_kernel=cfg.execution.head_kernel,
    )


def _weigh_classes(out: OutputHead, spec: Any, data: Dataset, xp: Any) -> None:
    """``model.class_weight`` in the loss (:meth:`OutputHead.weigh_classes`), resolved on the training split."""
    if data.task != "classification":
        raise ConfigError(f"model.class_weight weighs classes; dataset {data.name!r} is a {data.task}")
    try:
        weights = class_weights(spec, data.y_train, data.num_classes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    assert weights is not None
    out.weigh_classes(weights, xp)


def loaders(
    cfg: DataConfig, dataset: Dataset, xp: Any, dtype: Any, seed: int, shard: tuple[int, int] | None = None
) -> tuple[DataLoader, dict]:
    """The shuffled training loader (order from ``seed``; ``shard``: this rank's rows of each batch)
    and an ordered loader per evaluation split.

    Where the splits live is :func:`mlptrain.data.host_loader.residency`'s choice: on the device
    (:class:`DataLoader`, copied once) or in host memory (:class:`~mlptrain.data.host_loader.HostLoader`, each
    batch copied ahead of its step).
    """
    kind: type[DataLoader] = DataLoader
    if residency(cfg, dataset, xp, np.dtype(dtype)) == "host":
        kind = HostLoader
    train = kind(
        dataset.x_train,
        dataset.y_train,
        cfg.batch_size,
        xp=xp,
        dtype=dtype,
        shuffle=True,
        drop_last=cfg.drop_last,
        seed=seed,
        shard=shard,
        w=dataset.w_train,  # row weights (data.weight): gathered with each batch's targets
    )
    evaluation = {}
    for split, x, y in (("val", dataset.x_val, dataset.y_val), ("test", dataset.x_test, dataset.y_test)):
        if len(x) == 0:
            continue
        if shard is not None:  # data parallel: this rank's contiguous rows of the split (maybe none)
            rows = shard_rows(len(x), *shard)
            x, y = (x.subset(rows) if isinstance(x, NormalisedRows) else x[rows]), y[rows]
        evaluation[split] = kind(x, y, cfg.eval_batch_size, xp=xp, dtype=dtype, shuffle=False, drop_last=False, seed=0)
    return train, evaluation


def optimizer(cfg: OptimizerConfig, params: list) -> Optimizer:
    """``optimizer.name``'s row of :data:`mlptrain.step.optim.OPTIMIZERS` (SGD, Adam, AdamW, or a registered one)."""
    return OPTIMIZERS[cfg.name].build(cfg, params)


def schedule(cfg: OptimizerConfig, xp: Any, clock: StepClock, total_steps: int) -> LRSchedule:
    """The learning rate of every step, on the device, from the step count of ``clock``."""
    return LRSchedule(
        xp,
        clock,
        base_lr=cfg.lr,
        total_steps=total_steps,
        schedule=cfg.schedule.value,
        warmup_steps=cfg.warmup_steps,
        min_ratio=cfg.min_lr_ratio,
    )
