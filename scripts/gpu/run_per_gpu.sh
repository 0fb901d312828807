#!/usr/bin/env bash
# Runs single-GPU device-call commands side by side on a multi-GPU host, one GPU each, so one
# call of a 2-GPU machine measures two experiments at once (each process sees only its own GPU,
# so points never share a GPU; the host's CPUs are shared). Each command gets OUT=$OUT/gpu<i>
# (its logs) and its console in $OUT/gpu<i>/console.log; once all have finished, results/ is packed
# into $OUT/results.tgz (scripts/gpu/pack_results.sh).
#   bash scripts/gpu/run_per_gpu.sh "CMD FOR GPU 0" "CMD FOR GPU 1" ...
# e.g. bash scripts/gpu/run_per_gpu.sh \
#        "fsalab bench-kernel --experiment longctx --paper --all --skip-existing --budget-s 540" \
#        "fsalab bench-kernel --experiment kernel --paper --all --skip-existing --budget-s 540"
set -uo pipefail
OUT=${OUT:-/tmp/out}
gpus=$(nvidia-smi -L | wc -l)
if (( $# > gpus )); then
  echo "run_per_gpu.sh: $# commands, $gpus GPUs here" >&2; exit 2
fi
pids=() i=0
for cmd in "$@"; do
  mkdir -p "$OUT/gpu$i"
  CUDA_VISIBLE_DEVICES=$i OUT="$OUT/gpu$i" bash -c "$cmd" >"$OUT/gpu$i/console.log" 2>&1 &
  pids+=($!) i=$((i + 1))
done
status=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || status=1
  echo "== GPU $i: $(tail -n 3 "$OUT/gpu$i/console.log" | tr '\n' ' ' | cut -c1-300)"
done
rm -f "$OUT"/gpu*/results.tgz
OUT=$OUT bash "$(dirname "$0")/pack_results.sh"
exit $status
