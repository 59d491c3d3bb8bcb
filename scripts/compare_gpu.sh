#!/usr/bin/env bash
# docs/compare-gpu/ in one command (issue #17): fused vs naive on the GPU, graph mode on, for ReLU and
# GELU in fp16 and bf16.
#
#   scripts/compare_gpu.sh OUT_DIR [--smoke] [--activations "relu gelu"] [--precisions "fp16 bf16"]
#                          [--tar FILE] [-- key=value ...]
#
# For each activation x precision (a "panel") it runs two Hydra multiruns, one process each:
#   * MNIST-1D, five seeds, fused and naive (conf/compare_gpu.yaml: 40-256-256-10, AdamW, warm-up
#     then cosine, 840 steps): the accuracy comparison;
#   * the speed task, one seed, fused and naive (conf/compare_gpu_speed.yaml: 32-4096-4096-4096-10 at
#     a batch of 8192 on synthetic data, 95 steps): the time per step where the GEMMs are large;
# then `python -m mlptrain.compare` on each sweep, and `python -m mlptrain.compare --index` for the page that links
# the panels and says how fused and naive differ. Everything lands under OUT_DIR, laid out as in the
# repository (run from inside OUT_DIR, so the commands recorded in the reports are the ones to
# type at the repository's root):
#
#   OUT_DIR/docs/compare-gpu/README.md                      the index (copy docs/ into the repository)
#   OUT_DIR/docs/compare-gpu/<act>-<prec>/compare.{png,md,json}         MNIST-1D, 5 seeds
#   OUT_DIR/docs/compare-gpu/<act>-<prec>/speed/compare.{png,md,json}   the speed task, 1 seed
#   OUT_DIR/runs/compare-gpu/<act>-<prec>[-speed]/          the sweeps (metrics; checkpoints removed)
#   OUT_DIR/compare_gpu.log                                 what ran, and how long each part took
#
# Jobs: 4 panels x (10 MNIST-1D + 2 speed) = 48 training runs in 8 processes, then 8 reports. Planned
# for one H200 (where the default digits run takes about 2 s warm): each MNIST-1D sweep about 25 s
# (start-up and drawing MNIST-1D about 5 s, then 10 jobs of 840 replayed steps and 30 evaluations,
# about 2 s each, plus CuPy's kernel compilation on a fresh machine), each speed sweep about 20 s
# (per job: 26 M normal numbers drawn, 95 steps of about 5 ms, two 400 MB checkpoints written, and
# removed once the sweep is done), each report about 2 s: about 3.5 minutes in all (164 s on the H200,
# 2026-12-01), and it must stay under 5. compare_gpu.log has each part's time. (--smoke, one panel, on a 2-core CPU: 28 s.)
#
# Options:
#   --smoke        the same recipe on the CPU, small: device=cpu, precisions fp32 and fp64 (the CPU has
#                  no fp16/bf16), 2 epochs of MNIST-1D, a 64-64 speed model (checks the recipe end to end)
#   --activations, --precisions   the panels (defaults: "relu gelu" and "fp16 bf16")
#   --tar FILE     also pack docs/, runs/ and the log into FILE (.tar.gz), for a machine that sends back
#                  only a few files
#   -- key=value   more overrides for every sweep (e.g. -- seed=0,1)
# Environment: PYTHON (default python3) runs mlptrain and the reports; it needs mlptrain's stack,
# mnist1d (the datasets extra) and matplotlib. The exit status is 0 when every part succeeded, 1 if one
# failed (the others still run; the log names it), 2 on a usage or environment error.
set -uo pipefail

usage() { sed -n '2,/^set -uo/{s/^# \{0,1\}//p;}' "$0"; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
SMOKE=0
ACTIVATIONS="relu gelu"
PRECISIONS=""
TAR=""
OUT_DIR=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --smoke) SMOKE=1 ;;
    --activations) ACTIVATIONS="${2:?--activations needs a value}"; shift ;;
    --precisions) PRECISIONS="${2:?--precisions needs a value}"; shift ;;
    --tar) TAR="${2:?--tar needs a file}"; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) echo "compare_gpu.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
    *) if [ -n "$OUT_DIR" ]; then echo "compare_gpu.sh: one OUT_DIR only (got $OUT_DIR and $1)" >&2; exit 2; fi
       OUT_DIR="$1" ;;
  esac
  shift
done
if [ -z "$OUT_DIR" ]; then
  echo "usage: scripts/compare_gpu.sh OUT_DIR [--smoke] [--activations A] [--precisions P] [--tar FILE] [-- key=value ...]" >&2
  exit 2
fi

