"""The NumPy and the Arrow reader read every file the same: one suite run against both (and Parquet).

Target cells (issue #28.3): stripped, missing values an error naming the rows (or dropped with
``data.missing=drop``), a column that mixes numbers and text refused, labels that float64 cannot
hold exactly refused; headers with spaces or a byte-order mark (#28.13, #28.17).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from mlptrain.base.errors import DatasetError
from mlptrain.config.schema import DataConfig, DatasetName, Task
from mlptrain.data import load_dataset
from mlptrain.data.files.readers import arrow_available, read_table

READERS = ["numpy", pytest.param("arrow", marks=pytest.mark.skipif(not arrow_available(), reason="no pyarrow"))]


@pytest.fixture(params=READERS)
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test of this module runs once with each CSV reader."""
    monkeypatch.setattr("mlptrain.data.files.readers.arrow_available", lambda: request.param == "arrow")
    return request.param


def csv_file(path: Path, labels: list[str], *, header: str = "f0,f1,label", bom: bool = False) -> Path:
    """A CSV of two features (row i: ``i, 2i + label_index``) and the given target cells, one row each."""
    rows = [f"{i},{(i * 7) % 5}.5,{cell}" for i, cell in enumerate(labels)]
    path.write_text(("\ufeff" if bom else "") + "\n".join([header, *rows]) + "\n", encoding="utf-8")
    return path


def dataset(path: Path, **data: Any) -> Any:
    return load_dataset(DataConfig(name=DatasetName.file, path=str(path), cache=False, **data))


def classes(n: int = 40) -> list[str]:
    return ["cat" if i % 2 else "dog" for i in range(n)]


@pytest.mark.parametrize("cell", ["", "NA", "null", "NaN", "nan", "  ", "N/A"])
def test_a_missing_label_is_an_error_naming_its_rows(tmp_path: Path, reader: str, cell: str) -> None:
    cells = classes()
    cells[3] = cells[17] = cell
    with pytest.raises(DatasetError) as err:
        dataset(csv_file(tmp_path / "d.csv", cells))
    msg = str(err.value)
    assert "d.csv lines 5 and 19: 2 of 40 rows have no target" in msg, msg
    assert "data.missing=drop" in msg, msg


def test_integer_labels_with_an_empty_cell_are_an_error_and_dropped_when_asked(
    tmp_path: Path, reader: str, caplog: pytest.LogCaptureFixture
) -> None:
    cells = [str(i % 2) for i in range(40)]
    cells[6] = ""
    path = csv_file(tmp_path / "d.csv", cells)
    with pytest.raises(DatasetError, match="line 8: 1 of 40 rows has no target"):
        dataset(path)
    with caplog.at_level(logging.WARNING, logger="mlptrain.data.user_source"):
        ds = dataset(path, missing="drop")
    assert ds.class_names == ["0", "1"]  # integer classes, not the text classes '', '0', '1'
    assert len(ds.x_train) + len(ds.x_val) + len(ds.x_test) == 39
    assert "1 of 40 rows dropped, line 8: no target (data.missing=drop)" in caplog.text, caplog.text


def test_labels_are_stripped_by_both_readers(tmp_path: Path, reader: str) -> None:
    cells = [" a" if i % 3 == 0 else "a" if i % 3 == 1 else '"b "' for i in range(30)]
    table, _ = read_table(csv_file(tmp_path / "d.csv", cells), "label")
    assert table.y.tolist() == ["a" if i % 3 < 2 else "b" for i in range(30)]
    assert dataset(tmp_path / "d.csv").class_names == ["a", "b"]


def test_a_target_mixing_numbers_and_text_is_an_error_not_a_task_change(tmp_path: Path, reader: str) -> None:
    cells = [f"{v:.3f}" for v in np.linspace(0, 10, 60)]
    cells[9] = "abc"
    path = csv_file(tmp_path / "d.csv", cells)
    for target in ("label", ["label"]):  # data.target=[y] model.loss=mse trained a 60-class classification
        with pytest.raises(DatasetError) as err:
            dataset(path, target=target)
        msg = str(err.value)
        assert "d.csv line 11, column 'label': 'abc' is one of 1 cells of text in a column of numbers" in msg, msg
    cells = ["cat" if i % 2 else "dog" for i in range(40)]
    cells[5] = cells[8] = "7"
    with pytest.raises(DatasetError, match="line 7, column 'label': '7' is one of 2 cells of numbers in a column"):
        dataset(csv_file(tmp_path / "e.csv", cells))


