#!/usr/bin/env bash
# The measurements behind docs/results.md, on the shipped model and its held-out prompts, CPU.
#   benchmarks/cpu_sweep.sh [OUT_ROOT] [LIMIT]
# Each run writes OUT_ROOT/<name>/{results.json,table.md,*.png}; results.json records its command.
set -euo pipefail
OUT=${1:-runs/sweep}
LIMIT=${2:-32}
PY=${PYTHON:-.venv/bin/python}
run() { name=$1; shift; "$PY" -m selfspec bench --limit "$LIMIT" --max-new-tokens 64 --peers --temperatures 0 --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>/dev/null; tail -1 "$OUT/$name.log"; }
mkdir -p "$OUT"
# block length for the linear target of the model card (two-pass, B = 16) and B = 8
run linear_b16 --modes ar linear --schedules two-pass one-pass --block-length 16
run linear_b8 --modes linear --schedules two-pass one-pass --block-length 8
# PRESTO lambda = 0 (naive tree) and n-gram (lambda 0.2), both schedules, budgets 8..64
run presto_lam0 --modes presto --schedules two-pass one-pass --budgets 8 16 32 64 --rho none --lam 0
run presto_ngram --modes presto --schedules two-pass one-pass --budgets 8 16 32 64 --rho ngram --lam 0.2
# one-pass with mask groups on the 4 likeliest endpoints only (the root always has one)
run presto_groups4 --modes presto --schedules one-pass --budgets 8 16 32 64 --group-nodes 4
