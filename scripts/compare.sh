#!/usr/bin/env bash
# The GPU comparisons of docs/ in one command, one suite a call (`make compare-gpu`, `make compare-fp8`):
#
#   scripts/compare.sh --suite gpu OUT_DIR [--smoke] [--activations "relu gelu"] [--precisions "fp16 bf16"]
#                      [--tar FILE] [-- key=value ...]
#   scripts/compare.sh --suite fp8 OUT_DIR [--smoke] [--tasks "mnist1d wide"] [--tar FILE] [-- key=value ...]
#
# --suite gpu: docs/compare-gpu/ (issue #17), fused vs naive on the GPU, graph mode on, for ReLU and
# GELU in fp16 and bf16. For each activation x precision (a "panel") two Hydra multiruns, one process each:
#   * MNIST-1D, five seeds, fused and naive (conf/compare_gpu.yaml: 40-256-256-10, AdamW, warm-up
#     then cosine, 840 steps): the accuracy comparison;
#   * the speed task, one seed, fused and naive (conf/compare_gpu_speed.yaml: 32-4096-4096-4096-10 at
#     a batch of 8192 on synthetic data, 95 steps): the time per step where the GEMMs are large;
# then `python -m mlptrain.compare` on each sweep, and `python -m mlptrain.compare --index` for the page
# that links the panels and says how fused and naive differ:
#   OUT_DIR/docs/compare-gpu/README.md                      the index (copy docs/ into the repository)
#   OUT_DIR/docs/compare-gpu/<act>-<prec>/compare.{png,md,json}         MNIST-1D, 5 seeds
#   OUT_DIR/docs/compare-gpu/<act>-<prec>/speed/compare.{png,md,json}   the speed task, 1 seed
#   OUT_DIR/runs/compare-gpu/<act>-<prec>[-speed]/          the sweeps (metrics; checkpoints removed)
#   OUT_DIR/compare_gpu.log                                 what ran, and how long each part took
# Jobs: 4 panels x (10 MNIST-1D + 2 speed) = 48 training runs in 8 processes, then 8 reports: each
# MNIST-1D sweep about 25 s on one H200, each speed sweep about 20 s (two 400 MB checkpoints a job,
# removed once the sweep is done), each report about 2 s: 164 s on the H200 (2026-12-01); it must stay
# under 5 minutes. (--smoke, one panel, on a 2-core CPU: 28 s.)
#
# --suite fp8: docs/compare-fp8/ (issue #30), FP8 against bf16, five seeds, both fused, graph mode on,
# on a GPU of compute capability 8.9+ (H100, H200). For each task one Hydra multirun (one process:
# precision=bf16,fp8 x seed=0..4):
#   * mnist1d:     conf/compare_fp8.yaml, 40-256-256-10, AdamW, warm-up then cosine, 840 steps;
#   * wide:        conf/compare_fp8_wide.yaml, 32-4096-4096-4096-10 at a batch of 8192, 273 steps;
#   * mnist1d-50k: conf/compare_fp8_mnist1d_50k.yaml, the mnist1d recipe on a 50,000-sample draw of
#                  MNIST-1D (data.samples=50000), 30 epochs, 8,430 steps; not a default task (--tasks).
# then `python -m mlptrain.compare SWEEP --axis precision=fp8,bf16` on each (the figure, the table with
# the paired final-accuracy difference and its 95 % interval against half a point), and results.md:
#   OUT_DIR/docs/compare-fp8/<task>/compare.{png,md,json}   the report of each task
#   OUT_DIR/docs/compare-fp8/results.md                     the tasks' numbers, for README.md
#   OUT_DIR/runs/compare-fp8/<task>/                        the sweeps (metrics; checkpoints removed)
#   OUT_DIR/compare_fp8.log                                 what ran, and how long each part took
# Jobs: 2 tasks x 10 = 20 training runs in 2 processes, then 2 reports: the MNIST-1D sweep about 30 s
# on one H200, the wide sweep about 2 minutes, each report about 3 s; it must stay under 6 minutes.
#
# Both run from inside OUT_DIR, laid out as the repository, so the commands recorded in the reports are
# the ones to type at the repository's root. Options:
#   --suite        gpu or fp8 (required)
#   --smoke        the same recipe on the CPU, small (checks it end to end, not the numbers):
#                  gpu: device=cpu, precisions fp32 and fp64 (the CPU has no fp16/bf16), 2 epochs of
#                  MNIST-1D, a 64-64 speed model; fp8: fp8 emulated through the NumPy FP8 contract
#                  against fp32, 2 seeds, 2 epochs of MNIST-1D (of a 10,000-sample draw for
#                  mnist1d-50k), a 64-64 wide model on 20,000 samples
#   --activations, --precisions   gpu: the panels (defaults: "relu gelu" and "fp16 bf16")
#   --tasks        fp8: which tasks (default: "mnist1d wide"; also mnist1d-50k: 10 jobs of 8,430 steps,
#                  48 s on an H200 with its report, 2026-12-04)
#   --tar FILE     also pack docs/, runs/ and the log into FILE (.tar.gz), for a machine that sends back
#                  only a few files
#   -- key=value   more overrides for every sweep (e.g. -- seed=0,1)
# Environment: PYTHON (default python3) runs mlptrain and the reports; it needs mlptrain's stack,
# mnist1d (the datasets extra) and matplotlib. The exit status is 0 when every part succeeded, 1 if one
# failed (the others still run; the log names it), 2 on a usage or environment error.
set -uo pipefail

