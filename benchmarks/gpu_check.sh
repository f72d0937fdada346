#!/usr/bin/env bash
# The GPU check, on the shipped 9M model (models/pystdlib-nld-9m): per weight format (fp32, bf16)
#   1. `selfspec profile`: the device's cost model f(width) (written to $OUT/profile_<w>.json);
#   2. `selfspec bench`: every mode (ar, auto, lookup, linear and PRESTO each two-pass and
#      one-pass, budget 32) on the model's own prompts, greedy (checked token for token against
#      AR) and seeded sampled at T=1, every run twice (--repeats 2: the two runs' tokens compared);
#      at fp32 also transformers' generate (the "hf" peer) on the same weights;
#   3. benchmarks/gpu_check_report.py: per row, equal to AR (and the first divergence where not),
#      tau, tokens per forward, tok/s, reproducibility of the sampled runs; the cost curves.
# Installs nothing (selfspec from this checkout through PYTHONPATH; the 9M model needs no `gguf`).
#
#   OUT=dir benchmarks/gpu_check.sh                      # on the GPU machine (DEVICE=cuda)
#   DEVICE=cpu LIMIT=1 MAX_NEW=16 DTYPES=fp32 OUT=/tmp/x benchmarks/gpu_check.sh   # a smoke run
set -uo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$HERE/bench_out/gpu-check-$(date +%Y%m%d-%H%M%S)}
DEVICE=${DEVICE:-cuda}
LIMIT=${LIMIT:-8}
MAX_NEW=${MAX_NEW:-64}
DTYPES=${DTYPES:-fp32 bf16}
MODEL=${MODEL:-$HERE/models/pystdlib-nld-9m}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$HERE${PYTHONPATH:+:$PYTHONPATH}
export SELFSPEC_CACHE=${SELFSPEC_CACHE:-/tmp/selfspec-gpu-check-cache}
mkdir -p "$OUT"
cd "$HERE"
{
  echo "== $(date -u +%FT%TZ) DEVICE=$DEVICE LIMIT=$LIMIT MAX_NEW=$MAX_NEW DTYPES='$DTYPES' MODEL=$MODEL"
  nvidia-smi -L 2>&1 || echo "(no nvidia-smi)"
  $PY -c 'import platform, torch, transformers; print("python", platform.python_version(), "torch", torch.__version__,
"transformers", transformers.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))'
  git -C "$HERE" log -1 --format='commit %H %s' 2>/dev/null || true
  for w in $DTYPES; do
    echo "== profile $w"
    t0=$SECONDS
    $PY -m selfspec profile --model "$MODEL" --device "$DEVICE" --weights "$w" \
      --out "$OUT/profile_$w.json"
    echo "profile $w: $((SECONDS - t0)) s"; t0=$SECONDS
    peers=(); [ "$w" = fp32 ] && peers=(hf)
    echo "== bench $w"
    $PY -m selfspec bench --model "$MODEL" --device "$DEVICE" --weights "$w" \
      --modes ar auto lookup linear presto --schedules two-pass one-pass --budgets 32 \
      --temperatures 0 1 --seed 0 --repeats 2 --limit "$LIMIT" --max-new-tokens "$MAX_NEW" \
      --peers "${peers[@]}" --compare-weights --profile "$OUT/profile_$w.json" --out "$OUT/bench_$w"
    echo "bench $w: $((SECONDS - t0)) s"
  done
  echo "== report"
  $PY benchmarks/gpu_check_report.py "$OUT"
} 2>&1 | tee "$OUT/log.txt"
