#!/usr/bin/env bash
# Pack the results/ tree of a device call into $OUT/results.tgz, for `fsalab collect` here. The
# runs write point files, tables and logs; what was set aside (superseded/) and the A/B checks
# stay out of the archive, which must stay under the 16 MiB a returned file may have.
#   OUT=... bash scripts/gpu/pack_results.sh      (from the repository root)
set -euo pipefail
OUT=${OUT:-/tmp/out}
tar -czf "$OUT/results.tgz" --exclude="results/*/superseded" --exclude="results/*/checks" results
