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
timeout --signal=INT "$budget" python3 -m fsalab.cli "$runner" --experiment "$exp" --all --skip-existing \
  --filter="$filter" --results-dir results "$@" 2>&1 | tee -a "$OUT/grid-$exp.log" | grep -v ": exists, skipped" | tail -n 400 | cut -c1-160
OUT=$OUT bash "$(dirname "$0")/pack_results.sh"
