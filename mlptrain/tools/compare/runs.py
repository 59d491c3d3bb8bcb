"""The runs of a comparison sweep: each job's record and metrics, read and checked.

A comparison is a Hydra multirun (``conf/compare.yaml``) that trains the same model with the same
seed and data order once per value of one config key, its axis (:mod:`.axis`): the execution mode
for ``make compare``, the precision for ``conf/compare_fp8.yaml``. :func:`load_runs` reads every job
directory (``run.json`` and ``metrics.jsonl``, see :mod:`mlptrain.run.metrics`), checks that the runs are
complete and comparable, and pairs the two runs of each seed (fused and naive, fp8 and bf16). A problem is one
:class:`CompareError` naming the run directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlptrain.config.schema import flatten
from mlptrain.run.metrics import read_metrics
from mlptrain.tools.compare.axis import ALWAYS_SWEPT, EXECUTION, Axis, CompareError, choose_axis

MODES = EXECUTION.arms
# Keys that may differ between the runs of a fused-vs-naive comparison; another axis replaces execution.mode.
SWEPT_KEYS = (EXECUTION.key, *ALWAYS_SWEPT)


@dataclass
class Run:
    """One training run of the sweep: its record and its metrics by kind."""

    path: Path
    record: dict[str, Any]  # run.json
    steps: list[dict[str, Any]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None

    @property
    def config(self) -> dict[str, Any]:
        return self.record["config"]

    @property
    def mode(self) -> str:
        return self.config["execution"]["mode"]

    @property
    def seed(self) -> int:
        return int(self.config["seed"])

    @property
    def precision(self) -> str:
        return self.config["precision"]["name"]

    def losses(self) -> np.ndarray:
        """Training loss of every step, ``(steps,)`` float64 (NaN where it was not finite)."""
        return np.array([np.nan if r["train/loss"] is None else r["train/loss"] for r in self.steps], dtype=float)

    def timed_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """``(step_time_ms, samples_per_s)`` of the log intervals that time training alone.

        The trainer times each interval of ``log_every`` steps and writes the numbers on its last
        step. Skipped: the first interval (warm-up: planning, kernel compilation, first touches)
        and any interval that crosses an epoch boundary (its timer restarts after evaluation
        while its sample count does not).
        """
        ms, sps = [], []
        start, first = 0, True
        for i, rec in enumerate(self.steps):
            if rec.get("step_time_ms") is None:
                continue
            if not first and self.steps[start]["epoch"] == rec["epoch"]:
                ms.append(rec["step_time_ms"])
                sps.append(rec["samples_per_s"])
            first, start = False, i + 1
        return np.array(ms, dtype=float), np.array(sps, dtype=float)


# --------------------------------------------------------------------------- loading and checks


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` (:func:`mlptrain.run.metrics.read_metrics`: a torn last line is dropped)."""
    try:
        return read_metrics(path)
    except ValueError as exc:
        raise CompareError(str(exc)) from None


def find_run_dirs(sweep_dir: Path) -> list[Path]:
    """Job directories under ``sweep_dir``: those holding run.json, metrics.jsonl or Hydra's .hydra/."""
    found: set[Path] = set()
    for pattern in ("run.json", "metrics.jsonl", ".hydra"):
        found.update(p.parent for p in sweep_dir.rglob(pattern) if ".hydra" not in p.parent.parts)
    return sorted(found)


def load_run(path: Path) -> Run:
    """Read one job directory. Raises CompareError if a file is missing or unreadable."""
    if not (path / "run.json").is_file():
        raise CompareError(
            f"run {path} is incomplete: it has no run.json (the job failed before training; see its mlptrain.log)"
        )
    if not (path / "metrics.jsonl").is_file():
        raise CompareError(f"run {path} is incomplete: it has no metrics.jsonl")
    try:
        record = json.loads((path / "run.json").read_text(encoding="utf-8"))
        run = Run(path, record)
        _ = (run.mode, run.seed, run.precision)  # the keys must be there
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CompareError(
            f"run {path}: run.json is not an mlptrain run record ({type(exc).__name__}: {exc})"
        ) from None
    for rec in read_jsonl(path / "metrics.jsonl"):
        kind = rec.get("kind")
        if kind == "step":
            run.steps.append(rec)
        elif kind == "epoch":
            run.epochs.append(rec)
        elif kind == "summary":
            run.summary = rec
    run.steps.sort(key=lambda r: r["step"])
    return run