usage() { sed -n '2,/^set -uo/{s/^# \{0,1\}//p;}' "$0"; }
fail() { echo "compare.sh: $*" >&2; exit 2; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
SUITE="" SMOKE=0 ACTIVATIONS="" PRECISIONS="" TASKS="" TAR="" OUT_DIR=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --suite) SUITE="${2:?--suite needs gpu or fp8}"; shift ;;
    --smoke) SMOKE=1 ;;
    --activations) ACTIVATIONS="${2:?--activations needs a value}"; shift ;;
    --precisions) PRECISIONS="${2:?--precisions needs a value}"; shift ;;
    --tasks) TASKS="${2:?--tasks needs a value}"; shift ;;
    --tar) TAR="${2:?--tar needs a file}"; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) fail "unknown option $1 (--help lists them)" ;;
    *) [ -z "$OUT_DIR" ] || fail "one OUT_DIR only (got $OUT_DIR and $1)"; OUT_DIR="$1" ;;
  esac
  shift
done
if [ -z "$OUT_DIR" ] || [ -z "$SUITE" ]; then
  echo "usage: scripts/compare.sh --suite gpu|fp8 OUT_DIR [--smoke] [--activations A] [--precisions P] [--tasks T]" \
    "[--tar FILE] [-- key=value ...]" >&2
  exit 2
fi
case "$SUITE" in
  gpu) [ -z "$TASKS" ] || fail "--tasks is an option of --suite fp8" ;;
  fp8) [ -z "$ACTIVATIONS$PRECISIONS" ] || fail "--activations and --precisions are options of --suite gpu" ;;
  *) fail "unknown suite $SUITE (expected gpu or fp8)" ;;
esac

# What each suite runs, and what the smoke run changes (the CPU has no fp16/bf16; it emulates fp8).
if [ "$SUITE" = gpu ]; then
  ACTIVATIONS="${ACTIVATIONS:-relu gelu}"
  if [ "$SMOKE" = 1 ]; then
    DEFAULT_PRECISIONS="fp32 fp64"
    ACC_ARGS=(device=cpu graph=null epochs=2)
    SPEED_ARGS=(device=cpu graph=null "model.hidden=[64,64]" data.samples=20000 data.batch_size=256)
  else
    DEFAULT_PRECISIONS="fp16 bf16" ACC_ARGS=() SPEED_ARGS=()
  fi
  PRECISIONS="${PRECISIONS:-$DEFAULT_PRECISIONS}"
