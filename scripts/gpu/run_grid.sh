#!/usr/bin/env bash
# One device call of an experiment's grid: runs the points matching a filter in one process
# until a wall-clock budget, keeps every finished point (atomic JSON files), and packs
# results/<platform>/ into $OUT/results.tgz. Re-running with the returned results carried
# continues where it stopped (--skip-existing).
#   bash scripts/gpu/run_grid.sh EXPERIMENT FILTER BUDGET_SECONDS [EXTRA RUNNER FLAGS...]
# The runner follows the experiment: train, prefill and convergence have their own, dram runs
# under Nsight Compute (fsalab bench-dram), compile times first calls (fsalab bench-compile), versus times groups side by side (fsalab
# bench-versus; the filter picks groups), decode, inference and generate run decode steps (fsalab
# bench-decode), every other experiment is kernel-level timing (fsalab bench-kernel).
# Of the filter's missing points it runs those expected to fit in the budget (fit_points.py).
# DEADLINE (epoch seconds), when set, caps the budget so that this grid is packed 20 s before it:
# a device call running several grids sets it once, and a call killed at its limit loses nothing
# packed (rows finished after the last pack are lost with it).
set -uo pipefail
exp=$1 filter=$2 budget=$3
shift 3
if [ -n "${DEADLINE:-}" ]; then
  left=$((DEADLINE - $(date +%s) - 20))
  [ "$left" -lt "$budget" ] && budget=$left
  if [ "$budget" -le 0 ]; then echo "run_grid $exp: no time left before DEADLINE" >&2; exit 0; fi
fi
case $exp in
  train|prefill|convergence) runner=bench-$exp ;;
  dram) runner=bench-dram ;;
  compile) runner=bench-compile ;;
  versus) runner=bench-versus ;;
  decode|inference|generate) runner=bench-decode ;;
  *) runner=bench-kernel ;;
esac
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export FSALAB_DISPATCH_CACHE="$PWD/results/dispatch-cache.json"
# Compiled kernels in an ignored folder of the checkout, which the device machine keeps between
# calls while it stays warm, so a second call of a session can reuse the first's Triton builds
# (the compile experiment gives each point a fresh cache of its own regardless).
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.cache/triton}"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" results
python3 -m fsalab.cli env | head -20
end=$(( $(date +%s) + budget ))
run() {  # the runner on a filter, stopped at the end of the budget
  timeout --signal=INT "$1" python3 -m fsalab.cli "$runner" --experiment "$exp" --all --skip-existing \
    --filter="$2" --results-dir results "${@:3}" 2>&1 | tee -a "$OUT/grid-$exp.log" | grep -v ": exists, skipped" |
    tail -n 400 | cut -c1-160
}
if [ "$runner" = bench-versus ] || [ "${FIT_POINTS:-1}" != 1 ]; then
  # The versus runner's filter picks groups, so it keeps its own; FIT_POINTS=0 runs the filter as given.
  run "$budget" "$filter" "$@"
else
  # Only the missing points expected to finish inside the time left (scripts/gpu/fit_points.py), again
  # while a run ends early and more fit; a point still running at the end would be lost.
  for _ in 1 2 3 4; do
    left=$(( end - $(date +%s) ))
    fitted=$(python3 "$(dirname "$0")/fit_points.py" --platform "${FSALAB_PLATFORM:-h200}" -- "$exp" "$filter" "$left")
    case $? in
      0) ;;
      3) break ;;
      *) echo "run_grid $exp: fit_points failed; running the filter as given" >&2
       run "$left" "$filter" "$@"; break ;;
    esac
    run "$left" "$fitted" "$@"
    [ "$fitted" = "$filter" ] && break  # every missing point was offered
  done
fi
OUT=$OUT bash "$(dirname "$0")/pack_results.sh"
