"""#49: the exports of a model trained through a column plan (text, empty cells). ONNX takes the raw columns (one
input per column: text for a categorical one, double with NaN for a numeric one) and scores them as ``python -m
mlptrain.predict`` does; safetensors carries the plan as JSON beside the weights."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_cfg
from numpy.testing import assert_allclose, assert_array_equal
from test_column_plan import HEADER, data_cfg, make_table

from mlptrain.base.errors import ConfigError, OutputError
from mlptrain.cli import predict as predict_cli
from mlptrain.cli.export import ExportArgs, export, load_safetensors
from mlptrain.data.files.plan import ColumnPlan
from mlptrain.inference.onnx_columns import feeds, spellings
from mlptrain.inference.predictor import Predictor
from mlptrain.run.run import train

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
pd = pytest.importorskip("pandas")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CLI run on a table of every column kind: integer codes one-hot (data.categorical), a rare level grouped."""
    d = tmp_path_factory.mktemp("columns")
    make_table(d / "train.csv", n=400, seed=0)
    cfg = make_cfg(epochs=3, model__hidden=[16])
    cfg.data = data_cfg(d / "train.csv", drop=["id"], categorical=["code"], min_frequency=12)
    train(cfg, d / "run")
    return d / "run" / "checkpoints" / "best.npz"


def raw_rows(path: Path) -> Any:
    """Test rows as a file holds them: columns reordered, an extra one, unseen levels, empty cells spelt three
    ways, a rare level, an integer code written ``10.0``."""
    rows = make_table(path.with_name("rows.csv"), n=60, seed=1)
    order = ["extra", "code", "region", "student", "income", "age", "label", "id"]
    raw = [dict(zip(HEADER, r, strict=True), extra="zzz") for r in rows]
    raw[0]["region"], raw[1]["student"], raw[2]["code"] = "mars", "Maybe", "7"  # never seen in training
    raw[3]["age"], raw[4]["region"], raw[5]["student"], raw[6]["income"] = "", "NA", "", "nan"  # empty cells
    raw[7]["region"], raw[8]["code"] = "polar", "10.0"  # the rare level; a whole number as 10.0
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([order, *[[r[k] for k in order] for r in raw]])
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def test_onnx_on_raw_columns_equals_predict_on_the_same_rows(ckpt: Path, tmp_path: Path) -> None:
    frame = raw_rows(tmp_path / "raw.csv")
    out = export(ExportArgs(ckpt=str(ckpt), format="onnx", output=str(tmp_path / "m.onnx")))
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    p = Predictor(ckpt, device="cpu")
    assert p.plan is not None and p.plan.columns[3].rare == ["polar"]  # region: a level grouped
    kinds = {i.name: i.type for i in sess.get_inputs()}
    assert kinds == {
        "age": "tensor(double)",
        "income": "tensor(double)",
        "student": "tensor(string)",
        "region": "tensor(string)",
        "code": "tensor(string)",
    }
    logits, probabilities, class_id = sess.run(["logits", "probabilities", "class_id"], feeds(p.plan, frame))
    argv = [f"ckpt={ckpt}", f"input={tmp_path / 'raw.csv'}", f"output={tmp_path / 'pred.npz'}", "probabilities=true"]
    assert predict_cli.main([*argv, "device=cpu"]) == 0  # python -m mlptrain.predict
    with np.load(tmp_path / "pred.npz") as cli:
        assert_allclose(probabilities, cli["probabilities"], rtol=0, atol=1e-5)
        assert_array_equal(class_id, cli["class_id"])
    assert_allclose(logits, p.logits(p.encode(cells_of(frame, p.plan), "raw", str)), rtol=0, atol=1e-5)


def cells_of(frame: Any, plan: ColumnPlan) -> dict[str, np.ndarray]:
    return {c: np.char.strip(frame[c].to_numpy().astype(str)) for c in plan.names}