else
  TASKS="${TASKS:-mnist1d wide}"
  for task in $TASKS; do
    case "$task" in mnist1d|wide|mnist1d-50k) ;; *) fail "unknown task $task (expected mnist1d, wide, mnist1d-50k)" ;; esac
  done
  if [ "$SMOKE" = 1 ]; then
    REF=fp32
    COMMON=(device=cpu graph=null "precision=$REF,fp8")
    case " ${EXTRA[*]-} " in *" seed="*) ;; *) COMMON+=(seed=0,1) ;; esac
    TASK_ARGS_mnist1d=(epochs=2)
    TASK_ARGS_wide=("model.hidden=[64,64]" data.samples=20000 data.batch_size=256 epochs=2)
    TASK_ARGS_mnist1d_50k=(data.samples=10000 epochs=2)
  else
    REF=bf16 COMMON=() TASK_ARGS_mnist1d=() TASK_ARGS_wide=() TASK_ARGS_mnist1d_50k=()
  fi
fi

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
NAME="compare_$SUITE"
LOG="$OUT_DIR/$NAME.log"
: > "$LOG"
START=$SECONDS
FAILED=()

say() { echo "[$NAME $(date +%H:%M:%S) +$((SECONDS - START))s] $*" | tee -a "$LOG"; }

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
if ! preflight="$(COMPARE_SMOKE="$SMOKE" "$PY" - 2>&1 <<'PY'
import importlib, os, sys
missing = []
for name, why in [("mlptrain", "the repository on PYTHONPATH"), ("hydra", "hydra-core"), ("ml_dtypes", "ml_dtypes"),
                  ("mnist1d", "pip install mnist1d (the datasets extra); on a machine without a network, carry its wheel"),
                  ("matplotlib", "pip install matplotlib (the plot extra)")]:
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported the same way
        missing.append(f"{name} ({type(exc).__name__}: {exc}; {why})")
if not missing and os.environ["COMPARE_SMOKE"] != "1":
    from mlptrain.base.backend import probe_gpu

    available, reason = probe_gpu()
    if not available:
        missing.append(f"a GPU ({reason}; --smoke runs the recipe small on the CPU)")
if missing:
    print("compare.sh: cannot start, missing: " + "; ".join(missing), file=sys.stderr)
    sys.exit(1)
PY
)"; then
  echo "$preflight" | tee -a "$LOG" >&2
  exit 2
fi

# What the reports record as the command that made them.
made_by="scripts/compare.sh --suite $SUITE OUT_DIR"
[ "$SMOKE" = 1 ] && made_by+=" --smoke"

