"""A new optimizer from outside the package: one class, registered, and one YAML (#29).

Adagrad (``torch.optim.Adagrad`` without lr decay): ``sum += g^2; p -= lr * g / (sqrt(sum) + eps)``.
It reads ``optimizer.eps`` besides ``lr`` and ``weight_decay``; nothing in mlptrain names it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlptrain import train
from mlptrain.base.errors import ConfigError
from mlptrain.base.registry import POSITIVE
from mlptrain.cli.help import settings_help
from mlptrain.cli.main import compose_config
from mlptrain.nn.layers import Param
from mlptrain.run import checkpoint
from mlptrain.run.metrics import read_metrics
from mlptrain.step.optim import OPTIMIZERS, Optimizer, register_optimizer


class Adagrad(Optimizer):
    """Adagrad with L2 weight decay."""

    state_names = ("sum",)
    settings = {"eps": POSITIVE}

    def __init__(self, params: list[Param], *, lr: float, eps: float = 1e-10, weight_decay: float = 0.0) -> None:
        self.check(eps=eps)
        super().__init__(params, lr=lr, weight_decay=weight_decay)
        self.eps = eps

    def _update_numpy(self, p: Param, st: dict[str, Any], lr: float, inv_scale: float) -> None:
        g = p.grad.astype(p.value.dtype) * inv_scale + self.weight_decay * p.value
        st["sum"] += g * g
        p.value -= lr * g / (np.sqrt(st["sum"]) + self.eps)

    def _cuda_update(self) -> tuple[str, str]:
        return "", (
            f"if (!skipped) {{ P g = (P)$g * inv_s + (P){self.weight_decay!r} * $p; $sum = $sum + g * g;"
            f"$p = $p - lr_v * g / (sqrt($sum) + (P){self.eps!r}); }}"
        )


@pytest.fixture
def adagrad(tmp_path: Path) -> Iterator[list[str]]:
    """Adagrad registered, and conf/optimizer/adagrad.yaml in a config folder on Hydra's search path."""
    register_optimizer("adagrad", help="sum of squared gradients")(Adagrad)
    (tmp_path / "conf" / "optimizer").mkdir(parents=True)
    (tmp_path / "conf" / "optimizer" / "adagrad.yaml").write_text("name: adagrad\nlr: 0.05\neps: 1.0e-10\n")
    try:
        yield [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "optimizer=adagrad", "device=cpu", "progress=false"]
    finally:
        OPTIMIZERS.remove("adagrad")


def test_the_first_update_is_adagrads(adagrad: list[str]) -> None:
    cfg = compose_config([*adagrad, "optimizer.weight_decay=0.1"])
    p = Param("w", np.array([1.0, -2.0, 0.5]), np.float64)
    opt = OPTIMIZERS[cfg.optimizer.name].build(cfg.optimizer, [p])  # what build.optimizer does
    assert type(opt) is Adagrad and (opt.lr, opt.eps, opt.weight_decay) == (0.05, 1e-10, 0.1)
    p.grad = np.array([0.3, 0.0, -4.0])
    opt.step(np.array(0.05))
    g = np.array([0.3, 0.0, -4.0]) + 0.1 * np.array([1.0, -2.0, 0.5])  # L2: g + wd * p
    expected = np.array([1.0, -2.0, 0.5]) - 0.05 * g / (np.abs(g) + 1e-10)  # sqrt(sum) = |g| after one step
    np.testing.assert_allclose(p.value, expected, rtol=1e-15)
    np.testing.assert_array_equal(opt.state["w"]["sum"], g * g)


def test_a_run_trains_with_it(adagrad: list[str], tmp_path: Path) -> None:
    cfg = compose_config([*adagrad, "model.hidden=[32]", "epochs=3", "optimizer.schedule=constant"])
    summary = train(cfg, tmp_path / "run")
    epochs = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "epoch"]
    losses = [r["val/loss"] for r in epochs]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], losses
    assert summary["best"]["value"] > 0.8  # val/acc
    ckpt = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.npz")
    assert ckpt.meta["optimizer"] == "adagrad"
    sums = [k for k in ckpt.arrays if k.startswith("optim/") and k.endswith("/sum")]
    assert len(sums) == 4 and all((ckpt.arrays[k] >= 0).all() and ckpt.arrays[k].any() for k in sums)


def test_help_and_the_checks_know_it(adagrad: list[str]) -> None:
    line = next(x for x in settings_help().splitlines() if "optimizer.name =" in x)
    assert "sgd, adam, adamw or adagrad (sum of squared gradients) (optimizer=<name> selects its group)" in line
    eps = next(x for x in settings_help().splitlines() if "optimizer.eps =" in x)
    assert eps.split(maxsplit=3)[3] == "adam, adamw, adagrad: added to the denominator"
    with pytest.raises(ConfigError, match=r"optimizer\.eps=0\.0 must be positive"):
        compose_config([*adagrad, "optimizer.eps=0"])
    with pytest.raises(ConfigError, match=r"optimizer\.eps=-1 must be positive"):  # the constructor: the same words
        Adagrad([Param("w", np.zeros(2), np.float64)], lr=0.1, eps=-1)
    with pytest.raises(ConfigError, match="optimizer.momentum=0.5 is not used with optimizer=adagrad: it applies to "):
        compose_config([*adagrad, "optimizer.momentum=0.5"])
    with pytest.raises(ConfigError, match="it applies to optimizer=adam, optimizer=adamw and optimizer=adagrad"):
        compose_config(["optimizer.eps=1e-6"])  # sgd does not read eps
    compose_config([*adagrad, "optimizer.eps=1e-6", "optimizer.weight_decay=0.01"])  # what adagrad reads
    with pytest.raises(
        ConfigError, match="optimizer.name='adagrd' is unknown; expected one of sgd, adam, adamw, adagrad"
    ):
        compose_config(["optimizer.name=adagrd"])


def test_gone_once_removed() -> None:
    """The fixture takes it away again: the other tests see the built-in optimizers only."""
    assert OPTIMIZERS.names() == ("sgd", "adam", "adamw")
