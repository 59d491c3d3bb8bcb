"""The column plan as ONNX nodes: raw columns in, the model's encoded inputs out (``python -m mlptrain.export``).

An exported model of a table with a column plan (:mod:`mlptrain.data.files.plan`) takes one graph input per
raw column, named as the column, and encodes them inside the graph as :meth:`ColumnPlan.encode` does::

    numeric      x (N,) double, NaN = an empty cell
                   empty = IsNaN(x)
                   Where(empty, fill, x) -> (N, 1)            the training median in the empty cells
                   Cast(empty, double)   -> (N, 1)            the <name>_missing column (where the plan has one)
    categorical  x (N,) string
                   code = ai.onnx.ml.LabelEncoder(x)          each level's spellings -> its index 0..L-1, a rare
                                                              level -> L (the <rare> column), anything else -1
                   Cast(Equal(Unsqueeze(code) (N, 1), [0 .. L'-1] (L',)), double) -> (N, L')
                                                              one-hot; an unknown level (-1) is all zeros
    Concat(axis=1) of the parts, in the plan's order         -> x64 (N, F) double, then the normalisation

A level's spellings are the text the plan would read as it: the level itself; a whole number's ``3`` and
``3.0``; the empty level ``<empty>``: every spelling of an empty cell (:data:`labels.MISSING`: ``""``, ``NA``,
``nan``, ``None`` ...). The graph matches text exactly: cells are stripped of spaces by ``predict`` and must
come stripped here (ONNX's opset 17 has no string strip).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlptrain.base.errors import DatasetError
from mlptrain.data.files.labels import MISSING
from mlptrain.data.files.plan import EMPTY, Column, ColumnPlan, empty_cells, numbers

ML_DOMAIN = "ai.onnx.ml"
ML_OPSET = 2  # LabelEncoder with string keys and int64 values


def spellings(level: str) -> list[str]:
    """The stripped cells the plan reads as ``level`` (see the module)."""
    if level == EMPTY:
        return list(MISSING)
    try:
        whole = float(level).is_integer() and str(int(float(level))) == level
    except ValueError:
        whole = False
    return [level, f"{level}.0"] if whole else [level]


def codes(col: Column) -> tuple[list[str], list[int]]:
    """The LabelEncoder's keys and values of a categorical column: each spelling of each level -> its one-hot
    index; the rare levels' -> the ``<rare>`` column's index (``len(col.levels)``)."""
    keys: list[str] = []
    values: list[int] = []
    groups = [(lv, i) for i, lv in enumerate(col.levels)] + [(lv, len(col.levels)) for lv in col.rare]
    for level, index in groups:
        for s in spellings(level):
            if s not in keys:
                keys.append(s)
                values.append(index)
    return keys, values


def plan_graph(plan: ColumnPlan, out: str) -> tuple[list[Any], list[Any], list[Any]]:
    """``(inputs, nodes, initializers)``: one input per raw column of ``plan``, and the nodes that encode them
    into ``out`` ``(N, F)`` double (see the module)."""
    from onnx import TensorProto, helper, numpy_helper

    inputs, nodes, parts = [], [], []
    inits = [numpy_helper.from_array(np.array([1], np.int64), "plan_axis1")]
    for j, col in enumerate(plan.columns):
        t = f"plan{j}_"  # internal names: a column's own name is its input's only
        if col.kind == "numeric":
            inputs.append(helper.make_tensor_value_info(col.name, TensorProto.DOUBLE, ["N"]))
            inits.append(numpy_helper.from_array(np.array(col.fill, np.float64), t + "fill"))
            nodes += [
                helper.make_node("Unsqueeze", [col.name, "plan_axis1"], [t + "x"]),  # (N, 1)
                helper.make_node("IsNaN", [t + "x"], [t + "empty"]),
                helper.make_node("Where", [t + "empty", t + "fill", t + "x"], [t + "filled"]),
            ]
            parts.append(t + "filled")
            if col.indicator:
                nodes.append(helper.make_node("Cast", [t + "empty"], [t + "missing"], to=TensorProto.DOUBLE))
                parts.append(t + "missing")
            continue
        inputs.append(helper.make_tensor_value_info(col.name, TensorProto.STRING, ["N"]))
        keys, values = codes(col)
        width = len(col.levels) + (1 if col.rare else 0)  # the one-hot columns, <rare> last
        inits.append(numpy_helper.from_array(np.arange(width, dtype=np.int64), t + "index"))
        nodes += [
            helper.make_node(
                "LabelEncoder",
                [col.name],
                [t + "code"],
                domain=ML_DOMAIN,
                keys_strings=keys,
                values_int64s=values,
                default_int64=-1,  # a level never seen in training: no column
            ),
            helper.make_node("Unsqueeze", [t + "code", "plan_axis1"], [t + "code2"]),  # (N, 1)
            helper.make_node("Equal", [t + "code2", t + "index"], [t + "hot"]),  # (N, 1) == (L',) -> (N, L')
            helper.make_node("Cast", [t + "hot"], [t + "onehot"], to=TensorProto.DOUBLE),
        ]
        parts.append(t + "onehot")
    nodes.append(helper.make_node("Concat", parts, [out], axis=1))  # (N, F) in the plan's feature order
    return inputs, nodes, inits


def feeds(plan: ColumnPlan, frame: Any) -> dict[str, np.ndarray]:
    """The graph's inputs from a DataFrame of raw rows (any column order, extra columns left out): numeric columns
    as float64 (empty cells NaN), categorical ones as stripped text (empty cells ``""``)."""
    out = {}
    for col in plan.columns:
        cells = frame[col.name]
        text = np.where(cells.isna().to_numpy(), "", np.char.strip(cells.astype(object).to_numpy().astype(str)))
        if col.kind == "categorical":
            out[col.name] = text
            continue
        values = numbers(text, empty_cells(text))
        if values is None:
            raise DatasetError(f"column {col.name!r} holds text; the model's plan has it numeric")
        out[col.name] = values
    return out
