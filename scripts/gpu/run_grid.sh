#!/usr/bin/env bash
# One device call of the kernel-level grid: runs the points matching a filter in one process
# until a wall-clock budget, keeps every finished point (atomic JSON files), and packs
# results/<platform>/ into $OUT/results.tgz. Re-running with the returned results carried
# continues where it stopped (--skip-existing).
#   bash scripts/gpu/run_grid.sh EXPERIMENT FILTER BUDGET_SECONDS
set -uo pipefail
exp=$1 filter=$2 budget=$3
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export FSALAB_DISPATCH_CACHE="$PWD/results/dispatch-cache.json"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" results
python3 -m fsalab.cli env | head -20
timeout --signal=INT "$budget" python3 -m fsalab.cli bench-kernel --experiment "$exp" --all --skip-existing \
  --filter "$filter" --results-dir results 2>&1 | tee "$OUT/grid-$exp.log" | grep -v ": exists, skipped" | tail -n 400 | cut -c1-160
tar -czf "$OUT/results.tgz" results
