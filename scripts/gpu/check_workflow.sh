#!/usr/bin/env bash
# GPU check of the benchmark runners: a few small points of every kernel-level
# experiment through the real runners, written under results/<gpu>-check/ (never the committed
# platform folder), then a one-line-per-point summary: status, latency, correctness check.
# Takes a few minutes on an H200 (mostly Triton compiles). Run from anywhere:
#   bash scripts/gpu/check_workflow.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PLAT="$(python -c 'from fsalab.bench.provenance import detect_platform; print(detect_platform())')-check"
fsalab env
run() { fsalab "$@" --platform "$PLAT" --skip-existing; }
run bench-kernel --experiment kernel --all --filter '(fwd|fwdbwd)-N8192-b1-hkv4-g(1|4)-d128-B64-T16'
run bench-kernel --experiment breakdown --all --filter 'N32768-b1-hkv4-g4-d128-B64-T16'
run bench-kernel --experiment ablation --all --filter 'g4-d128-B64-T16'
run bench-kernel --experiment buffers --all --filter 'N32768-.*B64-T16'
run bench-kernel --experiment longctx --all --filter 'fwd-N131072-b1-hkv16-g4-d128-B64-T16'
run bench-dram --experiment dram --all --filter 'g4-d128-B64-T16'
fsalab aggregate --experiment kernel breakdown ablation buffers longctx dram --platform "$PLAT"
python - "$PLAT" <<'PY'
import sys
from fsalab import results
plat = sys.argv[1]
for exp in ("kernel", "breakdown", "ablation", "buffers", "longctx", "dram"):
    df = results.load_table(plat, exp)
    for _, r in df.iterrows():
        ms = "" if r["median_ms"] != r["median_ms"] else f"{r['median_ms']:.3f} ms"
        mem = "" if r.get("peak_mem_gib") != r.get("peak_mem_gib") else f"{r['peak_mem_gib']:.2f} GiB"
        print(f"{exp:9s} {r['point']:70s} {r['status']:11s} {ms:>12s} {mem:>10s} check={r.get('check_status')} "
              f"{str(r.get('message') or '')[:100]}")
PY