suite_gpu() {
  say "out: $OUT_DIR; repo: $REPO; python: $PY; panels: activations [$ACTIVATIONS] x precisions [$PRECISIONS]; smoke: $SMOKE"
  mkdir -p runs/compare-gpu docs/compare-gpu
  local act prec panel
  # 1. Training: every sweep first (a failed one does not stop the others).
  for act in $ACTIVATIONS; do
    for prec in $PRECISIONS; do
      panel="$act-$prec"
      rm -rf "runs/compare-gpu/$panel" "runs/compare-gpu/$panel-speed"
      step "$panel MNIST-1D" "$PY" -m mlptrain --config-name compare_gpu "hydra.sweep.dir=runs/compare-gpu/$panel" \
        "model.activation=$act" "precision=$prec" ${ACC_ARGS[@]+"${ACC_ARGS[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
      step "$panel speed" "$PY" -m mlptrain --config-name compare_gpu_speed \
        "hydra.sweep.dir=runs/compare-gpu/$panel-speed" "model.activation=$act" "precision=$prec" \
        ${SPEED_ARGS[@]+"${SPEED_ARGS[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
      # A comparison needs no checkpoint; the speed model's are 400 MB each.
      find "runs/compare-gpu/$panel" "runs/compare-gpu/$panel-speed" -type d -name checkpoints -prune \
        -exec rm -rf {} + 2>/dev/null
    done
  done
  # 2. The reports, one per sweep, and the index.
  for act in $ACTIVATIONS; do
    for prec in $PRECISIONS; do
      panel="$act-$prec"
      rm -rf "docs/compare-gpu/$panel"
      step "$panel MNIST-1D report" "$PY" -m mlptrain.compare "runs/compare-gpu/$panel" --out "docs/compare-gpu/$panel"
      step "$panel speed report" "$PY" -m mlptrain.compare "runs/compare-gpu/$panel-speed" \
        --out "docs/compare-gpu/$panel/speed"
    done
  done
  [ "$ACTIVATIONS" != "relu gelu" ] && made_by+=" --activations '$ACTIVATIONS'"
  [ "$PRECISIONS" != "$DEFAULT_PRECISIONS" ] && made_by+=" --precisions '$PRECISIONS'"
  [ ${#EXTRA[@]} -gt 0 ] && made_by+=" -- ${EXTRA[*]}"
  made_by+="   # then OUT_DIR/docs/compare-gpu/ was copied to docs/compare-gpu/"
  step "index" "$PY" -m mlptrain.compare --index docs/compare-gpu --made-by "$made_by"
}

suite_fp8() {
  say "out: $OUT_DIR; repo: $REPO; python: $PY; tasks: [$TASKS]; fp8 against $REF; smoke: $SMOKE"
  mkdir -p runs/compare-fp8 docs/compare-fp8
  local task config targs
  # 1. Training: every sweep first (a failed one does not stop the other).
  for task in $TASKS; do
    rm -rf "runs/compare-fp8/$task"
    case "$task" in
      wide) config=compare_fp8_wide; targs=(${TASK_ARGS_wide[@]+"${TASK_ARGS_wide[@]}"}) ;;
      mnist1d-50k) config=compare_fp8_mnist1d_50k; targs=(${TASK_ARGS_mnist1d_50k[@]+"${TASK_ARGS_mnist1d_50k[@]}"}) ;;
      *) config=compare_fp8; targs=(${TASK_ARGS_mnist1d[@]+"${TASK_ARGS_mnist1d[@]}"}) ;;
    esac
    step "$task sweep" "$PY" -m mlptrain --config-name "$config" "hydra.sweep.dir=runs/compare-fp8/$task" \
      ${COMMON[@]+"${COMMON[@]}"} ${targs[@]+"${targs[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
    # A comparison needs no checkpoint; the wide model's are 400 MB each.
    find "runs/compare-fp8/$task" -type d -name checkpoints -prune -exec rm -rf {} + 2>/dev/null
  done
  # 2. The reports, one per sweep, and the table of both.
  for task in $TASKS; do
    rm -rf "docs/compare-fp8/$task"
    step "$task report" "$PY" -m mlptrain.compare "runs/compare-fp8/$task" --axis "precision=fp8,$REF" \
      --out "docs/compare-fp8/$task"
  done
  [ "$TASKS" != "mnist1d wide" ] && made_by+=" --tasks '$TASKS'"
  [ ${#EXTRA[@]} -gt 0 ] && made_by+=" -- ${EXTRA[*]}"
  step "results" "$PY" -m mlptrain.tools.compare.results docs/compare-fp8 --made-by "$made_by"
}

"suite_$SUITE"
say "finished in $((SECONDS - START)) s; ${#FAILED[@]} part(s) failed${FAILED[*]:+: ${FAILED[*]}}"
if [ -n "$TAR" ]; then
  tar -czf "$TAR" --exclude=checkpoints docs runs "$NAME.log" && say "packed $TAR ($(du -h "$TAR" | cut -f1))"
fi
if [ "$SUITE" = gpu ]; then
  [ -f docs/compare-gpu/README.md ] && sed -n '/^| panel/,/^$/p' docs/compare-gpu/README.md
else
  [ -f docs/compare-fp8/results.md ] && cat docs/compare-fp8/results.md
fi
[ ${#FAILED[@]} -eq 0 ]
