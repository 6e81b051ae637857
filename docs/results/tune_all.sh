#!/usr/bin/env bash
# Reproduces the "Strategies v2" results in docs/RESULTS.md: each hidden-state strategy tuned with
# `python -m feedback tune` on builtin:dev (Optuna TPE, seed 0, pruning), its best point then scored
# once on builtin:test; restate and every strategy's tuned setting on the built-in question set.
# Documents are truncated to 256 tokens so the whole script fits in about an hour on a 2-core CPU.
# Resumable: rerun it and finished trials are read back from each trials.jsonl.
set -euo pipefail
PY=${PY:-.venv/bin/python}
COMMON="--data builtin:dev --max-tokens 256 --bootstrap 1000 --seed 0"
OUT=docs/tune
mkdir -p "$OUT"
$PY -m feedback tune --strategy deep_cache $COMMON --trials 20 --out-dir $OUT/deep_cache
$PY -m feedback tune --strategy anchor $COMMON --trials 16 --out-dir $OUT/anchor
$PY -m feedback tune --strategy residual $COMMON --mode jacobi --passes 3 --trials 16 --out-dir $OUT/residual
$PY -m feedback tune --strategy soft_token $COMMON --mode jacobi --passes 3 --trials 16 --out-dir $OUT/soft_token
# inner_loop's trials cost more the more layers and loops they try: a 600 s budget per mode, with a
# trial cap above what it reaches (26 and 20 trials were run).
$PY -m feedback tune --strategy inner_loop --param mode=loop $COMMON --trials 40 --timeout 600 --out-dir $OUT/inner_loop-loop
$PY -m feedback tune --strategy inner_loop --param mode=euler $COMMON --trials 40 --timeout 600 --out-dir $OUT/inner_loop-euler
