#!/usr/bin/env bash
# docs/compare-fp8/ in one command (issue #30): FP8 against bf16, five seeds, on MNIST-1D and on a
# wide synthetic task, both fused, graph mode on, on a GPU of compute capability 8.9+ (H100, H200).
#
#   scripts/compare_fp8.sh OUT_DIR [--smoke] [--tasks "mnist1d wide"] [--tar FILE] [-- key=value ...]
#
# For each task it runs one Hydra multirun (one process: precision=bf16,fp8 x seed=0..4):
#   * mnist1d:     conf/compare_fp8.yaml, 40-256-256-10, AdamW, warm-up then cosine, 840 steps;
#   * wide:        conf/compare_fp8_wide.yaml, 32-4096-4096-4096-10 at a batch of 8192, 273 steps;
#   * mnist1d-50k: conf/compare_fp8_mnist1d_50k.yaml, the mnist1d recipe on a 50,000-sample draw of
#                  MNIST-1D (data.samples=50000), 30 epochs, 8,430 steps; not a default task (--tasks).
# then `python -m mlptrain.compare SWEEP --axis precision=fp8,bf16` on each (the figure, the table
# with the paired final-accuracy difference and its 95 % interval against half a point), and
# results.md, one row per task. Everything lands under OUT_DIR, laid out as in the repository (run
# from inside OUT_DIR, so the commands recorded in the reports are the ones to type at the root):
#
#   OUT_DIR/docs/compare-fp8/<task>/compare.{png,md,json}   the report of each task
#   OUT_DIR/docs/compare-fp8/results.md                     the tasks' numbers, for README.md
#   OUT_DIR/runs/compare-fp8/<task>/                        the sweeps (metrics; checkpoints removed)
#   OUT_DIR/compare_fp8.log                                 what ran, and how long each part took
#
# Jobs: 2 tasks x 10 = 20 training runs in 2 processes, then 2 reports. Planned for one H200: the
# MNIST-1D sweep about 30 s (10 jobs of 840 replayed steps, about 2 s each, plus start-up, drawing
# MNIST-1D and compiling the FP8 cast kernels on a fresh machine), the wide sweep about 2 minutes (per
# job: 26 M normal numbers drawn, 273 steps of about 4 ms, 400 MB checkpoints written and removed
# once the sweep is done), each report about 3 s: about 3 minutes in all; it must stay under 6.
# compare_fp8.log has each part's time.
#
# Options:
#   --smoke        the same recipe on the CPU, small: device=cpu, fp8 (emulated through the NumPy FP8
#                  contract) against fp32, since the CPU has no bf16; 2 seeds, 2 epochs of MNIST-1D (of a
#                  10,000-sample draw for mnist1d-50k), a 64-64 wide model on 20,000 samples (checks the
#                  recipe end to end, not FP8's accuracy)
#   --tasks        which tasks (default: "mnist1d wide"; also mnist1d-50k: 10 jobs of 8,430 steps, 10
#                  times the mnist1d sweep's, 48 s on an H200 with its report, 2026-12-04)
#   --tar FILE     also pack docs/, runs/ and the log into FILE (.tar.gz)
#   -- key=value   more overrides for every sweep (e.g. -- seed=0,1,2,3,4,5,6,7,8,9 for ten seeds)
# Environment: PYTHON (default python3) runs mlptrain and the reports; it needs mlptrain's stack,
# mnist1d (the datasets extra) and matplotlib. The exit status is 0 when every part succeeded, 1 if one
# failed (the others still run; the log names it), 2 on a usage or environment error.
set -uo pipefail

usage() { sed -n '2,/^set -uo/{s/^# \{0,1\}//p;}' "$0"; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
SMOKE=0
TASKS="mnist1d wide"
TAR=""
OUT_DIR=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --smoke) SMOKE=1 ;;
    --tasks) TASKS="${2:?--tasks needs a value}"; shift ;;
    --tar) TAR="${2:?--tar needs a file}"; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) echo "compare_fp8.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
    *) if [ -n "$OUT_DIR" ]; then echo "compare_fp8.sh: one OUT_DIR only (got $OUT_DIR and $1)" >&2; exit 2; fi
       OUT_DIR="$1" ;;
  esac
  shift
done
if [ -z "$OUT_DIR" ]; then
  echo "usage: scripts/compare_fp8.sh OUT_DIR [--smoke] [--tasks T] [--tar FILE] [-- key=value ...]" >&2
  exit 2
fi
for task in $TASKS; do
  case "$task" in
    mnist1d|wide|mnist1d-50k) ;;
    *) echo "compare_fp8.sh: unknown task $task (expected mnist1d, wide, mnist1d-50k)" >&2; exit 2 ;;
  esac
done

# The reference arm, and what the smoke run changes (the CPU has no bf16; it emulates fp8).
if [ "$SMOKE" = 1 ]; then
  REF=fp32
  COMMON=(device=cpu graph=null "precision=$REF,fp8")
  case " ${EXTRA[*]-} " in *" seed="*) ;; *) COMMON+=(seed=0,1) ;; esac
  TASK_ARGS_mnist1d=(epochs=2)
  TASK_ARGS_wide=("model.hidden=[64,64]" data.samples=20000 data.batch_size=256 epochs=2)
  TASK_ARGS_mnist1d_50k=(data.samples=10000 epochs=2)
