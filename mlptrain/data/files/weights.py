"""The row weight column (``data.weight``): taken out of a table's features, and checked, naming its cells.

A weighted table trains on ``sum_i w_i l_i / sum_i w_i`` (:func:`mlptrain.nn.losses.row_weighted`), as
scikit-learn's ``sample_weight`` and torch's per-row weights do: an integer weight ``k`` counts as the row
repeated ``k`` times, a weight of 0 as a row left out. The column is read as the features are (a CSV's numbers,
a table's text cells, an NPZ file's ``x`` column of that name) and is never a feature: the model does not see
it, and predict and evaluate ignore it as they ignore any column the model was not trained on.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from mlptrain.base.errors import DatasetError
from mlptrain.data.files.plan import empty_cells, numbers
from mlptrain.data.files.table import Table, no_column

log = logging.getLogger(__name__)


def take_weights(table: Table, name: str, required: bool = True) -> tuple[Table, np.ndarray | None]:
    """``(table without the column name, its cells as (N,) float64 weights)``; ``table`` itself is not changed
    (a parsed table may be on its way into the cache, weight column and all).

    ``required``: a table without the column is an error (the training file); else (a test file, whose
    weights are never used) it is returned as it is, with None.

    Raises:
        DatasetError: no such column (the file's columns listed), or a cell that is not a finite number >= 0
            (its line and value named).
    """
    if table.cells is not None and name in table.cells:  # text cells (the column plan's tables)
        text = table.cells[name]
        empty = empty_cells(text)
        values = numbers(text, empty)
        if values is None:  # the first cell that is not a number
            row = next(i for i in range(len(text)) if numbers(text[i : i + 1], empty[i : i + 1]) is None)
            raise _bad(table, name, row, repr(str(text[row])))
        cells = {k: v for k, v in table.cells.items() if k != name}
        rest = [n for n in table.feature_names if n != name]
        out = dataclasses.replace(table, cells=cells, feature_names=rest)
    elif name in table.feature_names:  # a table of numbers: the column taken out of x (N, F) -> (N, F - 1)
        j = table.feature_names.index(name)
        values = np.asarray(table.x[:, j], np.float64)
        rest = table.feature_names[:j] + table.feature_names[j + 1 :]
        out = dataclasses.replace(table, x=np.delete(np.asarray(table.x), j, axis=1), feature_names=rest)
    elif required:
        raise no_column(table.path, [name], [*table.feature_names, *table.target_names], "data.weight")
    else:
        return table, None
    bad = np.flatnonzero(~(np.isfinite(values) & (values >= 0)))  # NaN: an empty cell
    if len(bad):
        raise _bad(table, name, int(bad[0]), "an empty cell" if np.isnan(values[bad[0]]) else f"{values[bad[0]]:g}")
    return out, values


def _bad(table: Table, name: str, row: int, value: str) -> DatasetError:
    return DatasetError(
        f"data file {table.path} {table.where(row)}, column {name!r} (data.weight): {value} is not a row weight; "
        "weights must be finite numbers >= 0"
    )


def training_weights(w: np.ndarray, rows: np.ndarray, name: str, path: object) -> np.ndarray:
    """The weights of the training split's ``rows`` of the file's weights ``w (N,)``.

    Raises:
        DatasetError: they sum to 0 (no training row would count).
    """
    out = w[rows]
    if not out.sum() > 0:
        raise DatasetError(
            f"data file {path}: the weights in column {name!r} (data.weight) of the {len(out)} training rows sum to 0; "
            "at least one training row must weigh more than 0"
        )
    log.info(
        "data file %s: the training loss weighs each row by column %r (data.weight): %d training rows, weights "
        "summing to %.6g, %d of them 0",
        path,
        name,
        len(out),
        out.sum(),
        int((out == 0).sum()),
    )
    return out
