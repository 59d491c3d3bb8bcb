"""Many models in one run: the trainer of an ensemble (``ensemble.size=K``, ``ensemble.folds=K``).

``K`` members of one shape train as one batched step (:class:`EnsembleTrainer`). The step is the
:class:`~mlptrain.step.trainer.Trainer`'s: :func:`mlptrain.step.build.trainer` builds its parts for the
members (:class:`~mlptrain.nn.batched.BatchedMLP`, whose every GEMM is batched over them;
:class:`~mlptrain.nn.members.MemberHead`, each member's loss; a :class:`~mlptrain.data.member_loader.MemberLoader`,
each member's batches in the order of its single run), and the optimizer updates the stacked
parameters as it updates one model's (its rules are elementwise). Member ``k`` is the single run of seed
``seed + k``: its initial weights and its data order are that run's, and on the CPU its per-step losses
are that run's bit for bit (``tests/test_ensemble.py``).

What the ensemble adds is around the step: each member's training loss and count, summed per epoch;
each split scored for every member and for the ensemble (the members' mean probability, or mean
output: :func:`mlptrain.nn.members.ensemble_logits`); the member count in the checkpoint.
metrics.jsonl holds the ensemble's scores under the usual keys (``val/acc``: best and early stopping
follow the ensemble) and each member's under ``member<k>/`` (``member0/val/acc``); ``members.md`` tabulates
them at the end. Cross-validation's folds are :mod:`mlptrain.run.folds`'s; what an ensemble refuses is
checked with the config (:func:`mlptrain.step.checks.check_ensemble`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.base.backend import get_backend
from mlptrain.base.cuda_source import Job
from mlptrain.base.errors import OutputError
from mlptrain.base.fs import atomic_write
from mlptrain.base.member_settings import MemberSettings
from mlptrain.config.schema import TrainConfig
from mlptrain.data import Dataset
from mlptrain.nn.members import ensemble_logits, mean_of_probabilities
from mlptrain.run.folds import BEST_PREFIX, Folds
from mlptrain.run.rundir import MEMBERS_TABLE
from mlptrain.step.checks import check_ensemble
from mlptrain.step.memory import members_fit
from mlptrain.step.schedule import lr_at
from mlptrain.step.trainer import SplitScores, Trainer

log = logging.getLogger(__name__)


class EnsembleTrainer(Trainer):
    """The step of ``cfg.ensemble.size`` members, and their metrics and scores (see the module docstring).

    :meth:`step` returns the members' ``(loss (K,), correct (K,))``; the step log records their mean.
    """

    def __init__(
        self, cfg: TrainConfig, dataset: Dataset | None = None, backend: Any = None, *, comm: Any = None, **kw: Any
    ) -> None:
        check_ensemble(cfg, comm is not None)
        backend = backend or get_backend(cfg.device.value)
        members_fit(cfg, backend.device)  # K members that cannot fit in the host's memory: refused, not built
        self.folds = Folds(cfg) if cfg.ensemble.folds else None  # cross-validation (mlptrain.run.folds)
        self.last_val: dict[str, float] = {}
        kw = {"member_data": self.folds, **kw} if self.folds is not None else kw  # (or the caller's member_data)
        super().__init__(cfg, dataset, backend, comm=comm, **kw)
        k = self.members
        self.member_loss = self.xp.zeros(k, dtype=self.xp.float64)  # this epoch's sum of loss x rows, per member
        self.member_correct = self.xp.zeros(k, dtype=self.xp.int64)
        self.member_rows = 0
        self._set_members(cfg)

    def _set_members(self, cfg: TrainConfig) -> None:
        """Per-member learning rates and weight decay (``ensemble.lr``, ``ensemble.weight_decay``) and per-fold
        stopping: the optimizer updates each member with its own (the CPU member by member, the GPU in its one
        kernel: :class:`~mlptrain.base.member_settings.MemberSettings`). Once: the first call sets them."""
        e, k = cfg.ensemble, self.members
        self.member_lr = [float(v) for v in (e.lr or [cfg.optimizer.lr] * k)]
        self.member_decay = [float(v) for v in (e.weight_decay or [cfg.optimizer.weight_decay] * k)]
        stopping = e.folds and cfg.early_stopping.patience > 0  # each fold's member stops on its own
        if (e.lr is None and e.weight_decay is None and not stopping) or self.optimizer.members is not None:
            return
        self.optimizer.members = MemberSettings(self.xp, cfg.optimizer.lr, self.member_lr, self.member_decay)

    def precompile_jobs(self) -> list[Job]:
        """The step's kernels compiled ahead, the update in its per-member form (the trainer submits them as soon
        as its parts are built, so the member settings are made here first), and the members' tally of
        :meth:`step_metrics` on the GPU."""
        self._set_members(self.cfg)
        jobs = super().precompile_jobs()
        if self.backend.is_gpu:
            from mlptrain.nn.cuda.members import tally_job

            loss_dtype = np.float64 if np.dtype(self.precision.compute_dtype) == np.float64 else np.float32
            jobs.append(tally_job(self.members, loss_dtype, self.train_loader.row_counts()[0]))
        return jobs

    def step(self, x: Any, y: Any) -> tuple[Any, Any]:
        """One step of every member; with per-member rates on the CPU, each member's rate of this step is its single
        run's (the schedule at this step count from its own ``lr``), set on the host before the step. (The GPU's
        kernel multiplies the step's scheduled rate by each member's ratio: the schedule is linear in its base.)"""
        members = self.optimizer.members
        if members is not None and not self.backend.is_gpu:
            kw = self.schedule.kw
            members.lr = [lr_at(self.clock.n, **{**kw, "base_lr": base}) for base in self.member_lr]
        self.member_rows += self.batch_rows(y)  # on the host: a replayed CUDA graph runs no Python
        return super().step(x, y)

    def batch_rows(self, y: Any) -> int:
        return int(y.shape[1])  # y (K, B) or (K, B, T)

    def step_metrics(self, loss: Any, correct: Any, rows: int) -> tuple[Any, Any]:
        """Each member's loss and count summed for the epoch (on the device); the step log gets the members' mean
        loss and their mean count, rounded to a whole row (each member's exact count is in ``member<k>/``).

        On the GPU one kernel of K threads does it all, ``mlptrain_member_tally``
        (:func:`mlptrain.nn.cuda.members.tally_members`: captured with the step, replayed with it), where the
        array operations below, its formula, are a launch each; it runs behind the members' means on their own
        stream, beside the backward (:class:`mlptrain.nn.cuda.members.MemberSums`)."""
        if self.backend.is_gpu:
            from mlptrain.nn.cuda.members import tally_members

            sums = getattr(self.head, "sums", None)  # (a MemberHead's, once it has stepped)
            tally = tally_members if sums is None else sums.tally
            return tally(loss, correct, rows, self.member_loss, self.member_correct)
        self.member_loss += loss * rows
        self.member_correct += correct
        k = self.members
        return loss.mean(), (correct.sum() + k // 2) // k

    def epoch_extras(self) -> dict[str, float]:
        """Each member's training loss (and accuracy) over the epoch's steps, ``member<k>/train/...``; the sums
        start again for the next epoch (reads them back: syncs the device)."""
        rows = max(self.member_rows, 1)
        loss, correct = self.backend.to_host(self.member_loss), self.backend.to_host(self.member_correct)
        out: dict[str, float] = {}
        swept = self.optimizer.members is not None
        for k in range(self.members):
            if swept:  # a batched sweep: the values each member trains with
                out[f"member{k}/lr"], out[f"member{k}/weight_decay"] = self.member_lr[k], self.member_decay[k]
            out[f"member{k}/train/loss"] = float(loss[k]) / rows
            if self.dataset.task == "classification":
                out[f"member{k}/train/acc"] = int(correct[k]) / rows
        if self.folds is not None and self.last_val:  # each fold's best (and early stopping)
            out.update(self.folds.end_epoch(self, self.last_val))
        self.member_loss[...] = 0
        self.member_correct[...] = 0
        self.member_rows = 0
        return out

    def evaluate(self, split: str) -> dict[str, float]:
        """The ensemble's scores (``val/acc``, ...) and each member's (``member<k>/val/acc``, ...) on ``split``:
        one batched forward per batch, every member on the same rows."""
        self.runtime.finish_precompile()
        if self.folds is not None and split == "val":  # cross-validation: the out-of-fold predictions' scores
            self.last_val = self.folds.out_of_fold(self, SplitScores)[0]
            return self.last_val
        xp, k = self.xp, self.members
        probabilities = mean_of_probabilities(self.dataset.task, self.cfg.model.loss)  # (mse on classes: outputs)
        members = [SplitScores(self) for _ in range(k)]
        together = SplitScores(self)
        for x, y in self.eval_loaders[split].epoch(0):
            logits = self.model.forward(xp.stack([x] * k), keep=False)  # (K, B, in) -> (K, B, C)
            for found, member_logits in zip(members, logits, strict=True):
                found.add(member_logits, y)
            together.add(ensemble_logits(logits, probabilities).astype(logits.dtype), y)
        self.gemm.release_operands()
        out = together.result(split)
        for i, found in enumerate(members):
            out.update(found.result(split, prefix=f"member{i}/"))
        return out

    def finish(self, out_dir: Path, summary: dict[str, Any]) -> None:
        """After the last epoch: ``members.md``, a table of each member's settings and last scores (``summary``: the
        run's last record), and cross-validation's report and out-of-fold predictions (:meth:`Folds.finish`).
        Written before the run's summary record (:meth:`mlptrain.run.loop.Loop.summary`): a run stopped here is
        finished by its resume, which writes them again.

        Raises:
            OutputError: a report cannot be written (a full disk); ``resume=last`` writes them once it can.
        """
        try:
            if self.folds is not None and self.folds.best:
                self.folds.finish(self, SplitScores, out_dir)
            atomic_write(out_dir / MEMBERS_TABLE, self.members_table(summary))  # (a link is replaced, not followed)
        except OSError as exc:
            raise OutputError(
                f"cannot write the reports of the ensemble in {out_dir} ({type(exc).__name__}: {exc}); mend that (a "
                "full disk, the folder's permissions), then resume=last writes them (the run's checkpoints are kept)"
            ) from exc

    def members_table(self, summary: dict[str, Any]) -> str:
        """Markdown: one row per member (its seed, learning rate, weight decay, fold) and its scores in ``summary``
        (``member<k>/val/acc`` ...), then the ensemble's row (the run's own ``val/acc`` ...)."""
        names = [f"{split}/{score}" for split in ("val", "test") for score in ("loss", "acc", "rmse", "r2")]
        names = [n for n in names if f"member0/{n}" in summary]
        head = ["member", "seed", "lr", "weight_decay", *(["fold"] if self.folds else []), *names]
        rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for k in range(self.members):
            cells = [str(k), str(self.cfg.seed + k), f"{self.member_lr[k]:g}", f"{self.member_decay[k]:g}"]
            cells += [str(k)] if self.folds else []
            cells += [_cell(summary.get(f"member{k}/{n}")) for n in names]
            rows.append("| " + " | ".join(cells) + " |")
        together = ["the ensemble", "", "", "", *(["out of fold"] if self.folds else [])]  # (test/: the ensemble's)
        rows.append("| " + " | ".join([*together, *(_cell(summary.get(n)) for n in names)]) + " |")
        return "\n".join(rows) + "\n"

    def state_dict(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The trainer's state (parameters stacked: ``param/layer0.weight (K, out, in)``), with ``members: K``."""
        arrays, meta = super().state_dict()
        meta["members"] = self.members
        arrays[MEMBER_LOSS] = self.backend.to_host(self.member_loss)  # this epoch's sums so far (a resume mid-epoch)
        arrays[MEMBER_CORRECT] = self.backend.to_host(self.member_correct)
        if self.folds is not None:  # each fold's best so far, its weights and whether it stopped (resume continues it)
            fold_arrays, meta["folds"] = self.folds.state_dict(self)
            arrays.update(fold_arrays)
        return arrays, meta

    def load_state_dict(self, arrays: dict[str, np.ndarray], meta: dict[str, Any], *, step: int, where: str) -> None:
        """The trainer's state, then cross-validation's tracking of each fold (:meth:`Folds.load_state_dict`)."""
        mine = {n: a for n, a in arrays.items() if n.startswith(BEST_PREFIX)}
        sums = {n: arrays[n] for n in (MEMBER_LOSS, MEMBER_CORRECT) if n in arrays}  # (absent before they were kept)
        rest = {n: a for n, a in arrays.items() if n not in mine and n not in sums}
        super().load_state_dict(rest, meta, step=step, where=where)
        if len(sums) == 2 and all(a.shape == (self.members,) for a in sums.values()):
            self.member_loss[...] = self.xp.asarray(sums[MEMBER_LOSS])
            self.member_correct[...] = self.xp.asarray(sums[MEMBER_CORRECT])
            self.member_rows = int(meta.get("position", {}).get("samples", 0))  # each member's rows of the epoch so far
        if self.folds is not None:
            epoch = meta.get("position", {}).get("epoch", 0)
            self.folds.load_state_dict(self, mine, meta.get("folds"), epoch, where)


# The checkpoint's each member's training loss x rows and correct count of the epoch so far, (K,) (EnsembleTrainer)
MEMBER_LOSS, MEMBER_CORRECT = "members/loss_sum", "members/correct"


def _cell(value: Any) -> str:
    return "" if value is None else f"{value:.4g}"
