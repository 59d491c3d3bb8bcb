"""data=file targets: the task data.task=auto decides, and where it refuses as ambiguous; data.weight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import make_cfg

from mlptrain.base.errors import ConfigError, DatasetError
from mlptrain.config.schema import DataConfig, DatasetName, Task
from mlptrain.data import load_dataset
from mlptrain.data.prepare import task_for_loss
from mlptrain.run.run import train


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLPTRAIN_DATA", str(tmp_path / "cache"))


def _csv(path: Path, x: np.ndarray, y: np.ndarray, extra: dict[str, list[str]] | None = None) -> Path:
    extra = extra or {}
    head = [f"f{j}" for j in range(x.shape[1])] + list(extra) + ["y"]
    lines = [",".join(head)]
    for i, (r, t) in enumerate(zip(x.tolist(), y.tolist(), strict=True)):
        lines.append(",".join([*(repr(v) for v in r), *(col[i] for col in extra.values()), str(t)]))
    path.write_text("\n".join(lines) + "\n")
    return path


def _cfg(path: Path, **kw: object) -> DataConfig:
    return DataConfig(name=DatasetName.file, path=str(path), target="y", **kw)  # type: ignore[arg-type]


def test_a_whole_number_target_with_many_values_is_refused_as_ambiguous(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((442, 3))
    y = rng.integers(25, 346, 442)  # diabetes-like: a quantity in whole numbers
    values = len(np.unique(y))
    path = _csv(tmp_path / "d.csv", x, y)
    with pytest.raises(DatasetError) as e:
        load_dataset(_cfg(path))
    assert str(e.value) == (
        f"data file {path}: the target column 'y' holds {values} distinct whole numbers in 442 rows "
        f"({442 / values:.1f} rows a value), which reads as a quantity as well as as classes; set data.task=regression "
        "with model.loss=mse (or model.loss=mse alone), or data.task=classification"
    )
    assert load_dataset(_cfg(path, task=Task.regression)).task == "regression"
    assert load_dataset(task_for_loss(_cfg(path), "mse")).task == "regression"  # a regression loss decides
    ds = load_dataset(_cfg(path, task=Task.classification))
    assert ds.task == "classification" and ds.num_classes == values


def test_many_classes_with_enough_rows_each_stay_classes(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    y = np.repeat(np.arange(30), 12)  # 30 classes of 12 rows: more than 10 rows a value
    path = _csv(tmp_path / "c.csv", rng.standard_normal((len(y), 3)), y)
    ds = load_dataset(_cfg(path))
    assert ds.task == "classification" and ds.num_classes == 30
    y = np.repeat(np.arange(20), 3)  # 20 values, 3 rows each: few values, still classes
    assert load_dataset(_cfg(_csv(tmp_path / "s.csv", rng.standard_normal((60, 3)), y))).task == "classification"


def test_text_labels_with_many_values_stay_classes(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    y = np.asarray([f"c{i % 40}" for i in range(120)])  # 40 names, 3 rows each: text is never a quantity
    ds = load_dataset(_cfg(_csv(tmp_path / "t.csv", rng.standard_normal((120, 3)), y)))
    assert ds.task == "classification" and ds.num_classes == 40


def test_a_fractional_target_with_the_default_loss_is_one_clear_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((80, 3))
    path = _csv(tmp_path / "f.csv", x, x[:, 0] * 2.5 + 0.25)
    cfg = make_cfg(epochs=1)
    cfg.data.name, cfg.data.path, cfg.data.target = DatasetName.file, str(path), "y"
    with pytest.raises(ConfigError, match=r"dataset 'file' is a regression \(targets y\) but model.loss=cross_entropy"):
        train(cfg, tmp_path / "run")
