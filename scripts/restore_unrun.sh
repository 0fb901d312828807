#!/usr/bin/env bash
# After a session's device calls of a re-run: put back the point files that `fsalab supersede`
# moved out in this working tree and that no call measured again, so the tables keep those rows
# (of their older commit) until a later call re-measures them. Only uncommitted moves are undone:
# git lists the original as deleted, and superseded/ (ignored, on disk only) holds its copy
# <point>.<commit>.json with the committed bytes.
# Re-aggregate afterwards (`fsalab aggregate --platform PLATFORM --experiment ...`).
#   bash scripts/restore_unrun.sh [PLATFORM]      (default h200)
set -euo pipefail
cd "$(dirname "$0")/.."
platform=${1:-h200}
root=results/$platform
put_back=0 refused=0
while IFS= read -r original; do
  stem=$(basename "$original" .json)
  experiment=$(basename "$(dirname "$original")")
  copy=""
  # Rows set aside in earlier sessions may share the stem: take the copy of the committed row.
  while IFS= read -r candidate; do
    if cmp -s "$candidate" <(git show "HEAD:$original"); then
      copy=$candidate
      break
    fi
  done < <(find "$root/superseded/$experiment" -maxdepth 1 -type f 2>/dev/null |
    grep -E "/${stem//./\\.}\.([0-9a-f]{7}|unknown)\.json$" || true)
  if [ -z "$copy" ]; then
    echo "left out $original: no superseded copy holds its committed row" >&2
    refused=$((refused + 1))
    continue
  fi
  mv "$copy" "$original"
  put_back=$((put_back + 1))
done < <(git ls-files --deleted -- "$root/")
echo "$put_back point files put back, $refused left out"
[ "$refused" -eq 0 ]