# The panels, and what the smoke run changes (the CPU runs fp32 and fp64 only).
if [ "$SMOKE" = 1 ]; then
  DEFAULT_PRECISIONS="fp32 fp64"
  ACC_ARGS=(device=cpu graph=null epochs=2)
  SPEED_ARGS=(device=cpu graph=null "model.hidden=[64,64]" data.samples=20000 data.batch_size=256)
else
  DEFAULT_PRECISIONS="fp16 bf16"
  ACC_ARGS=()
  SPEED_ARGS=()
fi
PRECISIONS="${PRECISIONS:-$DEFAULT_PRECISIONS}"

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
LOG="$OUT_DIR/compare_gpu.log"
: > "$LOG"
START=$SECONDS
FAILED=()

say() { echo "[compare_gpu $(date +%H:%M:%S) +$((SECONDS - START))s] $*" | tee -a "$LOG"; }

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
if ! preflight="$(COMPARE_GPU_SMOKE="$SMOKE" "$PY" - 2>&1 <<'EOF'
import importlib, os, sys
missing = []
for name, why in [("mlptrain", "the repository on PYTHONPATH"), ("hydra", "hydra-core"),
                  ("mnist1d", "pip install mnist1d (the datasets extra); on a machine without a network, carry its wheel"),
                  ("matplotlib", "pip install matplotlib (the plot extra)")]:
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported the same way
        missing.append(f"{name} ({type(exc).__name__}: {exc}; {why})")
if not missing and os.environ["COMPARE_GPU_SMOKE"] != "1":
    from mlptrain.base.backend import probe_gpu

    available, reason = probe_gpu()
    if not available:
        missing.append(f"a GPU ({reason}; --smoke runs the recipe small on the CPU)")
if missing:
    print("compare_gpu.sh: cannot start, missing: " + "; ".join(missing), file=sys.stderr)
    sys.exit(1)
EOF
)"; then
  echo "$preflight" | tee -a "$LOG" >&2
  exit 2
fi

say "out: $OUT_DIR; repo: $REPO; python: $PY; panels: activations [$ACTIVATIONS] x precisions [$PRECISIONS]; smoke: $SMOKE"
mkdir -p runs/compare-gpu docs/compare-gpu

# 1. Training: every sweep first (a failed one does not stop the others).
for act in $ACTIVATIONS; do
  for prec in $PRECISIONS; do
    panel="$act-$prec"
    rm -rf "runs/compare-gpu/$panel" "runs/compare-gpu/$panel-speed"
    step "$panel MNIST-1D" "$PY" -m mlptrain --config-name compare_gpu "hydra.sweep.dir=runs/compare-gpu/$panel" \
      "model.activation=$act" "precision=$prec" ${ACC_ARGS[@]+"${ACC_ARGS[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
    step "$panel speed" "$PY" -m mlptrain --config-name compare_gpu_speed "hydra.sweep.dir=runs/compare-gpu/$panel-speed" \
      "model.activation=$act" "precision=$prec" ${SPEED_ARGS[@]+"${SPEED_ARGS[@]}"} ${EXTRA[@]+"${EXTRA[@]}"}
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
    step "$panel MNIST-1D report" "$PY" -m mlptrain.compare "runs/compare-gpu/$panel" \
      --out "docs/compare-gpu/$panel"
    step "$panel speed report" "$PY" -m mlptrain.compare "runs/compare-gpu/$panel-speed" \
      --out "docs/compare-gpu/$panel/speed"
  done
done
made_by="scripts/compare_gpu.sh OUT_DIR"
[ "$SMOKE" = 1 ] && made_by+=" --smoke"
[ "$ACTIVATIONS" != "relu gelu" ] && made_by+=" --activations '$ACTIVATIONS'"
[ "$PRECISIONS" != "$DEFAULT_PRECISIONS" ] && made_by+=" --precisions '$PRECISIONS'"
[ ${#EXTRA[@]} -gt 0 ] && made_by+=" -- ${EXTRA[*]}"
made_by+="   # then OUT_DIR/docs/compare-gpu/ was copied to docs/compare-gpu/"
step "index" "$PY" -m mlptrain.compare --index docs/compare-gpu --made-by "$made_by"

say "finished in $((SECONDS - START)) s; ${#FAILED[@]} part(s) failed${FAILED[*]:+: ${FAILED[*]}}"
if [ -n "$TAR" ]; then
  tar -czf "$TAR" --exclude=checkpoints docs runs compare_gpu.log && say "packed $TAR ($(du -h "$TAR" | cut -f1))"
fi
[ -f docs/compare-gpu/README.md ] && sed -n '/^| panel/,/^$/p' docs/compare-gpu/README.md
[ ${#FAILED[@]} -eq 0 ]
