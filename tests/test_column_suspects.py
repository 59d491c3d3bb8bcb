"""Columns that look like a row's name rather than a feature (mlptrain.data.files.plan.suspect_columns): an id or
row counter among the numbers, free text among the categories; one warning naming them, and data.drop's fix."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlptrain.config.schema import DataConfig, DatasetName
from mlptrain.data import load_dataset
from mlptrain.data.files.plan import SUSPECT_MIN_ROWS, Column, ColumnPlan, suspect_columns


def test_a_rising_whole_number_on_every_row_is_named_and_nothing_else_is() -> None:
    rng = np.random.default_rng(0)
    n = 50
    x = np.stack(
        [
            np.arange(7, 7 + 3 * n, 3),  # an id: whole, different, rising (steps need not be 1)
            np.arange(n) + 0.5,  # rising but not whole: a measurement
            rng.integers(18, 80, n),  # whole, repeats: an age
            np.sort(rng.permutation(1000)[:n])[::-1],  # whole, different, falling: not a counter
            np.r_[np.arange(n - 1), n - 2],  # whole, rising but for one repeat at the end
            np.r_[np.arange(n - 1), np.nan],  # an id with an empty cell: not said
        ],
        axis=1,
    ).astype(np.float64)
    names = ["id", "half", "age", "falling", "repeat", "gap"]
    assert suspect_columns(x, names, None, n) == {"id": "a different whole number on every row, rising down the file"}
    assert suspect_columns(x[: SUSPECT_MIN_ROWS - 1], names, None, n) == {}  # too short to tell
    assert suspect_columns(x[::-1].copy(), names, None, n) == {
        "falling": "a different whole number on every row, rising down the file"
    }


def test_a_category_of_as_many_levels_as_half_the_training_rows_is_named() -> None:
    plan = ColumnPlan(
        [
            Column("note", "categorical", levels=[f"t{i}" for i in range(30)], rare=[f"r{i}" for i in range(20)]),
            Column("city", "categorical", levels=[f"c{i}" for i in range(49)]),
            Column("x", "numeric"),
        ]
    )
    x = np.zeros((100, 1))
    assert suspect_columns(x, ["x"], plan, 100) == {"note": "50 levels in 100 training rows"}  # rare ones count too
    assert suspect_columns(x, ["x"], plan, 98) == {
        "note": "50 levels in 98 training rows",
        "city": "49 levels in 98 training rows",
    }
    assert suspect_columns(x, ["x"], plan, SUSPECT_MIN_ROWS - 1) == {}


def write(path: Path, n: int = 120) -> None:
    rng = np.random.default_rng(1)
    rows = [["row", "age", "city", "comment", "label"]]
    for i in range(n):
        city = str(rng.choice(["Paris", "Rome", ""]))
        rows.append([str(i + 1), str(int(rng.integers(18, 80))), city, f"said {i}: fine", str(int(rng.random() < 0.3))])
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


def data_cfg(path: Path, **kw: Any) -> DataConfig:
    return DataConfig(name=DatasetName.file, path=str(path), target="label", cache=False, features=None, **kw)


def test_a_table_warns_once_naming_its_id_and_free_text_and_data_drop_silences_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path / "t.csv")
    with caplog.at_level(logging.WARNING, logger="mlptrain.data.files.plan"):
        ds = load_dataset(data_cfg(tmp_path / "t.csv"))
    said = [r.getMessage() for r in caplog.records if "row counter" in r.getMessage()]
    assert len(said) == 1
    assert (
        f"data file {tmp_path / 't.csv'}: 'row' (a different whole number on every row, rising down the file)"
        in said[0]
    )
    assert "'comment' (" in said[0] and "data.drop=[row,comment] leaves them out" in said[0]
    assert "'age'" not in said[0] and "'city'" not in said[0]
    assert ds.feature_names is not None and "row" in ds.feature_names  # a warning only: the user decides
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlptrain.data.files.plan"):
        load_dataset(data_cfg(tmp_path / "t.csv", drop=["row", "comment"]))
    assert not [r for r in caplog.records if "row counter" in r.getMessage()]


def test_a_table_of_numbers_is_checked_too(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(2)
    with open(tmp_path / "n.csv", "w", newline="") as f:
        csv.writer(f).writerows([["a", "id", "label"], *[[rng.normal(), 100 + i, i % 2] for i in range(60)]])
    with caplog.at_level(logging.WARNING, logger="mlptrain.data.files.plan"):
        ds = load_dataset(data_cfg(tmp_path / "n.csv"))
    assert ds.columns is None
    said = [r.getMessage() for r in caplog.records if "row counter" in r.getMessage()]
    assert len(said) == 1 and "'id' (a different whole number" in said[0] and "data.drop=[id] leaves it out" in said[0]
