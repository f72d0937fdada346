#!/usr/bin/env bash
# AR vs linear (two-pass, one-pass) vs PRESTO on a real Nemotron-Labs-Diffusion checkpoint, bf16, one GPU.
# Greedy; every row reports how many prompts matched AR token for token (column "= AR").
# Sized for a 10-minute slot on one H100/H200-class GPU with NLD-8B (model load included).
#
#   benchmarks/nld_gpu.sh /models/Nemotron-Labs-Diffusion-8B [prompts.jsonl] [out-dir]
#
# prompts.jsonl: one {"prompt": ...} or {"messages": [...]} per line (chat prompts use the
# checkpoint's chat template). Default: the shipped held-out code prompts.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
MODEL=${1:?usage: benchmarks/nld_gpu.sh CHECKPOINT_DIR [PROMPTS.jsonl] [OUT_DIR]}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PROMPTS=${2:-$HERE/models/pystdlib-nld-9m/prompts.jsonl}
OUT=${3:-bench_out/nld-gpu-$(date +%Y%m%d-%H%M%S)}
PY=${PYTHON:-python}
exec "$PY" -m selfspec bench --model "$MODEL" --prompts "$PROMPTS" --device cuda --dtype bfloat16 \
  --limit ${LIMIT:-8} --max-new-tokens ${MAX_NEW:-256} --block-length 32 \
  --modes ar auto lookup linear presto hybrid --schedules two-pass one-pass --budgets 32 --out "$OUT"
