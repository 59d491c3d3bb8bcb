"""Two arms side by side (fused vs naive, fp8 vs bf16): read a comparison sweep and write its figure,
table and numbers.

``make compare`` trains the same model with the same seed and data order twice, once with the
epilogs fused into the GEMMs (``execution=fused``) and once with plain GEMMs and separate
kernels (``execution=naive``), through the Hydra multirun of ``conf/compare.yaml``; then it runs
this report on the sweep directory::

    python -m mlptrain.compare runs/compare/2026-11-30_12-00-00 [--out DIR]

It reads every job directory (:mod:`.runs`), checks that the runs are complete and comparable,
finds what they compare (:mod:`.axis`: the one config key besides the seed that differs, or
``--axis precision``), pairs the two runs of each seed (fused and naive; fp8 and bf16 for
``conf/compare_fp8.yaml``, whose report adds whether the paired accuracy difference's 95 %
interval lies inside half a point, :mod:`.arms`), computes the numbers (:mod:`.summary`, with the
statistics of :mod:`.stats`), and writes into the sweep directory (or ``--out``):

* ``compare.png`` (:mod:`.figure`): training loss per step (mean over seeds, min-max band), test
  accuracy per epoch, the per-step relative loss difference |fused - naive| / |naive| (a running
  median per seed, beside the same measure between two seeds of naive, and the precision's
  tolerance), and samples per second of each mode;
* ``compare.md`` (:mod:`.report`): the table (final loss and accuracy per mode, largest loss
  difference, time per step, speedup) and the commands that made it;
* ``compare.json``: the same numbers.

A run that is missing or incomplete stops the command with one line ``error: <message>`` naming
the run directory, and exit status 2 (:class:`CompareError`).

Several comparisons (one folder each, as ``scripts/compare.sh --suite gpu`` makes them for docs/compare-gpu/)
get one index (:mod:`.index`)::

    python -m mlptrain.compare --index docs/compare-gpu [--made-by "scripts/compare.sh ..."] [--note FILE]
"""

from mlptrain.tools.compare.axis import EXECUTION, Axis, choose_axis, differing_keys
from mlptrain.tools.compare.cli import main
from mlptrain.tools.compare.figure import plot
from mlptrain.tools.compare.index import Panel, index_markdown, load_panels, write_index
from mlptrain.tools.compare.report import (
    accuracy_gap,
    commands,
    divergence_cells,
    divergence_header,
    first_step_above,
    gap_cell,
    half_precision_note,
    title,
    verdict,
    verdict_cell,
    write_markdown,
)
from mlptrain.tools.compare.runs import MODES, CompareError, Run, check_runs, find_run_dirs, load_run, load_runs
from mlptrain.tools.compare.stats import (
    T95,
    interval_within,
    paired_difference,
    relative_difference,
    running_median,
    t95,
)
from mlptrain.tools.compare.summary import ACCURACY_BOUND, DIVERGENCE_THRESHOLDS, TOLERANCES, axis_of, summarize

__all__ = [
    "ACCURACY_BOUND",
    "DIVERGENCE_THRESHOLDS",
    "EXECUTION",
    "MODES",
    "T95",
    "TOLERANCES",
    "Axis",
    "CompareError",
    "Panel",
    "Run",
    "accuracy_gap",
    "axis_of",
    "choose_axis",
    "check_runs",
    "commands",
    "differing_keys",
    "divergence_cells",
    "divergence_header",
    "find_run_dirs",
    "first_step_above",
    "gap_cell",
    "half_precision_note",
    "index_markdown",
    "interval_within",
    "load_panels",
    "load_run",
    "load_runs",
    "main",
    "paired_difference",
    "plot",
    "relative_difference",
    "running_median",
    "summarize",
    "t95",
    "title",
    "verdict",
    "verdict_cell",
    "write_index",
    "write_markdown",
]
