#!/usr/bin/env bash
# A/B of the FSA forward's containing launch: before (the plain launch's grid, code of 664f9f8)
# and after (one program per row and head program) — the two trees differ by change.patch
# (ops/selection/fsa.py and fsa_partials.py). Each tree runs the ablation experiment's
# forward points at 64K, (64, 16), g = 1 and 4 (fsa, fsa_paper and its two switches off) with
# the experiment's own runner, in its own process, alternating before / after / before / after.
#   source scripts/gpu/setup_site.sh; OUT=... bash results/h200/checks/ab-contain-grid/run_ab.sh
# from the repository root (SMOKE=1 FILTER=. runs the smoke grid instead: a CPU check of the script).
set -euo pipefail
here=results/h200/checks/ab-contain-grid root=$PWD
export FSALAB_ROOT=$root  # experiments and schemas from the checkout for both trees (rows' provenance too)
before=/tmp/ab-contain-before
rm -rf "$before" && mkdir -p "$before" && cp -rL src "$before/src"  # -L: the package data links point outside src
(cd "$before" && { git apply -R "$root/$here/change.patch" || patch -R -p1 < "$root/$here/change.patch"; })  # the change, undone
filter=${FILTER:-'selected-(fsa|fsapaper)-fwd-N65536-b1-hkv4-g[14]-d128-B64-T16-bf16'}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for round in 1 2; do
  for side in before after; do
    tree=$root; [ "$side" = before ] && tree=$before
    PYTHONPATH="$tree/src${PYTHONPATH:+:$PYTHONPATH}" python3 -m fsalab.cli bench-kernel --experiment ablation ${SMOKE:+--smoke} --all \
      --filter="$filter" --results-dir "$OUT/$side-$round" --force 2>&1 | { grep -E "^\[" || true; } | sed "s/^/$side-$round /"
  done
done | tee "$OUT/ab.log"
python3 - "$OUT" <<'PY' | tee -a "$OUT/ab.log"
import glob, json, os, sys
from collections import defaultdict
t = defaultdict(dict)
for f in glob.glob(os.path.join(sys.argv[1], "*-*", "**", "*.json"), recursive=True):
    side = os.path.relpath(f, sys.argv[1]).split(os.sep)[0]
    r = json.load(open(f))
    t[r["point"]][side] = r.get("median_ms")
print("| point | before ms (2 runs) | after ms (2 runs) | after / before |")
print("|---|---|---|---|")
for p in sorted(t):
    b = [t[p].get(f"before-{i}") for i in (1, 2)]
    a = [t[p].get(f"after-{i}") for i in (1, 2)]
    if None in a + b:
        print(f"| {p} | {b} | {a} | missing |")
        continue
    print(f"| {p} | {b[0]:.3f} / {b[1]:.3f} | {a[0]:.3f} / {a[1]:.3f} | {min(a) / min(b):.3f} |")
PY
