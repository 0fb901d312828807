#!/usr/bin/env bash
# The commit whose code a device call measures: the last commit that changed what the runners
# execute: src/ (kernels, runners; not the reproduction tables or plotting), experiments/ (the
# grids) and workflow/schemas/ (their defaults). Rows name it through FSALAB_GIT_COMMIT, so a
# re-run spread over calls at later commits that touch only docs, results, scripts or the
# reproduction code stays one commit's rows. Run here, before the call; refuses when those
# paths differ from that commit (uncommitted or untracked changes).
#   FSALAB_GIT_COMMIT=$(bash scripts/gpu/code_commit.sh) || exit
set -euo pipefail
cd "$(dirname "$0")/../.."
code=(src experiments workflow/schemas ':(exclude)src/fsalab/reproduction' ':(exclude)src/fsalab/plotting.py')
if [ -n "$(git status --porcelain -- "${code[@]}")" ]; then
  echo "the measured code holds uncommitted changes; commit them first, so the rows name the code they measured:" >&2
  git status --short -- "${code[@]}" >&2
  exit 1
fi
git log -1 --format=%H -- "${code[@]}"
