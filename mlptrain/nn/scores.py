"""The scores users read, from the sufficient statistics an evaluation gathers (host NumPy, float64).

A classification's scores come from its ``(C, C)`` confusion matrix (rows: the true class, columns: the
predicted one), its log loss, and for two classes the positive class's scores with the labels (ROC AUC);
a regression's from per-target sums of the errors and targets. The trainer gathers these on the device
(:meth:`mlptrain.step.trainer.Trainer.evaluate`) and ``python -m mlptrain.evaluate`` from a checkpoint's
outputs: both compute the scores here, so the two agree. Each score is scikit-learn's (``tests/test_scores.py``):

* ``balanced_acc``: ``balanced_accuracy_score``, the mean recall over the classes present in the truth;
* ``precision_macro``, ``recall_macro``, ``f1_macro``: ``precision_recall_fscore_support(average="macro")``,
  over the classes present in the truth or the predictions, 0 where a ratio has no denominator;
* ``roc_auc`` (two classes): ``roc_auc_score`` of class 1's score, ties counted half (absent when the truth
  holds one class only);
* ``rmse``, ``mae``, ``r2``: ``sqrt(mean_squared_error)``, ``mean_absolute_error`` and ``r2_score``, each
  the mean over the targets, in the targets' units.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlptrain.base.cuda_source import Job

CLASSIFICATION_SCORES = ("balanced_acc", "precision_macro", "recall_macro", "f1_macro", "log_loss")
REGRESSION_SCORES = ("rmse", "mae", "r2")
# scores that are better when larger (early_stopping.mode=auto watches them with max)
LARGER_IS_BETTER = ("acc", "balanced_acc", "precision_macro", "recall_macro", "f1_macro", "roc_auc", "r2")


def per_class(confusion: np.ndarray) -> dict[str, np.ndarray]:
    """``precision``, ``recall``, ``f1`` (each ``(C,)`` float64, 0 without a denominator) and ``support``."""
    c = np.asarray(confusion, dtype=np.float64)
    tp = np.diag(c)
    predicted, support = c.sum(axis=0), c.sum(axis=1)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, support, out=np.zeros_like(tp), where=support > 0)
    both = predicted + support  # 2 tp + fp + fn: F1 = 2 tp / (2 tp + fp + fn)
    f1 = np.divide(2 * tp, both, out=np.zeros_like(tp), where=both > 0)
    return {"precision": precision, "recall": recall, "f1": f1, "support": support.astype(np.int64)}


def classification_scores(confusion: np.ndarray, log_loss: float, binary: np.ndarray | None = None) -> dict[str, float]:
    """The flat scores of :data:`CLASSIFICATION_SCORES` (and ``roc_auc``) from ``confusion (C, C)``.

    ``binary``: for two classes, ``(2, N)`` float64: class 1's score (any value increasing with its
    probability) and the true label (0 or 1) of each row.
    """
    c = np.asarray(confusion, dtype=np.float64)
    pc = per_class(c)
    truth = c.sum(axis=1) > 0
    seen = truth | (c.sum(axis=0) > 0)  # in the truth or the predictions: scikit-learn's labels
    nan = float("nan")
    out = {
        "balanced_acc": float(pc["recall"][truth].mean()) if truth.any() else nan,
        **{f"{k}_macro": float(pc[k][seen].mean()) if seen.any() else nan for k in ("precision", "recall", "f1")},
        "log_loss": float(log_loss),
    }
    if binary is not None:
        out["roc_auc"] = roc_auc(binary[0], binary[1])
    return out


def roc_auc(score: np.ndarray, label: np.ndarray) -> float:
    """The area under the ROC curve of ``score (N,)`` for ``label (N,)`` 1 against 0 (Mann-Whitney: the
    probability that a positive row scores above a negative one, ties counted half); NaN with one class."""
    score, positive = np.asarray(score, np.float64), np.asarray(label) == 1
    n_pos = int(positive.sum())
    n_neg = len(score) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(score, kind="stable")
    s = score[order]
    ranks = np.empty(len(s), np.float64)
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])  # each run of equal scores gets its mean rank
    ends = np.r_[starts[1:], len(s)]
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def regression_scores(sums: np.ndarray, rows: int) -> dict[str, float]:
    """``rmse``, ``mae`` and ``r2`` from ``sums (4, T)`` float64 over ``rows`` rows, in the targets' units:
    per target the sum of squared errors, of absolute errors, of the targets and of their squares.

    R² of a target whose values are all alike is 1 if it is predicted exactly, else 0 (scikit-learn's);
    the targets should be centred near 0 for the sum of squares to keep its digits (the trainer's are
    standardised; the command's are centred before their sums are taken)."""
    sse, sae, sy, syy = np.asarray(sums, np.float64)
    if rows == 0:
        return dict.fromkeys(REGRESSION_SCORES, float("nan"))
    sst = np.maximum(syy - sy * sy / rows, 0.0)  # (T,) sum of (y - mean)^2
    r2 = np.where(sst > 0, 1.0 - sse / np.where(sst > 0, sst, 1.0), np.where(sse == 0, 1.0, 0.0))
    return {
        "rmse": float(np.sqrt((sse / rows).mean())),
        "mae": float((sae / rows).mean()),
        "r2": float(r2.mean()),
    }


def regression_sums(outputs: Any, y: Any, xp: Any = np) -> Any:
    """``(4, T)`` float64 on ``xp``'s device: per target the sums :func:`regression_scores` takes, of
    ``outputs (N, T)`` against ``y (N, T)`` (no host copy)."""
    z, t = outputs.astype(xp.float64), y.astype(xp.float64)
    err = z - t
    return xp.stack([(err * err).sum(axis=0), xp.abs(err).sum(axis=0), t.sum(axis=0), (t * t).sum(axis=0)])


class SplitSums:
    """What one evaluation of a split gathers on the device beside the loss, batch by batch, for :func:`scores`:
    a classification's confusion matrix (and, for two classes, class 1's margin and the label of each row; and
    the log loss's sum where the loss is not the cross-entropy), a regression's :func:`regression_sums`.

    No batch is read back: :meth:`host` copies the sums once, at the end of the split.
    """

    def __init__(self, xp: Any, classes: int | None, log_loss: bool) -> None:
        self.xp, self.classes, self.log_loss = xp, classes, log_loss
        self.sums: Any = None  # (C * C + 1,) int64/float64 or (4, T) float64, on the device
        self.binary: list[Any] = []  # per batch (2, B) float64: class 1's margin, the label

    def add(self, logits: Any, y: Any) -> None:
        """One batch's ``logits (B, C)`` (read, not changed) and ``y`` (labels ``(B,)`` or targets ``(B, T)``)."""
        xp = self.xp
        if self.classes is None:
            batch = regression_sums(logits, y, xp)
        else:
            c = self.classes
            z = logits.astype(xp.float64)  # (B, C): exact for every compute dtype (bfloat16, fp16 too)
            pred = z.argmax(axis=1)  # (B,)
            confusion = xp.bincount(y.astype(xp.int64) * c + pred, minlength=c * c).astype(xp.float64)  # (C * C,)
            nll = xp.zeros(1, xp.float64)
            if self.log_loss:  # the log loss's sum from the probabilities: logsumexp - z[y]
                zmax = z.max(axis=1, keepdims=True)
                lse = xp.log(xp.exp(z - zmax).sum(axis=1)) + zmax[:, 0]
                nll = (lse - xp.take_along_axis(z, y.astype(xp.int64)[:, None], axis=1)[:, 0]).sum()[None]
            batch = xp.concatenate([confusion, nll])
            if c == 2:
                self.binary.append(xp.stack([z[:, 1] - z[:, 0], y.astype(xp.float64)]))
        self.sums = batch if self.sums is None else self.sums + batch

    def host(self, to_host: Any, outputs: int) -> tuple[np.ndarray, np.ndarray | None]:
        """``(sums, binary)`` as host float64 (one copy each): the sums flat (zeros for an empty split),
        and the binary ``(2, N)`` scores with labels (None unless two classes)."""
        size = (self.classes or 0) ** 2 + 1 if self.classes is not None else 4 * outputs
        sums = np.zeros(size) if self.sums is None else np.asarray(to_host(self.sums), np.float64).ravel()
        if self.classes != 2:
            return sums, None
        if not self.binary:
            return sums, np.zeros((2, 0))
        return sums, np.asarray(to_host(self.xp.concatenate(self.binary, axis=1)), np.float64)


def scores(
    sums: np.ndarray,
    binary: np.ndarray | None,
    classes: int | None,
    rows: int,
    log_loss: float | None = None,
    scale: Any = None,
) -> dict[str, float]:
    """The scores of a split from :class:`SplitSums`' host ``sums`` (summed over ranks, if any) over ``rows``.

    ``log_loss``: a classification's, where it is known (the loss is the cross-entropy); None: the sums hold
    its sum. A regression's ``scale (T,)`` turns standardised targets' sums into the targets' units (None:
    they are in them)."""
    if classes is None:
        s = sums.reshape(4, -1).copy()
        if scale is not None:  # (y - shift) = scale * y_scaled: the sums of centred targets, R² unchanged
            k = np.asarray(scale, np.float64)
            s *= np.stack([k * k, k, k, k * k])
        return regression_scores(s, rows)
    c = classes
    if log_loss is None:
        log_loss = float(sums[c * c]) / rows if rows else float("nan")
    return classification_scores(sums[: c * c].reshape(c, c), log_loss, binary)


def sums_job(xp: Any, classes: int | None, log_loss: bool, dtype: Any, batches: list[tuple[int, Any]]) -> Job:
    """The kernels of :meth:`SplitSums.add` and :meth:`SplitSums.host` (the argmax, the confusion matrix's
    bincount, the casts to float64, the sums of batches; a regression's error sums), compiled ahead by the very
    calls on zeros: ``batches`` ``(rows, y)`` for each evaluation batch shape (``y``: the loader's targets, for
    their dtype and shape), ``dtype`` the logits'. Evaluation first runs after the first step (stage ``later``)."""
    width = classes if classes is not None else int(batches[0][1].shape[1]) if batches else 1

    def run() -> None:
        sums = SplitSums(xp, classes, log_loss)
        for rows, y_like in batches:
            logits = xp.zeros((rows, width), dtype)
            y = xp.zeros((rows, *y_like.shape[1:]), y_like.dtype)
            sums.add(logits, y)
            sums.add(logits, y)  # the second batch: the sums' add
        sums.host(getattr(xp, "asnumpy", np.asarray), width)

    scratch = max((r for r, _ in batches), default=0) * width * 24  # the logits, their float64 copy and more
    return Job(f"evaluation's scores of {np.dtype(dtype).name} logits ({width} outputs)", "later", run, scratch)
