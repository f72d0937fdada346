#!/usr/bin/env bash
# PRESTO lambda sweep for the n-gram and the learned rho, budget 32, both schedules (issue: learned predictor).
#   benchmarks/lambda_sweep.sh [OUT_ROOT] [LIMIT]
set -euo pipefail
OUT=${1:-runs/sweep}
LIMIT=${2:-32}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
for rho in ngram learned; do
  for lam in 0.1 0.2 0.5 1 2 4; do
    name=lam_${rho}_${lam}
    "$PY" -m selfspec bench --peers --temperatures 0 --limit "$LIMIT" --max-new-tokens 64 --modes presto --schedules two-pass one-pass \
      --budgets 32 --rho "$rho" --lam "$lam" --out "$OUT/$name" > "$OUT/$name.log" 2>/dev/null
    tail -1 "$OUT/$name.log"
  done
done
