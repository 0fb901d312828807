#!/usr/bin/env bash
# One device call of a multi-GPU experiment (train_fsdp, prefill_tp) under torchrun: the points
# matching a filter, run until a wall-clock budget, every finished point kept; results/<platform>/
# packed into $OUT/results.tgz (re-run with them carried to continue, --skip-existing).
#   bash scripts/gpu/run_torchrun.sh EXPERIMENT NPROC FILTER BUDGET_SECONDS [EXTRA RUNNER FLAGS...]
# The platform is h200x<GPUs on the host> unless a --platform flag is passed.
set -uo pipefail
exp=$1 nproc=$2 filter=$3 budget=$4
shift 4
# The runner comes from the experiment's YAML (`runner:`), as everywhere else.
module=$(PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
  'import sys; from fsalab.bench import grid; print("fsalab.bench." + grid.load_experiment(sys.argv[1])["runner"])' \
  "$exp") || { echo "run_torchrun.sh: no experiment '$exp'" >&2; exit 2; }
gpus=$(nvidia-smi -L | wc -l)
if (( nproc > gpus )); then
  echo "run_torchrun.sh: $nproc ranks asked, $gpus GPUs here" >&2; exit 2
fi
# NVLink multicast stays off (the machines' rule; torchrun passes the environment on).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" results
platform=(--platform "h200x$gpus")
[[ " $* " == *" --platform "* ]] && platform=()
timeout --signal=INT "$budget" python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
  -m "$module" --experiment "$exp" --all --skip-existing --filter="$filter" --results-dir results \
  "${platform[@]}" "$@" 2>&1 | tee -a "$OUT/torchrun-$exp-np$nproc.log" | grep -v ": exists, skipped" | tail -n 200 | cut -c1-160
OUT=$OUT bash "$(dirname "$0")/pack_results.sh"
