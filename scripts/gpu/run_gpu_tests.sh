#!/usr/bin/env bash
# The GPU test suite (pytest -m gpu) in one device call, inside 10 minutes on one H200: the test
# files with GPU tests are dealt into CHUNKS groups (heaviest first) that run side by side on
# the one GPU (most of the time is Triton compilation, which is host-bound), with pytest's
# --no-autotune (tests/conftest.py: each kernel's first config that survives pruning, no autotune timing).
# Each chunk's log (with its ten slowest tests) goes to $OUT/pytest-gpu-<i>.log;
# $OUT/pytest-gpu-summary.txt gets each chunk's files and result (scripts/gpu/gpu_tests_summary.py),
# printed at the end; exits 1 when any chunk failed or did not finish. GPU_TESTS_BUDGET_S (seconds,
# optional) stops the chunks still running then with SIGINT, so they still print their counts
# (keep it under the device call's own limit, or nothing is summarised).
# GPU_TESTS_LIST_ONLY=1 prints the chunks ("chunk <i>: <files>") and exits without running them.
#   source scripts/gpu/setup_site.sh && [GPU_TESTS_BUDGET_S=540] bash scripts/gpu/run_gpu_tests.sh [CHUNKS] [PYTEST ARGS...]
set -uo pipefail
cd "$(dirname "$0")/../.."
chunks=${1:-8}
shift $(( $# > 0 ? 1 : 0 ))
list_only=${GPU_TESTS_LIST_ONLY:-0}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
if [ "$list_only" != 1 ]; then
  mkdir -p "$OUT"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
fi
# The heaviest files first (most kernel variants to compile), one entry per chunk in turn; then the
# rest. An entry may name two files, a slow one beside a quick one: at c3ad87c test_versus.py
# (whole NSA attention, `auto` profiling its candidates) dealt after test_decode_gpu.py ran chunk 1
# past 400 s while the compressed-attention chunk finished in 28 s.
heavy=(tests/test_gpu_selection.py tests/test_decode_gpu.py tests/test_gpu_flash.py tests/test_gpu_runners.py
       tests/test_selection_fsa.py tests/test_selection_nsa.py tests/test_gpu_compression.py
       "tests/test_compressed_attention.py tests/test_versus.py")
mapfile -t rest < <(grep -l "mark.gpu" tests/test_*.py | grep -vxF -f <(printf '%s\n' ${heavy[@]}) | xargs ls -S)
files=("${heavy[@]}" "${rest[@]}")
budget=${GPU_TESTS_BUDGET_S:-0}
stop=()
(( budget > 0 )) && stop=(timeout --signal=INT --kill-after=30 "$budget")
start=$(date +%s)
pids=()
lists=()
for ((i = 0; i < chunks; i++)); do
  mine=()
  # Unquoted: a heavy entry may name two files.
  for ((j = i; j < ${#files[@]}; j += chunks)); do mine+=(${files[j]}); done
  [[ ${#mine[@]} -eq 0 ]] && continue
  echo "chunk $i: ${mine[*]}"
  [ "$list_only" = 1 ] && continue
  lists+=(--chunk "${mine[*]}")
  "${stop[@]}" python3 -m pytest -m gpu --no-autotune -q -p no:cacheprovider -rfEs --durations=10 "$@" "${mine[@]}" > "$OUT/pytest-gpu-$i.log" 2>&1 &
  pids+=($!)
done
[ "$list_only" = 1 ] && exit 0
for pid in "${pids[@]}"; do wait "$pid"; done
for log in "$OUT"/pytest-gpu-*.log; do echo "--- $log"; tail -n 15 "$log"; done
python3 scripts/gpu/gpu_tests_summary.py --out "$OUT" --seconds $(( $(date +%s) - start )) "${lists[@]}"
