#!/usr/bin/env bash
# The exactness tests under the oldest supported and the newest allowed transformers, each in its
# own fresh venv (issue 13). Usage, from anywhere:
#   bash benchmarks/compat.sh                 # OLDEST and NEWEST below
#   bash benchmarks/compat.sh 5.20.2 5.22.0   # any other releases
# Venvs and logs go under $SCRATCH (default: a new temporary dir); prints one PASS/FAIL line per
# release and exits non-zero if any release fails. Needs PyPI (transformers) and the torch pin.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set /p' "${BASH_SOURCE[0]}" | grep '^#' | cut -c3-; exit 0;; esac
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OLDEST=5.4.0    # = TRANSFORMERS_MIN in selfspec/checkpoint/versions.py
NEWEST=5.24.0   # the newest release below TRANSFORMERS_BELOW
PY=${PYTHON:-python3.11}
SCRATCH=${SCRATCH:-$(mktemp -d -t selfspec-compat.XXXXXX)}
mkdir -p "$SCRATCH"
TESTS=(tests/test_model.py tests/test_forward.py tests/test_runtime.py tests/test_hybrid.py tests/test_shipped_model.py tests/test_versions.py)
versions=("$@")
[ ${#versions[@]} -eq 0 ] && versions=("$OLDEST" "$NEWEST")

status=0
summary=()
for v in "${versions[@]}"; do
  venv="$SCRATCH/tf-$v"
  log="$SCRATCH/tf-$v.log"
  echo "== transformers $v: venv $venv, log $log"
  {
    rm -rf "$venv"
    "$PY" -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0
    "$venv/bin/pip" install -q -e "$ROOT[test]" "transformers==$v"
    "$venv/bin/python" -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
  } >"$log" 2>&1 || { echo "install failed (tail of $log):"; tail -5 "$log"; summary+=("FAIL transformers $v (install)"); status=1; continue; }
  head_line=$(tail -1 "$log")
  if (cd "$ROOT" && OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$venv/bin/python" -m pytest -q "${TESTS[@]}") >>"$log" 2>&1; then
    summary+=("PASS $head_line: $(tail -1 "$log")")
  else
    summary+=("FAIL $head_line: $(tail -1 "$log")")
    status=1
  fi
done
echo "== summary (tests: ${TESTS[*]})"
printf '%s\n' "${summary[@]}"
exit $status
