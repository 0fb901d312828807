#!/usr/bin/env bash
# Commit what the device calls of a re-run measured, and nothing else of it: every point file
# written anew or changed outside superseded/ (with the tables and logs beside them), and the
# superseded copy of each point measured again. Point files set aside and not yet measured again
# stay uncommitted (deleted here, their copies untracked), so that `scripts/restore_unrun.sh` can
# still put them back at the end of the session; `git add -A` would commit their deletion.
#   bash scripts/commit_collected.sh PLATFORM GIT-COMMIT-ARGS...   (e.g. h200 -m "message")
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 PLATFORM GIT-COMMIT-ARGS..." >&2; exit 2; }
platform=$1
shift
root=results/$platform
[ -d "$root" ] || { echo "no $root" >&2; exit 2; }
paths=()
# `--modified` lists deleted files too; only files that exist were measured.
while IFS= read -r f; do
  [ -e "$f" ] && paths+=("$f")
done < <(git ls-files --modified --others --exclude-standard -- "$root/" | grep -v "^$root/superseded/" || true)
remeasured=0
while IFS= read -r copy; do
  experiment=$(basename "$(dirname "$copy")")
  stem=$(basename "$copy" .json)
  original=$root/$experiment/${stem%.*}.json
  if [ -e "$original" ]; then
    paths+=("$copy")
    remeasured=$((remeasured + 1))
  fi
done < <(git ls-files --others --exclude-standard -- "$root/superseded/" |
  grep -E '\.([0-9a-f]{7}|unknown)\.json$' || true)
if [ ${#paths[@]} -eq 0 ]; then
  echo "nothing measured under $root to commit" >&2
  exit 1
fi
printf '%s\n' "${paths[@]}" | git add --pathspec-from-file=-
git commit -q "$@"
left=$(git ls-files --deleted -- "$root/" | grep -vc "^$root/superseded/" || true)
echo "committed ${#paths[@]} files; points measured again: $remeasured; set aside, still to measure: $left"
