"""A model's whole inference path as one ONNX graph (``python -m mlptrain export format=onnx``)::

    x (N, F) float32 -> (float64) Sub(shift), Mul(1/scale) -> float32
        -> [Gemm(W^T, b) -> Relu] ... -> Gemm -> logits (N, C)
    classification: probabilities = Softmax(logits), class_id = ArgMax(logits) (int64)
    regression: ... -> Gemm -> Mul(target_scale) -> Add(target_shift) -> logits (N, T), in the targets' units

with the same float32 arithmetic as :class:`mlptrain.inference.predictor.Predictor` on the CPU, so ONNX
Runtime gives the same predictions (tests/test_export.py). GELU is its tanh form in basic operators; an
ensemble (``ensemble.size=K``) is one batched MatMul per layer, ``(K, N, in) @ (K, in, out)``, then the
members' mean probability (or mean output) inside the graph. A model with a column plan takes its raw
columns, one input each, encoded in the graph (:mod:`mlptrain.inference.onnx_columns`). ``data.normalize=
quantile`` maps its columns through their training quantiles to a standard normal in the graph, in float64
before the Sub and Mul (:mod:`mlptrain.inference.onnx_quantile`).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from mlptrain.base.errors import ConfigError
from mlptrain.inference import onnx_columns, onnx_quantile
from mlptrain.inference.export_meta import activation, preprocessing
from mlptrain.inference.predictor import Predictor

ONNX_OPSET = 17


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


def _onnx_member_mean(probabilities: bool, out: str) -> tuple[list[Any], list[Any]]:
    """``member_z (K, N, C)`` -> the ensemble's ``logits``: the log of the members' mean probability (as
    :func:`mlptrain.nn.members.ensemble_logits`, the smallest float32 for a probability of 0); otherwise ``out``,
    the mean output (a regression's ``z_out``, or the ``logits`` of classes trained with mse)."""
    from onnx import helper, numpy_helper

    if not probabilities:
        return [helper.make_node("ReduceMean", ["member_z"], [out], axes=[0], keepdims=0)], []
    tiny = numpy_helper.from_array(np.array(np.finfo(np.float32).tiny, np.float32), "tiny")
    nodes = [
        helper.make_node("Softmax", ["member_z"], ["member_p"], axis=2),
        helper.make_node("ReduceMean", ["member_p"], ["mean_p"], axes=[0], keepdims=0),
        helper.make_node("Max", ["mean_p", "tiny"], ["mean_p_kept"]),
        helper.make_node("Log", ["mean_p_kept"], ["logits"]),
    ]
    return nodes, [tiny]


def onnx_model(p: Predictor) -> Any:
    """The inference path of ``p`` as an ONNX ModelProto (normalisation, layers, softmax and argmax)."""
    try:
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    except ImportError as exc:
        raise ConfigError("format=onnx needs the onnx package: pip install -e '.[onnx]' in mlptrain's clone") from exc
    f32 = np.float32
    inputs, nodes, inits = _onnx_inputs(p)  # -> x64 (N, F) double: the model's features, raw
    raw = "x64"
    if p.normalization.quantile is not None:  # data.normalize=quantile: its columns to a standard normal first
        mapped, mapped_inits = onnx_quantile.quantile_graph(p.normalization.quantile, p.num_features, raw, "x_mapped")
        nodes, inits, raw = nodes + mapped, inits + mapped_inits, "x_mapped"
    inits += [
        numpy_helper.from_array(p.shift.astype(np.float64), "shift"),  # in float64, as mlptrain normalises
        numpy_helper.from_array(1.0 / p.scale.astype(np.float64), "inv_scale"),
    ]
    if activation(p) == "gelu":
        consts = {"gelu_k": 0.044715, "gelu_c": np.sqrt(2 / np.pi), "gelu_one": 1.0, "gelu_half": 0.5}
        inits += [numpy_helper.from_array(np.array(v, f32), name) for name, v in consts.items()]
    nodes += [
        helper.make_node("Sub", [raw, "shift"], ["x_shifted"]),
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
        last = "logits" if p.classification else "z_out"
        mean_nodes, mean_inits = _onnx_member_mean(p.model.probabilities, last)  # MemberMean's: mse averages outputs
        nodes, inits = nodes + mean_nodes, inits + mean_inits
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
