"""Inference on the GPU: normalise, then the forward pass and the argmax/softmax as a CUDA graph.

Per batch of ``B`` raw rows (:class:`mlptrain.inference.predictor.Predictor` holds the model and passes its
forward pass in: this engine knows arrays and graphs, not the network):

0. ``data.normalize=quantile``: the Predictor has mapped those columns through their training quantiles on the host
   (float64, :meth:`mlptrain.data.files.column_stats.QuantileMap.apply_`) before the rows come here; their shift is 0
   and their scale 1, so step 1 only casts them;
1. one kernel reads the raw float32 rows where they are (a slice of the caller's CuPy array, or
   a staging buffer the host rows were copied into) and writes ``(x - shift) * (1 / scale)`` in
   the compute dtype into the graph's input buffer: normalisation, cast and copy in one pass
   (:func:`mlptrain.inference.cuda.infer_kernels.normalise`);
2. one graph launch replays the forward pass (RELU_BIAS GEMMs for the hidden layers, BIAS for
   the output layer: no relu_aux, nothing kept for a backward) and the argmax (one warp per
   row, :func:`mlptrain.inference.cuda.infer_kernels.argmax`), and the softmax when it is asked for;
3. the batch's results are copied into device arrays for all ``N`` rows.

The host waits once, when the results come back after the last batch. The last, shorter batch
reuses the same graph: its rows go into the first part of the input buffer, the rest of which
still holds whatever was there (rows are independent through every layer, and those rows'
outputs are dropped), so one batch shape means one graph. Inputs of fewer rows than a batch use
a batch of the next power of two (at least 64): a service scoring requests of every size
captures at most ``log2(batch)`` graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cupy as cp
import numpy as np

from mlptrain.inference.cuda.infer_kernels import argmax, normalise
from mlptrain.step.cuda.graph import GraphedStep


class GraphedInference:
    """Runs a model's inference batches as replays of one CUDA graph per batch size.

    ``forward``: the model's forward pass for inference, ``x (B, in)`` in the compute dtype to
    ``logits (B, out)`` (``lambda x: model.forward(x, keep=False)``), captured into the graphs.
    """

    def __init__(self, forward: Callable[[Any], Any], shift: np.ndarray, scale: np.ndarray, compute_dtype: Any) -> None:
        self.forward = forward
        self.dtype = np.dtype(compute_dtype)
        self.shift = cp.asarray(shift.astype(np.float32))  # (F,)
        self.inv = cp.asarray((1.0 / scale).astype(np.float32))  # (F,)
        cp.cuda.get_current_stream().synchronize()  # uploaded before another stream reads them
        self.stream = cp.cuda.Stream(non_blocking=True)  # graphs cannot capture the legacy default stream
        self._graphs: dict[tuple[bool, bool], GraphedStep] = {}
        self._staging: Any = None  # (B, F) float32: host rows on their way to the normaliser

    def _step(self, classification: bool, probabilities: bool) -> Callable[[Any, Any], Any]:
        def step(x: Any, _unused: Any) -> Any:
            logits = self.forward(x)  # (B, out): RELU_BIAS ... BIAS
            if not classification:
                return (logits.astype(cp.float32),)
            ids = argmax(logits)  # (B,) int64, one warp per row (mlptrain.inference.cuda.infer_kernels)
            if not probabilities:
                return (ids,)
            z = logits.astype(cp.float32)
            e = cp.exp(z - z.max(axis=1, keepdims=True))
            return ids, e / e.sum(axis=1, keepdims=True)  # (B, C) softmax

        return step

    def run(
        self,
        x: Any,
        batch: int,
        *,
        classification: bool,
        probabilities: bool,
        progress: Callable[[int], None] | None = None,
    ) -> list[np.ndarray]:
        """Score raw rows ``x (N, F)`` (NumPy or CuPy, any numeric dtype) in batches of ``batch``.

        Returns host arrays: a regression's ``[values (N, T)]``; a classification's ``[class_id (N,)]``
        and, with ``probabilities``, ``probabilities (N, C)`` after it.
        """
        n, f = x.shape
        # Batch rows: ``batch``, or for fewer rows the next power of two (at least 64), so that calls
        # of every size share a handful of graphs instead of capturing one per size.
        b = min(batch, max(64, 1 << max(n - 1, 0).bit_length()))
        key = (classification, probabilities)
        if key not in self._graphs:
            self._graphs[key] = GraphedStep(self._step(*key), warmup=1)
        graphed = self._graphs[key]
        # The caller's stream may still be computing x: this stream waits for it (no host sync).
        self.stream.wait_event(cp.cuda.get_current_stream().record())
        with self.stream:
            x_in, y_in = graphed.input_buffers((b, f), self.dtype, (b, 0), np.int8)
            results: list[Any] = []
            for s in range(0, n, b):
                e = min(s + b, n)
                normalise(self._raw(x, s, e, b), self.shift, self.inv, x_in[: e - s])  # into the graph's input
                out = graphed(x_in, y_in)
                if not results:
                    results = [cp.empty((n, *r.shape[1:]), dtype=r.dtype) for r in out]
                for dst, src in zip(results, out, strict=True):
                    dst[s:e] = src[: e - s]
                if progress is not None:
                    progress(e - s)
            return [r.get(stream=self.stream) for r in results]  # the one wait for the device

    def graphs_captured(self) -> int:
        """CUDA graphs captured so far (one per batch size and kind of output)."""
        return sum(g.num_graphs for g in self._graphs.values())

    def _raw(self, x: Any, s: int, e: int, b: int) -> Any:
        """Rows ``s:e`` of ``x`` as float32 on the device: a view of a CuPy array, or copied in."""
        if isinstance(x, cp.ndarray):
            return cp.ascontiguousarray(x[s:e], dtype=cp.float32)
        if self._staging is None or self._staging.shape[0] < b or self._staging.shape[1] != x.shape[1]:
            self._staging = cp.empty((b, x.shape[1]), dtype=cp.float32)
        part = self._staging[: e - s]
        part.set(np.ascontiguousarray(x[s:e], dtype=np.float32), stream=self.stream)
        return part
