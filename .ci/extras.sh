#!/usr/bin/env bash
# Each user-facing extra installs and imports on its own (#47): a fresh virtual environment per extra,
# `pip install -e '.[EXTRA]'` and nothing else, then a smoke use of what the extra is for. The `dev`
# extra would hide a missing dependency (it brings in most of them), so none of these venvs has it.
# cu12 (CuPy and nvmath-python, which install and import without a GPU): every module of the package
# imports (.ci/import_all.py), so a move cannot leave a GPU module broken unseen (#48).
# Usage: bash .ci/extras.sh [EXTRA ...]   (default: sklearn torch cu12)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$(pwd)"
PYTHON="${PYTHON:-python3}"
ROOT="$(mktemp -d -t mlptrain-extras-XXXXXX)"
trap 'rm -rf "$ROOT"' EXIT

smoke_sklearn='
import warnings
import numpy as np
warnings.simplefilter("ignore", category=UserWarning)
from mlptrain.sklearn import MLPClassifier, MLPRegressor
rng = np.random.default_rng(0)
X = rng.standard_normal((200, 4))
y = (X[:, 0] + X[:, 1] > 0).astype(int)
acc = MLPClassifier(hidden_layer_sizes=(16,), max_iter=300, random_state=0).fit(X, y).score(X, y)
r2 = MLPRegressor(hidden_layer_sizes=(16,), max_iter=300, random_state=0).fit(X, X[:, 0]).score(X, X[:, 0])
assert acc > 0.8 and r2 > 0.5, (acc, r2)
print(f"mlptrain.sklearn: accuracy {acc:.3f}, R2 {r2:.3f}")
'
smoke_torch='
import torch
from mlptrain.torch import FusedMLP
torch.manual_seed(0)
m = FusedMLP([4, 16, 3])
x = torch.randn(8, 4)
m(x).square().sum().backward()
assert all(p.grad is not None for p in m.parameters())
print("mlptrain.torch: FusedMLP forward and backward on", x.shape[0], "rows")
'

for extra in "${@:-sklearn torch cu12}"; do
  for e in $extra; do
    echo "== extra [$e] in a fresh venv"
    venv="$ROOT/$e"
    "$PYTHON" -m venv "$venv"
    if [ "$e" = torch ]; then
      # The default torch wheel pulls the CUDA libraries (gigabytes); the CPU build satisfies torch>=2.4.
      "$venv/bin/python" -m pip install -q "torch==2.13.0+cpu"
    fi
    "$venv/bin/python" -m pip install -q -e ".[$e]"
    if [ "$e" = cu12 ]; then
      (cd "$ROOT" && "$venv/bin/python" "$REPO/.ci/import_all.py" --allow torch,sklearn,pandas)
    else
      smoke="smoke_$e"
      (cd "$ROOT" && "$venv/bin/python" -c "${!smoke}")
    fi
    rm -rf "$venv"  # gigabytes for cu12 and torch: one at a time
  done
done
