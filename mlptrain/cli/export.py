"""``python -m mlptrain.export ckpt=PATH format=safetensors|onnx output=FILE``: the model for other tools.

**safetensors** (written here, no dependency; the format is an 8-byte little-endian header length,
a JSON header naming each tensor's dtype, shape and byte range, then the bytes): the parameters
under the names and layout of PyTorch's ``nn.Sequential(Linear, ReLU, ..., Linear)`` state dict
(``0.weight`` ``(out, in)``, ``0.bias``, ``2.weight`` ...; without ReLU the indices run 0, 1, 2),
so that ``model.load_state_dict(safetensors.torch.load_file(path))`` works. The header's
``__metadata__`` holds what scoring raw inputs needs besides, as JSON under ``mlptrain``
(:func:`mlptrain.inference.export_meta.preprocessing`: the normalisation, the names, a regression's
target scaling, a table's column plan).

**ONNX** (the ``onnx`` extra): the whole inference path as one graph, normalisation included
(:mod:`mlptrain.inference.onnx_graph`)::

    x (N, F) float32 -> (float64) Sub(shift), Mul(1/scale) -> float32
        -> [Gemm(W^T, b) -> Relu] ... -> Gemm -> logits (N, C)
    classification: probabilities = Softmax(logits), class_id = ArgMax(logits) (int64)
    regression: ... -> Gemm -> Mul(target_scale) -> Add(target_shift) -> logits (N, T), in the targets' units

with the same float32 arithmetic as :class:`mlptrain.inference.predictor.Predictor` on the CPU, so
ONNX Runtime gives the same predictions (tests/test_export.py). ``data.normalize=robust`` is the same Sub and
Mul; ``data.normalize=quantile`` maps its columns through their training quantiles in float64 before them
(:mod:`mlptrain.inference.onnx_quantile`).

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
from mlptrain.inference import outputs
from mlptrain.inference.export_meta import activation, preprocessing
from mlptrain.inference.onnx_graph import onnx_model
from mlptrain.inference.predictor import Predictor
from mlptrain.run.checkpoint import CHECKPOINT_DIR

FORMATS = ("safetensors", "onnx")
DTYPES = {"fp32": np.float32, "fp16": np.float16}
_ST_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64", "int64": "I64"}
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
    step = 2 if activation(p) != "none" else 1  # Linear, ReLU, Linear, ...: every other module is a Linear
    out = {}
    members = p.model.members  # an ensemble: nn.ModuleList of K such Sequentials, member k's names under "k."
    for i, layer in enumerate(p.model.layers):
        # W (out, in) and b (out,): the layout of torch.nn.Linear (an ensemble's: (K, out, in), (K, out))
        w, b = (np.ascontiguousarray(p.backend.to_host(t.value), dtype=dtype) for t in (layer.weight, layer.bias))
        for k in range(members):
            prefix = f"{k}." if members > 1 else ""
            out[f"{prefix}{step * i}.weight"], out[f"{prefix}{step * i}.bias"] = (w[k], b[k]) if members > 1 else (w, b)
    return out


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
