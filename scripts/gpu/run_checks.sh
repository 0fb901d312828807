#!/usr/bin/env bash
# Run GPU check scripts in one device call; logs and JSON go to $OUT/checks.tar.gz.
# Each argument is a script name under scripts/gpu/ followed by its arguments, in one word:
#   bash scripts/gpu/run_checks.sh check_nsa "check_compression --long 131072 262144" ...
# CHECK_TIMEOUT (seconds, default 600) stops any one script that runs longer.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
status=0
for spec in "$@"; do
  read -r -a words <<< "$spec"
  name=${words[0]}
  echo "=== $spec"
  start=$(date +%s)
  if ! timeout --signal=INT "${CHECK_TIMEOUT:-600}" python3 "scripts/gpu/$name.py" "${words[@]:1}" > "$OUT/logs/$name.log" 2>&1; then
    echo "FAILED: $name"; status=1
  fi
  echo "--- $name took $(( $(date +%s) - start )) s; tail:"
  tail -n 25 "$OUT/logs/$name.log"
done
tar -czf "$OUT/checks.tar.gz" -C "$OUT" logs $(cd "$OUT" && ls *.json 2>/dev/null) && rm -rf "$OUT/logs"
exit $status
