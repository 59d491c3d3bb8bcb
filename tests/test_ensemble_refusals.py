"""Bad input to the many-models runs (docs/ensembles.md): each refused with one message naming the value and
what was expected, and what a run writes kept as the other outputs keep it."""

from __future__ import annotations

import pytest

from mlptrain.base.errors import ConfigError
from mlptrain.config.schema import Device, TrainConfig
from mlptrain.step.checks import check_ensemble


def make_cfg(size: int = 1, folds: int = 0) -> TrainConfig:
    cfg = TrainConfig()
    cfg.device, cfg.progress, cfg.epochs = Device.cpu, False, 1
    cfg.model.hidden = [16]
    cfg.ensemble.size, cfg.ensemble.folds = size, folds
    return cfg


@pytest.mark.parametrize("key", ["lr", "weight_decay"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_sweep_value_that_is_not_finite_is_refused_by_name(key: str, bad: float) -> None:
    cfg = make_cfg(size=2)
    setattr(cfg.ensemble, key, [0.1, bad])
    with pytest.raises(ConfigError, match=rf"ensemble.{key}=\[0.1, {bad}\]: each must be a finite number"):
        check_ensemble(cfg)
    setattr(cfg.ensemble, key, [0.1, 0.2])  # (the same list of finite values runs)
    check_ensemble(cfg)


def test_a_sweep_of_a_cross_validation_is_counted_against_its_folds() -> None:
    cfg = make_cfg(folds=3)
    cfg.ensemble.lr = [0.1, 0.2]
    with pytest.raises(ConfigError, match=r"ensemble.lr=\[0.1, 0.2\] has 2 values; .*\(ensemble.folds=3: 3 members"):
        check_ensemble(cfg)
