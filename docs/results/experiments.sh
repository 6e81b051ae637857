#!/usr/bin/env bash
# Reproduces every number in docs/results/RESULTS.md (run from the repo root with .venv active or via
# `.venv/bin/python`). Sweeps use builtin:dev only; builtin:test is touched only by the final runs.
# Every document is truncated to its first 512 tokens so the whole script fits in about an hour
# on a 2-core CPU.
set -euo pipefail
PY=${PY:-.venv/bin/python}
COMMON="--max-tokens 512 --bootstrap 2000 --seed 0"
OUT=docs/results/sweeps
mkdir -p "$OUT"

# 1. Sweeps on the dev split (one heatmap each)
$PY -m feedback sweep --strategy deep_cache --grid lam=0.02,0.05,0.1 --grid gate=-1,0.6,0.75,0.9 \
    --param theta=50 --data builtin:dev $COMMON --out-dir $OUT/deep_cache-dev
$PY -m feedback sweep --strategy deep_cache --grid lam=0.02,0.05,0.1,0.2 --grid gate=0.9,0.95 \
    --param theta=50 --data builtin:dev $COMMON --out-dir $OUT/deep_cache-dev-high-gate
$PY -m feedback sweep --strategy deep_cache --grid max_p=0.3,0.6,1.0 --grid lam=0.05,0.1 \
    --param theta=50 --param gate=0.9 --data builtin:dev $COMMON --out-dir $OUT/deep_cache-dev-confidence-gate
$PY -m feedback sweep --strategy residual --grid alpha=-0.05,0.02,0.05 --grid target_layer=3,9,15 \
    --mode jacobi --passes 3 --data builtin:dev $COMMON --out-dir $OUT/residual-dev
$PY -m feedback sweep --strategy soft_token --grid beta=-0.05,0.02,0.05,0.1 --grid top_k=8,32 \
    --mode jacobi --passes 3 --data builtin:dev $COMMON --out-dir $OUT/soft_token-dev
$PY -m feedback sweep --strategy anchor --grid alpha=-0.05,0.02,0.05,0.1 --grid source_layer=15,21 \
    --data builtin:dev $COMMON --out-dir $OUT/anchor-dev

# 2. Each strategy at its default and at its best dev setting, on the test split; parallel vs exact
$PY docs/results/results.py run
$PY docs/results/results.py confirm
$PY docs/results/results.py table
