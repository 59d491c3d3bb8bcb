"""``python -m mlptrain.export ckpt=PATH format=safetensors|onnx output=FILE``: the model for other tools.

**safetensors** (written here, no dependency; the format is an 8-byte little-endian header length,
a JSON header naming each tensor's dtype, shape and byte range, then the bytes): the parameters
under the names and layout of PyTorch's ``nn.Sequential(Linear, ReLU, ..., Linear)`` state dict
(``0.weight`` ``(out, in)``, ``0.bias``, ``2.weight`` ...; without ReLU the indices run 0, 1, 2),
so that ``model.load_state_dict(safetensors.torch.load_file(path))`` works. The header's
``__metadata__`` holds what scoring raw inputs needs besides (:func:`preprocessing`, as JSON
under ``mlptrain``): the widths, the normalisation ``(x - shift) / scale`` (``data.normalize=quantile``: the
quantile table, its columns mapped first), the feature, class
and target names, and for a regression its ``target_scaling`` (the network's output ``z`` is in
standardised units: ``y = z * scale + shift``).

**ONNX** (the ``onnx`` extra): the whole inference path as one graph, normalisation included::

    x (N, F) float32 -> (float64) Sub(shift), Mul(1/scale) -> float32
        -> [Gemm(W^T, b) -> Relu] ... -> Gemm -> logits (N, C)
    classification: probabilities = Softmax(logits), class_id = ArgMax(logits) (int64)
    regression: ... -> Gemm -> Mul(target_scale) -> Add(target_shift) -> logits (N, T), in the targets' units

with the same float32 arithmetic as :class:`mlptrain.inference.predictor.Predictor` on the CPU, so
ONNX Runtime gives the same predictions (tests/test_export.py). ``data.normalize=robust`` is the same Sub and
Mul; a ``data.normalize=quantile`` model is refused (one ConfigError): its per-column quantile map is not in the
graph.

**A model with a column plan** (a table with text or empty cells, :mod:`mlptrain.data.files.plan`): the ONNX
graph takes the raw columns instead of ``x``, one input per column named as it, ``(N,)`` each (a categorical
column ``tensor(string)``, a numeric one ``tensor(double)`` with NaN for an empty cell), and encodes them as
``predict`` does before the normalisation (:mod:`mlptrain.inference.onnx_columns`: median fill and
``_missing`` indicator, one-hot of the training levels, unseen levels all zeros, rare levels grouped)::

    age (N,) double, region (N,) string, ... -> [plan] -> x64 (N, F) double -> Sub(shift), Mul(1/scale) -> ...

The safetensors weights take the encoded features (``feature_names``), and the plan is written beside them
as JSON, ``<name>.columns.json`` (:func:`plan_path`; also ``column_plan`` in the metadata), to encode raw
rows with (tests/test_export_columns.py).

The output ends in ``.<format>`` (default: ``<run dir>/<checkpoint name>.<format>``); it never
replaces the checkpoint, another checkpoint or anything in ``checkpoints/``, and an existing file
only when it is an export of mlptrain (or with ``overwrite=true``): :mod:`mlptrain.inference.outputs`.
"""

from __future__ import annotations

import json
import logging
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.base.errors import ConfigError, OutputError
from mlptrain.cli import commands
from mlptrain.cli.commands import REQUIRED, arg
from mlptrain.inference import onnx_columns, outputs
from mlptrain.inference.predictor import Predictor
from mlptrain.run.checkpoint import CHECKPOINT_DIR

FORMATS = ("safetensors", "onnx")
DTYPES = {"fp32": np.float32, "fp16": np.float16}
_ST_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64", "int64": "I64"}
ONNX_OPSET = 17
PLAN_FORMAT = "mlptrain-column-plan"  # the "format" of a safetensors export's <name>.columns.json

log = logging.getLogger(__name__)


@dataclass
class ExportArgs:
    ckpt: str = arg(REQUIRED, "a checkpoint (.npz), or a run directory (its checkpoints/best.npz)")
    format: str = arg(
        REQUIRED,
        "safetensors (PyTorch nn.Sequential names; a column plan beside, as <name>.columns.json) or onnx "
        "(normalisation included; a table with a column plan: one input per raw column)",
    )
    output: str | None = arg(None, "the file to write (.<format>); null: <run dir>/<checkpoint name>.<format>")
    dtype: str = arg("fp32", "safetensors: the parameters' dtype, fp32 or fp16 (ONNX: fp32)")
    overwrite: bool = arg(False, "replace an existing output that is not an mlptrain export (never a checkpoint)")


