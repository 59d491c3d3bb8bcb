"""K-fold cross-validation in one run (``ensemble.folds=K``): the folds, the out-of-fold scores, the report.

The training and validation rows together are the pool; :func:`mlptrain.data.stratified_folds` deals them
into K folds (stratified by class, seeded by ``seed``). Member ``k`` of the ensemble trains on every fold but
``k`` and is validated on fold ``k``: one batched step trains all K models, as for ``ensemble.size``. Its
training rows are the pool less fold ``k``; where the folds differ in size by a row, a member's set is
topped up with as many of its own rows drawn again (seeded), so that every member takes batches of one
size (:class:`~mlptrain.data.member_loader.MemberLoader`).

Evaluation of the ``val`` split is one batched forward over the pool: every row's out-of-fold prediction
is the output of the member that did not train on it. ``val/...`` are the scores of those predictions
(the cross-validated estimate: best and early stopping of the run follow it), ``member<k>/val/...`` member
``k``'s scores on its fold. With ``early_stopping.patience``, each member stops on its own fold's metric: it
is frozen (no update, :class:`~mlptrain.base.member_settings.MemberSettings`) and its best weights put back. At the end
each member holds its best weights, and the run directory gets ``folds.json`` (each fold's score, their mean
and spread) and ``oof_predictions.csv`` (every pool row's out-of-fold prediction).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
from pathlib import Path
from typing import IO, Any

import numpy as np

from mlptrain.base.errors import CheckpointError, ConfigError
from mlptrain.base.fs import atomic_write, json_ready, spreadsheet_text
from mlptrain.config.schema import DataConfig, TrainConfig
from mlptrain.data import Dataset, stratified_folds
from mlptrain.data.loader import DataLoader
from mlptrain.data.member_loader import MemberLoader
from mlptrain.run.checkpoint import Best
from mlptrain.run.resume import selection
from mlptrain.run.rundir import FOLDS_REPORT, OOF_PREDICTIONS

log = logging.getLogger(__name__)

BEST_PREFIX = "folds/best/"  # the checkpoint's arrays of each member's best weights (Folds.state_dict)


class Folds:
    """The folds of a run and each member's rows; called by the trainer's builder for the members' loaders
    (``member_data`` of :func:`mlptrain.step.build.trainer`)."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.k, self.seed, self.cfg = cfg.ensemble.folds, cfg.seed, cfg
        self.fold: np.ndarray = np.zeros(0, np.int64)  # (N,) the fold of each pool row
        self.y: np.ndarray = np.zeros(0)  # (N,) or (N, T) the pool's targets (host)
        self.fold_device: Any = None
        self.rows: list[np.ndarray] = []  # member k's training rows of the pool (fold k left out; topped up)
        self.best: list[Best] = []
        self.best_state: list[dict[str, np.ndarray] | None] = []
        self.stopped: list[int | None] = []
        self.epoch = 0

    def __call__(
        self, cfg: DataConfig, data: Dataset, xp: Any, dtype: Any, seeds: list[int], train: Any, evaluation: dict
    ) -> tuple[DataLoader, dict]:
        """``(training batches, evaluation loaders)``: member k's loader over its rows in the order of ``seeds[k]``;
        ``val`` the pool in order (its rows' folds in :attr:`fold`), ``test`` as it was."""
        x = np.concatenate([data.x_train[:], data.x_val[:]]) if len(data.x_val) else data.x_train[:]
        y = np.concatenate([data.y_train, data.y_val]) if len(data.y_val) else data.y_train
        strata = y if data.task == "classification" else np.zeros(len(y), np.int64)
        rng = np.random.default_rng(self.seed)
        self.fold, self.y = stratified_folds(strata, self.k, rng), y
        if data.task == "classification":
            self.check_metric(y, data)
        rows = [np.flatnonzero(self.fold != k) for k in range(self.k)]
        most = max(len(r) for r in rows)
        self.rows = [np.concatenate([r, rng.choice(r, most - len(r), replace=False)]) for r in rows]  # one size
        rows = self.rows
        kw = {"xp": xp, "dtype": dtype, "drop_last": cfg.drop_last}
        members = MemberLoader(x, y, cfg.batch_size, seeds=seeds, rows=rows, **kw)  # one copy of the pool
        pool = DataLoader(x, y, cfg.eval_batch_size, shuffle=False, seed=0, **{**kw, "drop_last": False})  # every row
        self.fold_device = xp.asarray(self.fold)
        log.info("%d folds of %s pool rows: %s", self.k, len(y), ", ".join(str(int(n)) for n in np.bincount(self.fold)))
        return members, {"val": pool, **{s: ld for s, ld in evaluation.items() if s != "val"}}

    def check_metric(self, y: np.ndarray, data: Dataset) -> None:
        """A warning for each class of fewer pool rows than folds (some folds hold none of it); ConfigError where
        a fold cannot measure the metric each fold is judged by: ``val/roc_auc`` on a fold whose rows hold one
        class is undefined (NaN), so that fold's best would stay its first epoch's."""
        names = data.class_names or [str(c) for c in range(data.num_classes)]
        for c, n in enumerate(np.bincount(y.astype(np.int64), minlength=data.num_classes)):
            if 0 < n < self.k:
                log.warning(
                    "class %r has %d rows in the pool, fewer than ensemble.folds=%d: %d fold%s none of it, and its "
                    "scores leave that class out (scikit-learn's StratifiedKFold warns alike)",
                    *(names[c], n, self.k, self.k - n, " holds" if self.k - n == 1 else "s hold"),
                )
        metric = selection(self.cfg, True, True, data.num_classes).metric
        if not metric.endswith("/roc_auc"):
            return
        for k in range(self.k):
            if len(found := np.unique(y[self.fold == k])) < 2:
                raise ConfigError(
                    f"early_stopping.metric={metric} is undefined on fold {k} of ensemble.folds={self.k}: its "
                    f"{int((self.fold == k).sum())} rows hold only the class {names[int(found[0])]!r}, and each fold "
                    "is judged by it; use early_stopping.metric=val/loss (or val/log_loss), or fewer folds"
                )

    def out_of_fold(self, tr: Any, scores: type) -> tuple[dict[str, float], Any]:
        """The ``val`` scores: the pool's out-of-fold predictions' (``val/...``) and each member's on its fold
        (``member<k>/val/...``); and the out-of-fold ``(N, C)`` outputs on the host. ``scores``: SplitScores."""
        xp, k, loader = tr.xp, self.k, tr.eval_loaders["val"]
        together, members, outputs = scores(tr), [scores(tr) for _ in range(k)], []
        start = 0
        for x, y in loader.epoch(0):
            b = len(y)
            logits = tr.model.forward(xp.stack([x] * k), keep=False)  # (K, B, C): every member on every row
            fold = self.fold_device[start : start + b]  # (B,)
            oof = logits[fold, xp.arange(b)]  # (B, C): each row from the member that did not train on it
            together.add(oof, y)
            outputs.append(tr.backend.to_host(oof))
            for i in range(k):
                mine = fold == i
                if bool(mine.any()):  # (a host sync, in evaluation only)
                    members[i].add(xp.ascontiguousarray(logits[i][mine]), y[mine])
            start += b
        tr.gemm.release_operands()
        out = together.result("val")
        for i, found in enumerate(members):
            out.update(found.result("val", prefix=f"member{i}/"))
        return out, np.concatenate(outputs)

    def end_epoch(self, tr: Any, found: dict[str, float]) -> dict[str, float]:
        """Each member's best on its fold so far (its weights kept on the host); with ``early_stopping.patience``,
        a member that has not improved for that many epochs is frozen, its best weights put back."""
        es, classification = self.cfg.early_stopping, tr.dataset.task == "classification"
        if not self.best:
            rule = selection(self.cfg, classification, True, tr.widths[-1])
            if not rule.metric.startswith("val/"):  # a training metric: each fold's is judged on its own rows
                rule = Best("val/acc", mode="max") if classification else Best("val/loss", mode="min")
            self.best = [Best(f"member{k}/{rule.metric}", mode=rule.mode) for k in range(self.k)]
            self.best_state, self.stopped = [None] * self.k, [None] * self.k
        state, out = tr.model.state_dict(), {}
        for k, best in enumerate(self.best):
            if self.stopped[k] is not None:
                continue
            value = found[best.metric]
            if best.matches(value):
                improved = self.epoch if best.improves(value, es.min_delta) else best.improved
                self.best[k] = Best(best.metric, value, self.epoch, tr.step_count, best.mode, improved)
                self.best_state[k] = {name: a[k].copy() for name, a in state.items()}
            elif es.patience > 0 and self.epoch - (self.best[k].improved or 0) >= es.patience:
                self.stopped[k] = self.epoch
                tr.optimizer.members.freeze(k)  # (on the GPU: K flags copied to the device, outside the step)
                self.restore(tr, k)
                out[f"member{k}/stopped"] = float(self.epoch + 1)
                log.info("fold %d stopped early after epoch %d (best %s)", k, self.epoch + 1, self.best[k].value)
        self.epoch += 1
        return out

    def state_dict(self, tr: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Each member's tracking, for the checkpoint: arrays ``folds/best/<name>`` (each member's best weights,
        stacked as the parameters, ``(K, out, in)``; a member without a best yet holds its current weights) and
        the meta ``{"epoch": epochs ended, "best": [each fold's Best], "stopped": [epoch or null]}``."""
        if not self.best:  # no epoch has ended yet: nothing tracked
            return {}, {"epoch": self.epoch, "best": [], "stopped": [], "deal": self.deal()}
        now = tr.model.state_dict()  # (host copies)
        arrays = {
            f"{BEST_PREFIX}{name}": np.stack([a[k] if s is None else s[name] for k, s in enumerate(self.best_state)])
            for name, a in now.items()
        }
        meta = {"epoch": self.epoch, "best": [b.__dict__ for b in self.best], "stopped": list(self.stopped)}
        return arrays, {**meta, "deal": self.deal()}

    def deal(self) -> dict[str, Any]:
        """What the folds were dealt from: the pool's rows and a digest of each row's fold (``fold (N,)``), so that
        a resume on data that deals other folds (the data file changed) is refused, not mixed with the old bests."""
        digest = hashlib.sha256(np.ascontiguousarray(self.fold, dtype=np.int64).tobytes()).hexdigest()[:16]
        return {"rows": int(len(self.fold)), "sha256": digest}

    def load_state_dict(
        self, tr: Any, arrays: dict[str, np.ndarray], meta: dict[str, Any] | None, epoch: int, where: str
    ) -> None:
        """Continue the tracking of :meth:`state_dict` (a stopped member frozen again); ``meta`` None: a checkpoint
        written before it was kept, whose tracking starts again at ``epoch`` (the checkpoint's position).

        Raises:
            CheckpointError: the tracking is not of this run's K folds, or a member's best weights are missing
                or misshapen.
        """
        _check_state(tr, arrays, meta, self.k, where)
        if meta is not None and meta.get("deal") not in (None, self.deal()):  # (a checkpoint before it: not kept)
            was, now = meta["deal"], self.deal()
            raise CheckpointError(
                f"{where} trained folds dealt from {was['rows']} pool rows (fold digest {was['sha256']}); the data now "
                f"deals {now['rows']} rows into other folds (digest {now['sha256']}): the data changed since the run "
                "started. Resume with the data it started with, or start a new run (another hydra.run.dir)"
            )
        if meta is None:
            log.warning(
                "this checkpoint of a %d-fold cross-validation was written before each fold's best was saved: each "
                "fold's best and early stopping start again from epoch %d (the result may differ from an "
                "uninterrupted run's)",
                *(self.k, epoch + 1),
            )
            self.epoch, self.best, self.best_state, self.stopped = epoch, [], [], []
            return
        self.epoch = int(meta["epoch"])
        self.best = [Best(**b) for b in meta["best"]]
        self.stopped = list(meta["stopped"])
        self.best_state = [
            None if b.value is None else {n[len(BEST_PREFIX) :]: a[k].copy() for n, a in arrays.items()}
            for k, b in enumerate(self.best)
        ]
        members = tr.optimizer.members
        for k, stopped in enumerate(self.stopped):
            if stopped is not None and members is not None:
                members.freeze(k)  # its weights in the checkpoint are its best, put back when it stopped; on the GPU
                # the flags reach the device array the update kernel reads

    def restore(self, tr: Any, k: int) -> None:
        """Member ``k``'s best weights, back into its slice of the stacked parameters."""
        best = self.best_state[k] if self.best_state else None
        if best is None:
            return
        for p in tr.model.params:
            p.value[k] = tr.xp.asarray(best[p.name])
            p.sync_compute()

    def finish(self, tr: Any, scores: type, out_dir: Path) -> dict[str, Any]:
        """Every member's best weights back; ``folds.json`` and ``oof_predictions.csv`` written into ``out_dir``."""
        for k in range(self.k):
            self.restore(tr, k)
        found, outputs = self.out_of_fold(tr, scores)
        values = [float(b.value) for b in self.best if b.value is not None]
        report = {
            "metric": self.best[0].metric.split("/", 1)[1] if self.best else None,
            "folds": [
                {"fold": k, "value": b.value, "epoch": _one_based(b.epoch), "stopped": _one_based(s)}
                for k, (b, s) in enumerate(zip(self.best, self.stopped, strict=True))
            ],
            "mean": float(np.mean(values)) if values else None,
            "std": float(np.std(values)) if values else None,
            "out_of_fold": found,
        }
        atomic_write(out_dir / FOLDS_REPORT, json.dumps(json_ready(report), indent=1, allow_nan=False) + "\n")
        self.write_predictions(tr, outputs, out_dir / OOF_PREDICTIONS)
        log.info(
            "%d-fold cross-validation: %s %.4g +- %.4g (folds: %s)",
            *(self.k, report["metric"], report["mean"] or 0, report["std"] or 0, ", ".join(f"{v:.4g}" for v in values)),
        )
        return report

    def write_predictions(self, tr: Any, outputs: np.ndarray, path: Path) -> None:
        """``row`` (of the pool: the training rows, then the validation rows), ``fold``, the target and the
        out-of-fold prediction: a class and its probabilities, or a regression's outputs in the targets' units.
        Written whole (:func:`~mlptrain.base.fs.atomic_write`: a link in its place is replaced, never followed),
        row by row into its temporary file (a pool of millions of rows is never one string in memory)."""

        def write(binary: IO[bytes]) -> None:
            text = io.TextIOWrapper(binary, encoding="utf-8", newline="")
            try:
                self._rows(csv.writer(text), tr.dataset, outputs)
            finally:
                text.flush()
                text.detach()  # the file is atomic_write's to close

        atomic_write(path, write)

    def _rows(self, w: Any, ds: Any, outputs: np.ndarray) -> None:
        """The rows of :meth:`write_predictions` into the csv writer ``w``."""
        if ds.task == "classification":
            e = np.exp(outputs - outputs.max(axis=1, keepdims=True))
            p = e / e.sum(axis=1, keepdims=True)
            names = ds.class_names or [str(c) for c in range(p.shape[1])]
            w.writerow(["row", "fold", "target", "prediction", *(f"p_{n}" for n in names)])
            for i, (fold, y, probs) in enumerate(zip(self.fold, self.y, p, strict=True)):
                label, predicted = (spreadsheet_text(names[int(c)]) for c in (y, probs.argmax()))
                w.writerow([i, fold, label, predicted, *(f"{v:.6g}" for v in probs)])
            return
        ts = ds.target_scaling
        values = outputs if ts is None else ts.undo(outputs)
        targets = self.y if ts is None else ts.undo(self.y)
        names = ds.target_names or [str(t) for t in range(values.shape[1])]
        w.writerow(["row", "fold", *(f"target_{n}" for n in names), *(f"prediction_{n}" for n in names)])
        for i, (fold, y, v) in enumerate(zip(self.fold, targets, values, strict=True)):
            w.writerow([i, fold, *(f"{t:.6g}" for t in y), *(f"{t:.6g}" for t in v)])


def _check_state(tr: Any, arrays: dict[str, np.ndarray], meta: dict[str, Any] | None, k: int, where: str) -> None:
    """Raise CheckpointError unless ``meta`` tracks K folds and ``arrays`` hold each parameter's best weights."""
    if meta is None or not meta["best"]:
        return
    if len(meta["best"]) != k or len(meta["stopped"]) != k:
        raise CheckpointError(
            f"{where} tracks {len(meta['best'])} folds' bests and {len(meta['stopped'])} stops; this run has {k} folds"
        )
    for p in tr.model.params:
        a = arrays.get(f"{BEST_PREFIX}{p.name}")
        if a is None or a.shape != tuple(p.value.shape):
            found = "none" if a is None else f"{a.dtype}{list(a.shape)}"
            raise CheckpointError(
                f"{where}: the folds' best weights {BEST_PREFIX}{p.name} are {found}, expected {list(p.value.shape)}"
            )


def _one_based(epoch: int | None) -> int | None:
    return None if epoch is None else epoch + 1
