#!/usr/bin/env bash
# Commit what the device calls of a re-run measured, and nothing else of it: every point file
# written anew or changed (with the tables and logs beside them). Point files set aside and not
# yet measured again stay uncommitted (deleted here, their copies in the ignored superseded/), so
# that `scripts/restore_unrun.sh` can still put them back at the end of the session; `git add -A`
# would commit their deletion.
#   bash scripts/commit_collected.sh PLATFORM GIT-COMMIT-ARGS...   (e.g. h200 -m "message")
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 PLATFORM GIT-COMMIT-ARGS..." >&2; exit 2; }
platform=$1
shift
root=results/$platform
[ -d "$root" ] || { echo "no $root" >&2; exit 2; }
paths=()
remeasured=0
# `--modified` lists deleted files too; only files that exist were measured.
while IFS= read -r f; do
  [ -e "$f" ] && paths+=("$f")
done < <(git ls-files --modified --others --exclude-standard -- "$root/" || true)
while IFS= read -r f; do
  [ -e "$f" ] && [[ $f == *.json ]] && remeasured=$((remeasured + 1))
done < <(git ls-files --modified -- "$root/" || true)
if [ ${#paths[@]} -eq 0 ]; then
  echo "nothing measured under $root to commit" >&2
  exit 1
fi
printf '%s\n' "${paths[@]}" | git add --pathspec-from-file=-
git commit -q "$@"
left=$(git ls-files --deleted -- "$root/" | grep -c . || true)
echo "committed ${#paths[@]} files; points measured again: $remeasured; set aside, still to measure: $left"