else
  REF=bf16
  COMMON=()
  TASK_ARGS_mnist1d=()
  TASK_ARGS_wide=()
  TASK_ARGS_mnist1d_50k=()
fi
config_of() {
  case "$1" in wide) echo compare_fp8_wide ;; mnist1d-50k) echo compare_fp8_mnist1d_50k ;; *) echo compare_fp8 ;; esac
}
# TARGS: the task's own overrides.
task_args() {
  case "$1" in
    wide) TARGS=(${TASK_ARGS_wide[@]+"${TASK_ARGS_wide[@]}"}) ;;
    mnist1d-50k) TARGS=(${TASK_ARGS_mnist1d_50k[@]+"${TASK_ARGS_mnist1d_50k[@]}"}) ;;
    *) TARGS=(${TASK_ARGS_mnist1d[@]+"${TASK_ARGS_mnist1d[@]}"}) ;;
  esac
}

# Paths given relative to where the script was started, before it moves into OUT_DIR.
case "$PY" in /*|"") ;; */*) PY="$PWD/$PY" ;; esac
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
if [ -n "$TAR" ]; then
  mkdir -p "$(dirname "$TAR")" && TAR="$(cd "$(dirname "$TAR")" && pwd)/$(basename "$TAR")" || exit 2
fi
cd "$OUT_DIR" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LOG="$OUT_DIR/compare_fp8.log"
: > "$LOG"
START=$SECONDS
FAILED=()

say() { echo "[compare_fp8 $(date +%H:%M:%S) +$((SECONDS - START))s] $*" | tee -a "$LOG"; }

# One timed step: its output goes to the terminal and the log; a failure is recorded, not fatal.
step() {
  local name="$1"; shift
  local t0=$SECONDS
  say "$name: $*"
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    FAILED+=("$name (exit $rc)")
    say "$name FAILED with exit status $rc after $((SECONDS - t0)) s"
  else
    say "$name done in $((SECONDS - t0)) s"
  fi
  return "$rc"
}

# Fail in seconds, not after minutes, when a package or the GPU is missing.
if ! preflight="$(COMPARE_FP8_SMOKE="$SMOKE" "$PY" - 2>&1 <<'PY'
import importlib, os, sys
missing = []
for name, why in [("mlptrain", "the repository on PYTHONPATH"), ("hydra", "hydra-core"), ("ml_dtypes", "ml_dtypes"),
                  ("mnist1d", "pip install mnist1d (the datasets extra); on a machine without a network, carry its wheel"),
                  ("matplotlib", "pip install matplotlib (the plot extra)")]:
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported the same way
        missing.append(f"{name} ({type(exc).__name__}: {exc}; {why})")
if not missing and os.environ["COMPARE_FP8_SMOKE"] != "1":
    from mlptrain.base.backend import probe_gpu

    available, reason = probe_gpu()
    if not available:
        missing.append(f"a GPU ({reason}; --smoke runs the recipe small on the CPU)")
if missing:
    print("compare_fp8.sh: cannot start, missing: " + "; ".join(missing), file=sys.stderr)
    sys.exit(1)
PY
)"; then
  echo "$preflight" | tee -a "$LOG" >&2
  exit 2
fi

say "out: $OUT_DIR; repo: $REPO; python: $PY; tasks: [$TASKS]; fp8 against $REF; smoke: $SMOKE"
mkdir -p runs/compare-fp8 docs/compare-fp8

# 1. Training: every sweep first (a failed one does not stop the other).
for task in $TASKS; do
  rm -rf "runs/compare-fp8/$task"
  task_args "$task"
  step "$task sweep" "$PY" -m mlptrain --config-name "$(config_of "$task")" "hydra.sweep.dir=runs/compare-fp8/$task" \
    ${COMMON[@]+"${COMMON[@]}"} ${TARGS[@]+"${TARGS[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
  # A comparison needs no checkpoint; the wide model's are 400 MB each.
  find "runs/compare-fp8/$task" -type d -name checkpoints -prune -exec rm -rf {} + 2>/dev/null
done

# 2. The reports, one per sweep, and the table of both.
for task in $TASKS; do
  rm -rf "docs/compare-fp8/$task"
  step "$task report" "$PY" -m mlptrain.compare "runs/compare-fp8/$task" --axis "precision=fp8,$REF" \
    --out "docs/compare-fp8/$task"
done
made_by="scripts/compare_fp8.sh OUT_DIR"
[ "$SMOKE" = 1 ] && made_by+=" --smoke"
[ "$TASKS" != "mnist1d wide" ] && made_by+=" --tasks '$TASKS'"
[ ${#EXTRA[@]} -gt 0 ] && made_by+=" -- ${EXTRA[*]}"
step "results" "$PY" -m mlptrain.tools.compare.results docs/compare-fp8 --made-by "$made_by"

say "finished in $((SECONDS - START)) s; ${#FAILED[@]} part(s) failed${FAILED[*]:+: ${FAILED[*]}}"
if [ -n "$TAR" ]; then
  tar -czf "$TAR" --exclude=checkpoints docs runs compare_fp8.log && say "packed $TAR ($(du -h "$TAR" | cut -f1))"
fi
[ -f docs/compare-fp8/results.md ] && cat docs/compare-fp8/results.md
[ ${#FAILED[@]} -eq 0 ]