def test_labels_float64_cannot_hold_exactly_are_refused(tmp_path: Path, reader: str) -> None:
    cells = ["1e20" if i % 2 else "0" for i in range(40)]
    with pytest.raises(DatasetError) as err:
        dataset(csv_file(tmp_path / "d.csv", cells))
    assert "line 3, column 'label': label 1e+20 is not a whole number that float64 holds exactly" in str(err.value)
    big = [str(2**53 + i % 2) for i in range(40)]  # 9007199254740992 and ...993: two classes, not merged
    ds = dataset(csv_file(tmp_path / "e.csv", big))
    assert ds.class_names == [str(2**53), str(2**53 + 1)]
    assert 0 < np.sum(ds.y_train == 0) < len(ds.y_train)


def test_a_header_with_spaces_or_a_byte_order_mark_names_the_same_columns(tmp_path: Path, reader: str) -> None:
    cells = classes()
    plain, _ = read_table(csv_file(tmp_path / "a.csv", cells), "label")
    for name, kw in (("b.csv", {"header": "f0, f1, label"}), ("c.csv", {"header": "label,f0,f1", "bom": True})):
        path = tmp_path / name
        if kw.get("bom"):
            rows = [f"{cell},{i},{(i * 7) % 5}.5" for i, cell in enumerate(cells)]
            path.write_text("\ufeff" + "\n".join(["label,f0,f1", *rows]) + "\n", encoding="utf-8")
        else:
            csv_file(path, cells, **kw)
        table, _ = read_table(path, "label")
        assert table.feature_names == ["f0", "f1"] and table.target_names == ["label"]
        assert_array_equal(table.x, plain.x)
        assert_array_equal(table.y, plain.y)


def test_both_readers_give_the_same_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not arrow_available():
        pytest.skip("no pyarrow")
    cells = [" 3", "4 ", "3", "12", '"4"', "12"] * 5
    path = csv_file(tmp_path / "d.csv", cells)
    tables = [read_table(path, "label", reader=r)[0] for r in ("numpy", "arrow")]
    assert tables[0].y.dtype == tables[1].y.dtype == np.int64
    assert_array_equal(tables[0].y, tables[1].y)
    assert_array_equal(tables[0].x, tables[1].x)


# --- Parquet: typed columns, nulls ------------------------------------------------------------------


@pytest.mark.skipif(not arrow_available(), reason="no pyarrow")
@pytest.mark.parametrize("kind", ["text", "integer", "float"])
def test_a_parquet_null_or_nan_label_is_an_error_not_a_class(tmp_path: Path, kind: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    values: list[Any] = {"text": ["cat", "dog"], "integer": [0, 1], "float": [0.0, 1.0]}[kind] * 20
    values[4] = None
    if kind == "float":
        values[9] = float("nan")
    pq.write_table(pa.table({"f0": np.arange(40.0), "label": values}), tmp_path / "d.parquet")
    with pytest.raises(DatasetError) as err:
        dataset(tmp_path / "d.parquet")
    rows = "rows 4 and 9: 2 of 40 rows have" if kind == "float" else "row 4: 1 of 40 rows has"
    assert f"d.parquet {rows} no target" in str(err.value), str(err.value)
    ds = dataset(tmp_path / "d.parquet", missing="drop", task=Task.classification)
    assert len(ds.class_names or []) == 2


@pytest.mark.skipif(not arrow_available(), reason="no pyarrow")
def test_a_parquet_file_with_a_column_twice_is_one_line(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pa.table([pa.array(np.arange(4.0)), pa.array(np.arange(4.0)), pa.array([0, 1, 0, 1])], names=["a", "a", "y"])
    pq.write_table(t, tmp_path / "d.parquet")
    with pytest.raises(DatasetError) as err:
        read_table(tmp_path / "d.parquet", "y")
    assert (
        str(err.value) == f"data file {tmp_path / 'd.parquet'} has the column 'a' more than once; the column names "
        "must be unique"
    )