def test_the_onnx_encoding_is_the_plans_cell_for_cell(ckpt: Path, tmp_path: Path) -> None:
    """The graph's encoded inputs (x64, before the normalisation) against ColumnPlan.encode on the same cells:
    unknown levels all zeros, every empty spelling the <empty> level, NaN filled with the median."""
    import onnx

    out = export(ExportArgs(ckpt=str(ckpt), format="onnx", output=str(tmp_path / "m.onnx")))
    model = onnx.load(str(out))
    model.graph.output.insert(0, onnx.helper.make_tensor_value_info("x64", onnx.TensorProto.DOUBLE, None))
    p = Predictor(ckpt, device="cpu")
    assert p.plan is not None
    rows = {
        "age": ["41.5", "", "NaN", "null", "30"],
        "income": ["1000", "nan", "", "2e4", "N/A"],
        "student": ["Yes", "No", "", "NA", "maybe"],
        "region": ["east", "polar", "<NA>", "mars", "None"],
        "code": ["1", "2.0", "30", "", "4"],
    }
    frame = pd.DataFrame(rows)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (x64,) = sess.run(["x64"], feeds(p.plan, frame))
    want, unknown = p.plan.encode({k: np.asarray(v) for k, v in rows.items()}, str, "rows")
    assert unknown == {"student": 3, "region": 1, "code": 2}  # maybe, mars, 4, and empty cells where none were
    assert_allclose(x64, want, rtol=0, atol=0)


def test_the_numeric_export_keeps_one_float_input_and_spellings_are_the_plans() -> None:
    assert spellings("<empty>")[:2] == ["", "#N/A"] and "nan" in spellings("<empty>")
    assert spellings("3") == ["3", "3.0"] and spellings("2.5") == ["2.5"] and spellings("Yes") == ["Yes"]


def test_safetensors_writes_the_plan_beside_the_weights(ckpt: Path, tmp_path: Path) -> None:
    out = export(ExportArgs(ckpt=str(ckpt), format="safetensors", output=str(tmp_path / "m.safetensors")))
    tensors, meta = load_safetensors(out)
    info = json.loads(meta["mlptrain"])
    plan = ColumnPlan.from_meta(info["column_plan"])
    p = Predictor(ckpt, device="cpu")
    assert plan == p.plan and info["feature_names"] == plan.feature_names  # type: ignore[union-attr]
    side = json.loads((tmp_path / "m.columns.json").read_text())  # the same plan, a file of its own
    assert side["columns"] == info["column_plan"]["columns"] and side["feature_names"] == plan.feature_names  # type: ignore[union-attr]
    export(ExportArgs(ckpt=str(ckpt), format="safetensors", output=str(out)))  # exporting again replaces both
    (tmp_path / "m.columns.json").write_text("{}")
    with pytest.raises(OutputError, match="m.columns.json"):  # a file that is not a plan of ours is kept
        export(ExportArgs(ckpt=str(ckpt), format="safetensors", output=str(out)))
    assert tensors["0.weight"].shape == (16, len(plan.feature_names))  # type: ignore[union-attr]


def test_a_column_named_as_a_tensor_of_the_graph_is_refused(ckpt: Path, tmp_path: Path) -> None:
    p = Predictor(ckpt, device="cpu")
    assert p.plan is not None
    p.plan.columns[0].name = "logits"
    from mlptrain.cli.export import onnx_model

    with pytest.raises(ConfigError, match=r"the column\(s\) \['logits'\] have the name of a tensor"):
        onnx_model(p)


def test_an_estimator_fitted_on_a_dataframe_exports_onnx_that_scores_the_frame(tmp_path: Path) -> None:
    """The scikit-learn estimator's plan (a DataFrame with category, text, integer-coded and NaN columns) through
    save and the ONNX export: ONNX Runtime on the raw frame equals predict_proba."""
    from test_sklearn_frames import fitted, table

    frame, y = table(200)
    clf = fitted(frame, y, max_iter=3)
    out = export(ExportArgs(ckpt=str(clf.save(tmp_path / "m.npz")), format="onnx", output=str(tmp_path / "m.onnx")))
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    new, _ = table(50, seed=7)
    new.loc[0, "city"], new.loc[1, "income"] = "lima", np.nan
    (probabilities,) = sess.run(["probabilities"], feeds(clf.column_plan_, new[list(reversed(new.columns))]))
    assert_allclose(probabilities, clf.predict_proba(new), rtol=0, atol=1e-5)
