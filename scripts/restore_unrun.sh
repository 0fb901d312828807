#!/usr/bin/env bash
# After a session's device calls of a re-run: put back the point files that `fsalab supersede`
# moved out in this working tree and that no call measured again, so the tables keep those rows
# (of their older commit) until a later call re-measures them. Only uncommitted moves are undone:
# git lists the original as deleted and the superseded copy <point>.<commit>.json as untracked.
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
  copies=$(git ls-files --others --exclude-standard -- "$root/superseded/$experiment/" |
    grep -E "/${stem//./\\.}\.([0-9a-f]{7}|unknown)\.json$" || true)
  if [ "$(printf '%s' "$copies" | grep -c .)" != 1 ]; then
    echo "left out $original: $(printf '%s' "$copies" | grep -c .) untracked superseded copies" >&2
    refused=$((refused + 1))
    continue
  fi
  mv "$copies" "$original"
  put_back=$((put_back + 1))
done < <(git ls-files --deleted -- "$root/" | grep -v "^$root/superseded/")
echo "$put_back point files put back, $refused left out"
[ "$refused" -eq 0 ]