def sequential_state_dict(p: Predictor, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """The parameters as ``nn.Sequential(Linear, ReLU, ..., Linear).state_dict()`` names them
    (``nn.GELU(approximate="tanh")`` in place of ReLU for a GELU model)."""
    step = 2 if _activation(p) != "none" else 1  # Linear, ReLU, Linear, ...: every other module is a Linear
    out = {}
    members = p.model.members  # an ensemble: nn.ModuleList of K such Sequentials, member k's names under "k."
    for i, layer in enumerate(p.model.layers):
        # W (out, in) and b (out,): the layout of torch.nn.Linear (an ensemble's: (K, out, in), (K, out))
        w, b = (np.ascontiguousarray(p.backend.to_host(t.value), dtype=dtype) for t in (layer.weight, layer.bias))
        for k in range(members):
            prefix = f"{k}." if members > 1 else ""
            out[f"{prefix}{step * i}.weight"], out[f"{prefix}{step * i}.bias"] = (w[k], b[k]) if members > 1 else (w, b)
    return out


def _activation(p: Predictor) -> str:
    """The hidden layers' activation: relu, gelu or none."""
    return p.model.layers[0].activation if len(p.model.layers) > 1 else "none"


def _onnx_gelu(z: str, out: str, i: int) -> list[Any]:
    """GELU's tanh form as basic ONNX operators (``Gelu`` needs opset 20):
    ``0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))``, with the constants as ``gelu_*`` initializers."""
    from onnx import helper

    t = f"gelu{i}_"
    return [
        helper.make_node("Mul", [z, z], [t + "z2"]),
        helper.make_node("Mul", [t + "z2", z], [t + "z3"]),
        helper.make_node("Mul", [t + "z3", "gelu_k"], [t + "kz3"]),
        helper.make_node("Add", [z, t + "kz3"], [t + "inner"]),
        helper.make_node("Mul", [t + "inner", "gelu_c"], [t + "u"]),
        helper.make_node("Tanh", [t + "u"], [t + "t"]),
        helper.make_node("Add", [t + "t", "gelu_one"], [t + "1pt"]),
        helper.make_node("Mul", [z, t + "1pt"], [t + "z1pt"]),
        helper.make_node("Mul", [t + "z1pt", "gelu_half"], [out]),
    ]


def preprocessing(p: Predictor) -> dict[str, Any]:
    """What scoring raw inputs needs besides the parameters, as JSON-ready values."""
    return {
        "format": "mlptrain-model",
        "widths": p.widths,
        "members": p.model.members,  # > 1: an ensemble, which predicts its members' mean (docs/ensembles.md)
        "activation": _activation(p),  # gelu: the tanh form, nn.GELU(approximate="tanh")
        "task": p.task,
        "normalization": _normalization(p),
        "feature_names": p.feature_names,
        "class_names": p.class_names,
        "target_names": p.target_names,
        **_target_scaling(p),
        **_column_plan(p),
        "checkpoint": str(p.path),
    }


def _normalization(p: Predictor) -> dict[str, Any]:
    """``(x - shift) / scale``; a ``data.normalize=quantile`` model maps some columns first (``quantile``: each
    mapped column's index and its ``Q`` ascending training quantiles, at ``linspace(0, 1, Q)``)."""
    out: dict[str, Any] = {"method": p.normalization.method, "shift": p.shift.tolist(), "scale": p.scale.tolist()}
    q = p.normalization.quantile
    if q is None:
        return {**out, "formula": "(x - shift) / scale"}
    out["formula"] = "(quantile(x) - shift) / scale"
    out["quantile"] = {
        "columns": q.columns.tolist(),
        "quantiles": q.quantiles.T.tolist(),  # (K, Q): one list per mapped column
        "formula": (
            "u = (interp(x, q, r) - interp(-x, -q[::-1], -r[::-1])) / 2 with r = linspace(0, 1, Q); u = 1 where "
            "x + 1e-7 > q[-1], then u = 0 where x - 1e-7 < q[0]; quantile(x) = clip(ndtri(u), ndtri(1e-7 - eps), "
            "ndtri(1 - (1e-7 - eps))): scikit-learn's QuantileTransformer(output_distribution='normal')"
        ),
    }
    return out


def _column_plan(p: Predictor) -> dict[str, Any]:
    """A model trained through a column plan: the plan (what raw columns become ``feature_names``). The ONNX
    graph encodes raw columns by it; the safetensors weights take the encoded features (the plan is also
    written beside them, :func:`plan_path`)."""
    return {} if p.plan is None else {"column_plan": p.plan.to_meta()}


def _target_scaling(p: Predictor) -> dict[str, Any]:
    """A regression's ``target_scaling``: how the network's outputs become the targets' units."""
    if p.classification:
        return {}
    t = p.targets
    formula = "y = output * scale + shift"
    return {
        "target_scaling": {"method": t.method, "shift": t.shift.tolist(), "scale": t.scale.tolist(), "formula": formula}
    }


def _onnx_target_units(p: Predictor, z: str) -> tuple[list[Any], list[Any]]:
    """``(nodes, initializers)``: a regression's ``logits = z * target_scale + target_shift`` (N, T), float32
    as :class:`~mlptrain.inference.predictor.Predictor` computes it."""
    from onnx import helper, numpy_helper

    t = p.targets
    inits = [
        numpy_helper.from_array(a.astype(np.float32), name)
        for name, a in (("target_scale", t.scale), ("target_shift", t.shift))
    ]
    nodes = [helper.make_node("Mul", [z, "target_scale"], ["z_scaled"])]
    nodes.append(helper.make_node("Add", ["z_scaled", "target_shift"], ["logits"]))
    return nodes, inits


def _onnx_member_mean(classification: bool) -> tuple[list[Any], list[Any]]:
    """``member_z (K, N, C)`` -> the ensemble's ``logits``: the log of the members' mean probability (as
    :func:`mlptrain.nn.members.ensemble_logits`, the smallest float32 for a probability of 0); a regression's
    ``z_out``, the mean output."""
    from onnx import helper, numpy_helper

    if not classification:
        return [helper.make_node("ReduceMean", ["member_z"], ["z_out"], axes=[0], keepdims=0)], []
    tiny = numpy_helper.from_array(np.array(np.finfo(np.float32).tiny, np.float32), "tiny")
    nodes = [
        helper.make_node("Softmax", ["member_z"], ["member_p"], axis=2),
        helper.make_node("ReduceMean", ["member_p"], ["mean_p"], axes=[0], keepdims=0),
        helper.make_node("Max", ["mean_p", "tiny"], ["mean_p_kept"]),
        helper.make_node("Log", ["mean_p_kept"], ["logits"]),
    ]
    return nodes, [tiny]


def safetensors_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """A safetensors file: header length (u64 LE), JSON header, then each tensor's C-order bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset, blobs = 0, []
    for name, a in tensors.items():
        data = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        span = [offset, offset + len(data)]
        header[name] = {"dtype": _ST_DTYPES[a.dtype.name], "shape": list(a.shape), "data_offsets": span}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def load_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a safetensors file into NumPy arrays and its metadata (PyTorch not needed)."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    names = {v: k for k, v in _ST_DTYPES.items()}
    body = raw[8 + n :]
    tensors = {}
    for k, v in header.items():
        begin, end = v["data_offsets"]
        dtype = np.dtype(names[v["dtype"]]).newbyteorder("<")
        tensors[k] = np.frombuffer(body[begin:end], dtype=dtype).reshape(v["shape"])
    return tensors, meta


def onnx_model(p: Predictor) -> Any:
    """The inference path of ``p`` as an ONNX ModelProto (normalisation, layers, softmax and argmax)."""
    try:
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    except ImportError as exc:
        raise ConfigError("format=onnx needs the onnx package: pip install -e '.[onnx]' in mlptrain's clone") from exc
    if p.normalization.quantile is not None:
        raise ConfigError(
            f"format=onnx: {p.path} was trained with data.normalize=quantile, whose per-column quantile map the ONNX "
            "graph does not implement; export format=safetensors (its metadata holds the quantile table), score with "
            "python -m mlptrain.predict, or train with data.normalize=standard or robust"
        )
    f32 = np.float32
    inputs, nodes, inits = _onnx_inputs(p)  # -> x64 (N, F) double: the model's features, raw
    inits += [
        numpy_helper.from_array(p.shift.astype(np.float64), "shift"),  # in float64, as mlptrain normalises
        numpy_helper.from_array(1.0 / p.scale.astype(np.float64), "inv_scale"),
    ]
    if _activation(p) == "gelu":
        consts = {"gelu_k": 0.044715, "gelu_c": np.sqrt(2 / np.pi), "gelu_one": 1.0, "gelu_half": 0.5}
        inits += [numpy_helper.from_array(np.array(v, f32), name) for name, v in consts.items()]
    nodes += [
        helper.make_node("Sub", ["x64", "shift"], ["x_shifted"]),
        helper.make_node("Mul", ["x_shifted", "inv_scale"], ["x_normalised"]),
        helper.make_node("Cast", ["x_normalised"], ["h0"], to=TensorProto.FLOAT),  # rounded once
    ]
    ensemble = p.model.members > 1
    for i, layer in enumerate(p.model.layers):
        w, b = (np.ascontiguousarray(p.backend.to_host(t.value), dtype=f32) for t in (layer.weight, layer.bias))
        last = "logits" if p.classification else "z_out"  # a regression's units come after the last Gemm
        last = "member_z" if ensemble else last  # (K, N, C), then the members' mean
        out = last if i == len(p.model.layers) - 1 else f"z{i + 1}"
        if ensemble:  # one batched MatMul: h (N, in) or (K, N, in) @ W^T (K, in, out) + b (K, 1, out)
            wt, bk = np.ascontiguousarray(w.transpose(0, 2, 1)), b[:, None, :]
            inits += [numpy_helper.from_array(wt, f"layer{i}.weight"), numpy_helper.from_array(bk, f"layer{i}.bias")]
            nodes.append(helper.make_node("MatMul", [f"h{i}", f"layer{i}.weight"], [f"m{i}"]))
            nodes.append(helper.make_node("Add", [f"m{i}", f"layer{i}.bias"], [out]))
        else:  # Gemm: h @ W^T + b, W (out, in) as mlptrain and PyTorch store it
            inits += [numpy_helper.from_array(w, f"layer{i}.weight"), numpy_helper.from_array(b, f"layer{i}.bias")]
            nodes.append(helper.make_node("Gemm", [f"h{i}", f"layer{i}.weight", f"layer{i}.bias"], [out], transB=1))
        if layer.relu:
            nodes.append(helper.make_node("Relu", [out], [f"h{i + 1}"]))
        elif layer.activation == "gelu":
            nodes += _onnx_gelu(out, f"h{i + 1}", i)
        elif out != last:
            nodes.append(helper.make_node("Identity", [out], [f"h{i + 1}"]))
    if ensemble:
        mean_nodes, mean_inits = _onnx_member_mean(p.classification)
        nodes, inits, last = nodes + mean_nodes, inits + mean_inits, "logits" if p.classification else "z_out"
    if not p.classification:
        units, unit_inits = _onnx_target_units(p, last)
        nodes, inits = nodes + units, inits + unit_inits
    n, c = "N", p.num_outputs
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [n, c])]
    if p.classification:
        nodes += [
            helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
            helper.make_node("ArgMax", ["logits"], ["class_id"], axis=1, keepdims=0),
        ]
        outputs += [
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [n, c]),
            helper.make_tensor_value_info("class_id", TensorProto.INT64, [n]),
        ]
    _check_names(p, nodes, inits)
    graph = helper.make_graph(nodes, "mlptrain", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", ONNX_OPSET)]
    opsets += [helper.make_opsetid(onnx_columns.ML_DOMAIN, onnx_columns.ML_OPSET)] if p.plan is not None else []
    model = helper.make_model(graph, opset_imports=opsets, producer_name="mlptrain")
    model.ir_version = min(model.ir_version, 8)  # readable by older ONNX Runtime releases too
    helper.set_model_props(model, {"mlptrain": json.dumps(preprocessing(p))})
    onnx.checker.check_model(model)
    return model


def _onnx_inputs(p: Predictor) -> tuple[list[Any], list[Any], list[Any]]:
    """``(inputs, nodes, initializers)`` that make ``x64`` (N, F) double, the model's raw features: from one
    float32 input ``x`` (N, F), or (a model with a column plan) from one input per raw column, encoded in the
    graph (:mod:`mlptrain.inference.onnx_columns`).

    """
    from onnx import TensorProto, helper

    if p.plan is None:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", p.num_features])
        return [x], [helper.make_node("Cast", ["x"], ["x64"], to=TensorProto.DOUBLE)], []
    return onnx_columns.plan_graph(p.plan, "x64")


def _check_names(p: Predictor, nodes: list[Any], inits: list[Any]) -> None:
    """Raise ConfigError where a raw column (a graph input) has the name of another tensor of the graph."""
    taken = {o for node in nodes for o in node.output} | {i.name for i in inits}
    clash = [c for c in (p.plan.names if p.plan is not None else []) if c in taken]
    if clash:
        raise ConfigError(
            f"format=onnx: the column(s) {clash} have the name of a tensor of the exported graph, whose inputs are "
            "the raw columns, named as the columns: rename them and train again, or export safetensors"
        )


def export(args: ExportArgs) -> Path:
    if args.format not in FORMATS:
        raise ConfigError(f"format={args.format!r}; expected one of {', '.join(FORMATS)}")
    if args.dtype not in DTYPES or (args.format == "onnx" and args.dtype != "fp32"):
        raise ConfigError(f"dtype={args.dtype!r}; expected {'fp32' if args.format == 'onnx' else 'fp32 or fp16'}")
    p = Predictor(args.ckpt, device="cpu", precision="fp32")  # host arrays, master weights
    out = output_path(p, args)
    side = plan_path(out) if args.format == "safetensors" and p.plan is not None else None  # the plan as JSON
    for path, kind, same in (
        (out, f"an mlptrain {args.format} export", lambda f: is_export(f, args.format)),
        *([(side, "an mlptrain column plan", is_plan_file)] if side is not None else []),
    ):
        outputs.check_output(
            path, inputs={"the checkpoint": p.path}, kind=kind, same_kind=same, overwrite=args.overwrite
        )
    outputs.prepare([out, *([side] if side is not None else [])])
    if args.format == "safetensors":
        meta = {"format": "pt", "mlptrain": json.dumps(preprocessing(p))}
        content: bytes = safetensors_bytes(sequential_state_dict(p, DTYPES[args.dtype]), meta)
    else:
        content = onnx_model(p).SerializeToString()
    items = [(out, content)]
    if side is not None and p.plan is not None:  # the weights take the encoded features: the plan makes them
        plan = {"format": PLAN_FORMAT, **p.plan.to_meta(), "feature_names": p.plan.feature_names}
        items.append((side, (json.dumps(plan, indent=1) + "\n").encode("utf-8")))
    try:
        outputs.write_together(items)
    except OSError as exc:
        raise OutputError(f"cannot write {out} ({exc})") from exc
    return out


def plan_path(out: Path) -> Path:
    """Where a safetensors export's column plan goes: ``model.safetensors`` -> ``model.columns.json``."""
    return out.with_name(out.stem + ".columns.json")


def is_plan_file(path: Path) -> bool:
    """Whether ``path`` is a column plan that an export wrote (so that exporting again may replace it)."""
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("format") == PLAN_FORMAT
    except Exception:  # not JSON, not an object, unreadable: not ours
        return False


def output_path(p: Predictor, args: ExportArgs) -> Path:
    """``output``, which must end in ``.<format>``; by default ``<name>.<format>`` in the checkpoint's run
    directory (never in its ``checkpoints/``, which holds checkpoints only), else beside the checkpoint."""
    suffix = f".{args.format}"
    if args.output is None:
        beside = p.path.parent.parent if p.path.parent.name == CHECKPOINT_DIR else p.path.parent
        return beside / (p.path.stem + suffix)
    out = Path(args.output).expanduser()
    if out.suffix.lower() != suffix:
        raise ConfigError(f"output={out}: format={args.format} writes a {suffix} file; name it {out.stem}{suffix}")
    if not out.parent.is_dir():
        raise OutputError(f"output={out}: the folder {out.parent} does not exist")
    return out


def is_export(path: Path, fmt: str) -> bool:
    """Whether ``path`` is an export of mlptrain in ``fmt`` (so that exporting again may replace it)."""
    try:
        if fmt == "onnx":
            import onnx

            return onnx.load(str(path), load_external_data=False).producer_name == "mlptrain"
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(n, 1 << 26)))  # safetensors: the JSON header after its length
        return "mlptrain" in header.get("__metadata__", {})
    except Exception:  # whatever the bytes (onnx raises protobuf's own errors): not an export
        return False


def run(args: ExportArgs) -> int:
    out = export(args)
    print(f"wrote {out} ({out.stat().st_size:,} bytes, {args.format})")
    if args.format == "safetensors" and plan_path(out).is_file():
        print(f"wrote {plan_path(out)} (the column plan: raw columns -> the weights' {out.stem} inputs)")
    return 0


ABOUT = "Export a trained mlptrain checkpoint as safetensors (PyTorch nn.Sequential) or ONNX (with normalisation)."


def main(argv: list[str] | None = None) -> int:
    return commands.main(ExportArgs, "mlptrain.export", ABOUT, run, argv)


if __name__ == "__main__":
    sys.exit(main())