def check_runs(runs: list[Run], sweep_dir: Path, axis: str | None = None) -> dict[int, dict[str, Run]]:
    """Check that the runs are complete and comparable; return them as ``{seed: {arm: run}}``.

    The arms are the two values of the comparison's axis (:func:`mlptrain.tools.compare.axis.choose_axis`:
    ``axis`` as ``--axis`` gives it, else the one config key the runs differ in), candidate first:
    ``{seed: {"fused": run, "naive": run}}`` for ``make compare``, ``{seed: {"fp8": run, "bf16": run}}``
    for ``conf/compare_fp8.yaml``.

    Raises:
        CompareError: one message for the first problem found, naming the run directory.
    """
    if not runs:
        raise CompareError(
            f"no runs in {sweep_dir}: expected job directories with run.json and metrics.jsonl "
            "(made by `make compare` or `python -m mlptrain --config-name compare`)"
        )
    for run in runs:
        if run.summary is None:
            raise CompareError(
                f"run {run.path} is incomplete: metrics.jsonl has {len(run.steps)} step records and no summary "
                "record (the run did not finish; run the comparison again)"
            )
    ax, defaulted = choose_axis([r.config for r in runs], sweep_dir, axis)
    by_seed = pair_by_seed(runs, ax, sweep_dir, defaulted)
    check_same_experiment(runs, ax)
    return dict(sorted(by_seed.items()))


def pair_by_seed(runs: list[Run], ax: Axis, sweep_dir: Path, defaulted: bool) -> dict[int, dict[str, Run]]:
    """``{seed: {candidate: run, reference: run}}``, in the axis's order; every run has a partner."""
    key = ax.key
    for run in runs:
        if ax.value(run.config) not in ax.arms:
            raise CompareError(
                f"run {run.path} has {key}={ax.value(run.config)!r}; expected one of {ax.arms}"
                + (" (this comparison pairs them; --axis names other values)" if key != EXECUTION.key else "")
            )
    for arm in ax.arms:
        if not any(ax.value(r.config) == arm for r in runs):
            other = ", ".join(sorted(str(r.path.name) for r in runs))
            nothing = (
                "; nor does any other config key than the seed differ between the runs: nothing to compare"
                if defaulted
                else ""
            )
            raise CompareError(
                f"no {arm} run in {sweep_dir} (found only: {other}); the comparison needs both "
                f"{ax.name}={ax.arms[0]} and {ax.name}={ax.arms[1]}{nothing}"
            )
    by_seed: dict[int, dict[str, Run]] = {}
    for run in runs:
        slot, value = by_seed.setdefault(run.seed, {}), ax.value(run.config)
        assert value is not None  # checked above
        if value in slot:
            raise CompareError(
                f"runs {slot[value].path} and {run.path} are both {value} with seed {run.seed}; "
                "give each comparison its own sweep directory"
            )
        slot[value] = run
    for seed, slot in sorted(by_seed.items()):
        for arm in ax.arms:
            if arm not in slot:
                (have,) = slot.values()
                raise CompareError(
                    f"seed {seed} has a {ax.value(have.config)} run ({have.path}) but no {arm} run to pair it with"
                )
    return {seed: {arm: slot[arm] for arm in ax.arms} for seed, slot in by_seed.items()}


def check_same_experiment(runs: list[Run], ax: Axis) -> None:
    """Every run as long as the longest, and only the axis and the seed vary between them."""
    ref = max(runs, key=lambda r: (len(r.steps), len(r.epochs)))
    for run in runs:
        if len(run.steps) != len(ref.steps) or len(run.epochs) != len(ref.epochs):
            raise CompareError(
                f"run {run.path} is incomplete: it has {len(run.steps)} step and {len(run.epochs)} epoch records, "
                f"its peers have {len(ref.steps)} and {len(ref.epochs)} ({ref.path})"
            )
        if [r["step"] for r in run.steps] != list(range(len(run.steps))):
            raise CompareError(f"run {run.path}: its step records are not numbered 0..{len(run.steps) - 1}")
    swept = (ax.key, *ALWAYS_SWEPT)
    ref_cfg = {k: v for k, v in flatten(ref.config).items() if k not in swept}
    for run in runs:
        cfg = {k: v for k, v in flatten(run.config).items() if k not in swept}
        for key in sorted(set(ref_cfg) | set(cfg)):
            if ref_cfg.get(key) != cfg.get(key):
                raise CompareError(
                    f"runs {ref.path} and {run.path} differ in {key} ({ref_cfg.get(key)!r} vs {cfg.get(key)!r}); "
                    f"a comparison may vary only {ax.name} and seed"
                )
        if run.record.get("device") != ref.record.get("device"):
            raise CompareError(
                f"runs {ref.path} and {run.path} ran on different devices "
                f"({ref.record.get('device')!r} vs {run.record.get('device')!r})"
            )


def load_runs(sweep_dir: Path, axis: str | None = None) -> dict[int, dict[str, Run]]:
    """Load and check every run of a sweep: ``{seed: {"fused": Run, "naive": Run}}``, or the arms of
    ``axis`` (``--axis``; by default the key the runs differ in, :func:`check_runs`).

    Raises:
        CompareError: the directory, a run or a file is missing, a run is incomplete, or the runs
            are not one comparison.
    """
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise CompareError(f"sweep directory {sweep_dir} does not exist")
    return check_runs([load_run(p) for p in find_run_dirs(sweep_dir)], sweep_dir, axis)
