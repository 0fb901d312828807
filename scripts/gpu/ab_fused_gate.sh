#!/usr/bin/env bash
# A/B of ops/gate.py inside whole NSA attention: the kernel experiment's nsa_attention point
# (fsa, g = 4, 4 KV heads, d 128, (64, 16), bf16) at 8K and 64K, fwd and fwd+bwd, timed with the
# fused gated sum and with torch's (--option gate_impl=reference), alternating A/B/B/A so drift
# between processes cancels. Result files are packed into $OUT/ab.tgz (the device tool returns
# at most 8 files); prints a table last: median ms of each variant (mean of its two runs) and the
# ratio torch / fused.
#   bash scripts/gpu/ab_fused_gate.sh
set -euo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
ab=$(mktemp -d)
mkdir -p "$OUT"
run() {  # N direction variant repetition
  local opt=() tag=fused
  if [[ $3 == torch ]]; then opt=(--option gate_impl=reference); tag=torch; fi
  python3 -m fsalab.cli bench-kernel --experiment kernel --op nsa_attention --impl fsa --g 4 --h-kv 4 \
    --d 128 --block-size 64 --topk 16 --dtype bfloat16 --N "$1" --direction "$2" "${opt[@]}" \
    --out "$ab/N$1-${2/+/}-$tag-$4.json"
}
for n in 8192 65536; do
  for dir in fwd fwd+bwd; do
    run $n $dir fused 1; run $n $dir torch 1; run $n $dir torch 2; run $n $dir fused 2
  done
done
tar -czf "$OUT/ab.tgz" -C "$ab" .
python3 - "$ab" <<'PY'
import json, pathlib, statistics, sys
rows = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    if r["status"] != "ok":
        print(f"{f.name}: {r['status']} {r['message']}")
        continue
    rows.setdefault((r["N"], r["direction"], r["sources"]["gate"]), []).append(r["median_ms"])
print(f"{'N':>6} {'direction':>9} {'fused ms':>9} {'torch ms':>9} {'torch/fused':>11}")
for (n, d) in sorted({k[:2] for k in rows}):
    f, t = (statistics.mean(rows.get((n, d, g), [float("nan")])) for g in ("triton", "reference"))
    print(f"{n:>6} {d:>9} {f:>9.3f} {t:>9.3f} {t / f:>11.3f}")
PY
