"""Precision policies and dynamic loss scaling.

=========== ============== ============== ==================================================
precision   master weights GEMM dtype     notes
=========== ============== ============== ==================================================
fp64        float64        float64        CPU and GPU
fp32        float32        float32        CPU and GPU; GPU GEMMs in true FP32
tf32        float32        float32        GPU only: GEMMs on TF32 tensor cores
fp16        float32        float16        GPU only: dynamic loss scaling
bf16        float32        bfloat16       GPU only: bfloat16 has fp32's range, no scaling
fp8         float32        e4m3 / e5m2    FP8 operands (per-tensor delayed scaling,
                           -> bfloat16    :mod:`mlptrain.nn.fp8`), bfloat16 results and
                                          activations; GPU: compute capability >= 8.9
                                          (Hopper); CPU: emulated by the FP8 contract
=========== ============== ============== ==================================================

fp8 keeps bfloat16 compute copies and activations, as bf16 does: each GEMM casts its operands
to FP8 (:class:`mlptrain.nn.fp8.Fp8Gemm`). Its loss scaler never scales (bfloat16 gradients need no
scale) but checks every step, so that a step with an inf/NaN gradient is skipped.

:class:`LossScaler` follows ``torch.amp.GradScaler``: the loss gradient is multiplied by
``scale``; if any gradient is inf/NaN the step is skipped and ``scale *= backoff_factor``;
after ``growth_interval`` consecutive clean steps ``scale *= growth_factor``. All of its
state is 0-d device arrays updated by device operations, so a step never syncs the host.

:data:`PRECISIONS` registers each precision as a :class:`PrecisionSpec` row, named by
``precision.name``; :data:`SETTINGS` says which rows read which ``precision.*`` setting. A new
precision is a row, ``conf/precision/<name>.yaml``, and the kernels it truly needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlptrain.base.backend import Backend, scalar
from mlptrain.base.cuda_source import c_literal
from mlptrain.base.errors import DeviceError
from mlptrain.base.registry import AT_LEAST_ONE, FRACTION, POSITIVE, Range, Registry

FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: FP8 tensor cores


@dataclass(frozen=True)
class PrecisionSpec:
    """A precision: what it stores, what it computes in, and what it needs.

    ``storage``: the master weights' dtype; ``compute``: the GEMMs' operands, activations and compute
    copies (with ``gemm_scales``, the GEMM results': the operands are cast to FP8). ``loss_scaling``:
    ``none``; ``dynamic`` (the loss is scaled, every step checked and skipped on inf/NaN, the scale
    backed off and grown: :class:`LossScaler`); ``check`` (a scale of 1, every step checked and skipped
    on inf/NaN). ``tf32``: float32 GEMMs on TF32 tensor cores. ``gemm_scales``: the GEMMs take
    per-tensor delayed scales (:mod:`mlptrain.nn.fp8`; a GPU of compute capability 8.9 or higher).
    ``cpu``: the CPU runs it (the NumPy engine computes a half-precision GEMM in float32 and rounds once;
    fp8: the FP8 contract, emulated).
    """

    storage: str
    compute: str
    loss_scaling: str = "none"
    tf32: bool = False
    gemm_scales: bool = False
    cpu: bool = False
    compute_copy: str = "kept"  # what precision.compute_copy=auto means for this row (when compute != storage)


PRECISIONS: Registry[PrecisionSpec] = Registry("precision.name")
PRECISIONS.add("fp64", PrecisionSpec("float64", "float64", cpu=True))
PRECISIONS.add("fp32", PrecisionSpec("float32", "float32", cpu=True))
PRECISIONS.add("tf32", PrecisionSpec("float32", "float32", tf32=True))
PRECISIONS.add("fp16", PrecisionSpec("float32", "float16", loss_scaling="dynamic"))
PRECISIONS.add("bf16", PrecisionSpec("float32", "bfloat16"))
# fp8 keeps no bfloat16 copy of its weights: the FP8 casts read the float32 masters
# (mlptrain.nn.layers.Param.gemm_casts)
PRECISIONS.add(
    "fp8",
    PrecisionSpec("float32", "bfloat16", loss_scaling="check", gemm_scales=True, cpu=True, compute_copy="cast"),
)


def _dynamic(p: PrecisionSpec) -> bool:
    return p.loss_scaling == "dynamic"


MAX_AMAX_HISTORY = 1024  # precision.amax_history: steps of amax each FP8 tensor keeps (on the device)
MAX_MARGIN = 8  # precision.margin: the largest value scales to fp8_max / 2^margin (E4M3: 448 / 256 = 1.75)

# precision.<key>: (whether a row reads it, what those rows are, the setting's range)
SETTINGS: dict[str, tuple[Callable[[PrecisionSpec], bool], str, Range | None]] = {
    "init_scale": (_dynamic, "dynamic loss scaling", POSITIVE),
    "growth_factor": (_dynamic, "dynamic loss scaling", Range(1, low_open=True)),
    "backoff_factor": (_dynamic, "dynamic loss scaling", FRACTION),
    "growth_interval": (_dynamic, "dynamic loss scaling", AT_LEAST_ONE),
    "max_consecutive_skips": (
        lambda p: p.loss_scaling != "none",
        "the precisions that skip a step with an inf/NaN gradient",
        AT_LEAST_ONE,
    ),
    # Transformer Engine's longest default history; the GPU's scale update shifts it in one thread at every cast
    "amax_history": (
        lambda p: p.gemm_scales,
        "delayed scaling",
        Range(1, MAX_AMAX_HISTORY, words="in [1, 1024] steps"),
    ),
    # E4M3 has 15 binades of normal numbers below its max (448 down to 2^-6): 2^8 of headroom leaves 7 of them
    "margin": (
        lambda p: p.gemm_scales,
        "delayed scaling",
        Range(0, MAX_MARGIN, note="2^margin of headroom below the FP8 max; 8 leaves 7 of E4M3's 15 binades"),
    ),
    "compute_copy": (
        lambda p: p.compute != p.storage,
        "the other precisions compute in the parameters' dtype",
        None,
    ),
}


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: Any
    compute_dtype: Any
    tf32: bool = False
    loss_scaling: bool = False  # dynamic loss scaling
    checked: bool = False  # no scaling, but every step checked for inf/NaN gradients (and skipped): fp8
    compute_copy: str = "kept"  # fp16, bf16: "kept" or "cast" (mlptrain.nn.layers.CastBuffer); fp8: "cast" by default
    fp8: bool = False  # GEMM operands cast to FP8 (mlptrain.nn.fp8); compute_dtype is then the results'
    amax_history: int = 16  # fp8: delayed scaling's history length and margin (mlptrain.nn.fp8.Fp8Scaling)
    margin: int = 0


def get_precision(name: str, backend: Backend) -> Precision:
    """The policy of row ``name`` of :data:`PRECISIONS` on ``backend`` (a row not marked ``cpu`` needs the GPU)."""
    spec = PRECISIONS[name]
    if not backend.is_gpu and not spec.cpu:
        raise DeviceError(
            f"precision={name} needs a GPU but the run is on the CPU; use precision=fp32 or fp64 on the CPU, "
            "or run on a machine with an NVIDIA GPU and the cu12/cu13 extra"
        )
    if backend.is_gpu and spec.gemm_scales:
        check_fp8_device(backend)
    xp = backend.xp
    return Precision(
        name,
        _dtype(xp, spec.storage),
        _dtype(xp, spec.compute),
        tf32=spec.tf32,
        loss_scaling=spec.loss_scaling == "dynamic",
        checked=spec.loss_scaling == "check",
        compute_copy=spec.compute_copy,
        fp8=spec.gemm_scales,
    )


def _dtype(xp: Any, name: str) -> Any:
    """``xp``'s dtype ``name`` (bfloat16: ml_dtypes', which CuPy takes too)."""
    return _bfloat16(xp) if name == "bfloat16" else getattr(xp, name)


def check_fp8_device(backend: Backend) -> None:
    """DeviceError unless the GPU has FP8 tensor cores (compute capability 8.9 or higher)."""
    cc = backend.xp.cuda.Device().compute_capability  # "90" on the H200
    major, minor = int(cc[:-1]), int(cc[-1])
    if (major, minor) < FP8_MIN_CAPABILITY:
        raise DeviceError(
            f"precision=fp8 needs a GPU of compute capability 8.9 or higher (Ada, Hopper) but this one is "
            f"{major}.{minor}; use precision=bf16 on this GPU"
        )


def _bfloat16(xp: Any) -> Any:
    try:
        import ml_dtypes
    except ImportError as exc:  # pragma: no cover - ml_dtypes comes with CuPy's bf16 support
        raise DeviceError("precision=bf16 needs the ml_dtypes package (pip install ml_dtypes)") from exc
    return np.dtype(ml_dtypes.bfloat16)


class LossScaler:
    """Dynamic loss scaling on the device (a no-op scale of 1 when ``enabled`` is False).

    Attributes (0-d device arrays): ``scale``, ``inv_scale``, ``found_inf`` (int32: the last
    step overflowed and was skipped), ``growth_tracker`` (clean steps since the last change),
    ``consecutive_skips``.
    """

    def __init__(
        self,
        xp: Any,
        *,
        enabled: bool,
        init_scale: float = 65536.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.xp = xp
        self.enabled = enabled
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.scale = scalar(xp, init_scale if enabled else 1.0, np.float64)
        self.inv_scale = scalar(xp, 1.0 / float(init_scale) if enabled else 1.0, np.float64)
        self.found_inf = xp.zeros((), dtype=xp.int32)
        self.growth_tracker = xp.zeros((), dtype=xp.int32)
        self.consecutive_skips = xp.zeros((), dtype=xp.int32)
        self._any_bad = xp.zeros(1, dtype=xp.int32)  # GPU check: blocks that saw inf/NaN set it
        self._check_kernel: Any = None
        self._check_key: tuple | None = None

    def check(self, grads: list[Any]) -> Any:
        """Set ``found_inf`` to whether any gradient holds inf/NaN; returns it (device, no sync).

        On the GPU one kernel scans every gradient (16-byte loads when the gradients allow,
        :class:`mlptrain.step.cuda.multitensor.NonfiniteScan`); its last block to finish writes the flag, so
        no separate kernel has to clear it first.
        """
        xp = self.xp
        if not self.enabled:
            return self.found_inf  # stays 0: fp32/fp64 runs check the loss at the log interval
        if xp is not np:
            from mlptrain.step.cuda.multitensor import NonfiniteScan

            sizes = [int(g.size) for g in grads]
            vector = NonfiniteScan.fits(grads)  # 16-byte loads; else one element at a time
            key = (vector, grads[0].dtype.name, tuple(sizes))
            if self._check_key != key:
                name = "mlptrain_check_nonfinite"
                self._check_kernel = NonfiniteScan(name, sizes, key[1]) if vector else _nonfinite_kernel(sizes)
                self._check_key = key
            self._check_kernel(grads, self._any_bad, self.found_inf)
            return self.found_inf
        bad = xp.zeros((), dtype=xp.bool_)
        for g in grads:
            bad |= ~xp.isfinite(g).all()
        self.found_inf[...] = bad
        return self.found_inf

    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps (device ops)."""
        if not self.enabled:
            return
        xp = self.xp
        if xp is not np:  # the same rules in one kernel launch
            from mlptrain.base.cuda.kernels import elementwise

            kernel = elementwise(
                "",
                "int32 found, float64 scale, float64 inv_scale, int32 tracker, int32 skips",
                self.cuda_update("found", "scale", "inv_scale", "tracker", "skips"),
                "mlptrain_scaler_update",
                preamble=SCALER_UPDATE_CUDA,
            )
            kernel(self.found_inf, self.scale, self.inv_scale, self.growth_tracker, self.consecutive_skips)
            return
        inf = self.found_inf != 0
        tracker = xp.where(inf, 0, self.growth_tracker + 1)
        grow = tracker >= self.growth_interval
        factor = xp.where(inf, self.backoff_factor, xp.where(grow, self.growth_factor, 1.0))
        self.scale *= factor
        xp.divide(1.0, self.scale, out=self.inv_scale)
        self.growth_tracker[...] = xp.where(grow, 0, tracker)
        self.consecutive_skips[...] = xp.where(inf, self.consecutive_skips + 1, 0)

    def cuda_update(self, found: str, scale: str, inv_scale: str, tracker: str, skips: str) -> str:
        """CUDA statements of :meth:`update` on the lvalues named here (the training step fuses them)."""
        if not self.enabled:
            return ""
        return (
            f"mlptrain_scaler_update({found}, {c_literal(self.backoff_factor)}, {c_literal(self.growth_factor)}, "
            f"{int(self.growth_interval)}, {scale}, {inv_scale}, {tracker}, {skips});"
        )

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": float(self.scale),
            "growth_tracker": int(self.growth_tracker),
            "consecutive_skips": int(self.consecutive_skips),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale[...] = state["scale"]
        self.xp.divide(1.0, self.scale, out=self.inv_scale)
        self.growth_tracker[...] = state["growth_tracker"]
        self.consecutive_skips[...] = state["consecutive_skips"]

    # --- compiled ahead (mlptrain.step.cuda.precompile) -----------------------------------------------

    def precompile_jobs(self, dtype: Any, shapes: list[tuple[int, ...]]) -> list[Any]:
        """:meth:`check` of gradients of ``shapes`` in ``dtype`` compiled ahead (a
        :class:`~mlptrain.base.cuda_source.Job`; none unless enabled), on a copy of this scaler with flags and a kernel
        cache of its own."""
        from mlptrain.base.cuda_source import Job

        if not self.enabled:
            return []
        dtype = np.dtype(dtype)
        scratch = sum(int(np.prod(s)) for s in shapes) * dtype.itemsize
        name = f"mlptrain_check_nonfinite ({dtype.name} gradients)"
        return [Job(name, "update", lambda: self._compile_check(dtype, shapes), scratch)]

    def _compile_check(self, dtype: Any, shapes: list[tuple[int, ...]]) -> None:
        import copy

        xp, sc = self.xp, copy.copy(self)
        sc._check_kernel, sc._check_key = None, None
        sc.found_inf, sc._any_bad = xp.zeros_like(self.found_inf), xp.zeros_like(self._any_bad)
        sc.check([xp.zeros(s, dtype) for s in shapes])


SCALER_UPDATE_CUDA = """
// LossScaler.update() of mlptrain/step/precision.py.
__device__ void mlptrain_scaler_update(int found, double backoff, double growth, int interval, double& scale,
                                       double& inv_scale, int& tracker, int& skips) {
    if (found) { scale *= backoff; tracker = 0; skips += 1; }
    else {
        skips = 0;
        tracker += 1;
        if (tracker >= interval) { scale *= growth; tracker = 0; }
    }
    inv_scale = 1.0 / scale;
}
"""


def _nonfinite_kernel(sizes: list[int]) -> Any:
    """One launch over every gradient: ``found = any element is inf or NaN``."""
    from mlptrain.step.cuda.multitensor import MultiTensorKernel

    return MultiTensorKernel(
        "mlptrain_check_nonfinite",
        [("g", "G")],
        sizes,
        "if (!isfinite((float)$g)) bad = true;",
        extra_params="raw int32 any_bad, raw int32 found",
        loop_prep="bool bad = false;",
        # Each block ORs its threads' flags into any_bad; the last block publishes and clears it.
        block_flag=("bad", "any_bad"),
        epilogue="found[0] = atomicExch(&any_bad[0], 0);",
    )
