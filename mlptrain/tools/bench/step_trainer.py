"""A GPU trainer on random data for the step benchmarks, its configuration composed through Hydra.

:func:`step_overrides` writes the command-line overrides of a benchmark's step (``device=gpu``,
``precision=fp16``, ``model.hidden=[4096,4096,4096,4096]`` ...), :func:`step_config` composes
them with ``conf/config.yaml`` as the command line would (:func:`mlptrain.cli.main.compose_config`,
validated), and :func:`step_trainer` builds the Trainer on random data of the model's shape (one
batch per epoch). Composing the configuration needs no GPU; building the trainer does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlptrain.base.backend import get_backend
from mlptrain.cli.main import compose_config
from mlptrain.config.schema import TrainConfig

HALF = ("fp16", "bf16")


def _value(v: Any) -> str:
    """A Python value as a Hydra override value (None is ``null``, booleans lower case, lists unspaced)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    return str(v)


def step_overrides(
    widths: list[int],
    batch: int,
    precision: str,
    mode: str = "fused",
    graph: bool = True,
    autotune: bool = False,
    optimizer: str = "sgd",
    bgrad: str = "auto",
    wgrad_stream: bool | None = None,
    head_kernel: bool = True,
    workspace_mib: Any = "default",
    activation: str = "relu",
    compute_copy: str | None = None,
) -> list[str]:
    """The overrides of a benchmark step: ``widths`` (input, hidden..., classes) at ``batch``, SGD
    (or ``optimizer``) at a constant lr of 1e-3, no progress bar. ``compute_copy`` applies to fp16,
    bf16 and fp8 (None: the precision's own); ``workspace_mib="default"`` keeps the configuration's cap."""
    values: dict[str, Any] = {
        "device": "gpu",
        "precision.name": precision,
        "execution.mode": mode,
        "execution.bgrad": bgrad,
        "execution.autotune": autotune,
        "execution.wgrad_stream": wgrad_stream,
        "execution.head_kernel": head_kernel,
        "model.hidden": list(widths[1:-1]),
        "model.activation": activation,
        "data.batch_size": batch,
        "optimizer.name": optimizer,
        "optimizer.schedule": "constant",
        "optimizer.lr": 1e-3,
        "progress": False,
        "graph": graph,
    }
    if compute_copy is not None and precision in (*HALF, "fp8"):  # else the precision's own (auto)
        values["precision.compute_copy"] = compute_copy
    if workspace_mib != "default":  # else the configuration's default cap
        values["execution.workspace_mib"] = workspace_mib
    return [f"{k}={_value(v)}" for k, v in values.items()]


def step_config(widths: list[int], batch: int, precision: str, **options: Any) -> TrainConfig:
    """The composed, validated configuration of a benchmark step (options: :func:`step_overrides`)."""
    return compose_config(step_overrides(widths, batch, precision, **options))


def random_dataset(widths: list[int], batch: int) -> Any:
    """One batch of random normal features and random labels of the model's shape; no test split."""
    from mlptrain.data import Dataset

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, widths[0]), dtype=np.float32)
    y = rng.integers(0, widths[-1], batch)
    empty_x, empty_y = np.zeros((0, widths[0]), np.float32), np.zeros(0, np.int64)
    return Dataset("random", x, y, empty_x, empty_y, empty_x, empty_y, num_classes=widths[-1])


def step_trainer(
    widths: list[int], batch: int, precision: str, mode: str = "fused", comm: Any = None, **options: Any
) -> Any:
    """A GPU Trainer for ``widths`` on random data (one batch per epoch), as the step benchmarks use it
    (``comm``: one rank of a data-parallel group; ``batch`` is then the global batch; options:
    :func:`step_overrides`)."""
    from mlptrain.step.trainer import Trainer

    cfg = step_config(widths, batch, precision, mode=mode, **options)
    return Trainer(cfg, dataset=random_dataset(widths, batch), comm=comm)


def digits_overrides(graph: bool, **overrides: Any) -> list[str]:
    """The overrides of :func:`graph_run`: digits at batch 64, Adam at lr 1e-3, 4 epochs, on the GPU;
    ``{"a.b": v}`` adds (or replaces) ``a.b=v``."""
    values: dict[str, Any] = {
        "device": "gpu",
        "progress": False,
        "data.batch_size": 64,
        "optimizer.name": "adam",
        "optimizer.lr": 1e-3,
        "epochs": 4,
        "execution.bgrad": "bgradb",  # not "auto": two runs must make the same (measured) choice
        "graph": graph,
        **overrides,
    }
    return [f"{k}={_value(v)}" for k, v in values.items()]


def graph_run(graph: bool, steps: int, **overrides: Any) -> tuple[Any, np.ndarray]:
    """``steps`` steps of a digits trainer (:func:`digits_overrides`) on a non-default stream, as the
    training loop runs them (batches gathered into the graph's inputs); returns the trainer and the losses."""
    from mlptrain.step.trainer import Trainer

    cp = get_backend("gpu").xp
    tr = Trainer(compose_config(digits_overrides(graph, **overrides)))
    losses = []
    with cp.cuda.Stream(non_blocking=True):
        for epoch in range(4):
            for x, y in tr.train_loader.epoch(epoch, out=tr.batch_buffers):
                losses.append(tr.step(x, y)[0].copy())  # a replayed graph rewrites the same loss array
                if len(losses) == steps:
                    break
            if len(losses) == steps:
                break
        cp.cuda.get_current_stream().synchronize()
    return tr, np.array([float(v) for v in losses])
