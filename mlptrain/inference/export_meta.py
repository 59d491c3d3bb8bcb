"""What an export says about a model besides its weights: how raw inputs become the network's and back.

:func:`preprocessing` is the JSON that both exports carry (:mod:`mlptrain.cli.export`: the safetensors
header's ``__metadata__``, the ONNX model's ``mlptrain`` property): the widths and the activation, the
normalisation ``(x - shift) / scale`` (``data.normalize=quantile``: the quantile table, its columns mapped
first), the feature, class and target names, a regression's ``target_scaling`` (the network's output ``z``
is in standardised units: ``y = z * scale + shift``) and a table's column plan.
"""

from __future__ import annotations

from typing import Any

from mlptrain.inference.predictor import Predictor


def activation(p: Predictor) -> str:
    """The hidden layers' activation: relu, gelu or none."""
    return p.model.layers[0].activation if len(p.model.layers) > 1 else "none"


def preprocessing(p: Predictor) -> dict[str, Any]:
    """What scoring raw inputs needs besides the parameters, as JSON-ready values."""
    return {
        "format": "mlptrain-model",
        "widths": p.widths,
        "members": p.model.members,  # > 1: an ensemble, which predicts its members' mean (docs/ensembles.md)
        "activation": activation(p),  # gelu: the tanh form, nn.GELU(approximate="tanh")
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
