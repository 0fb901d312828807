"""Eager host cost of the value checks in a module forward: NativeSparseAttention (fsa, 4 KV
heads, g = 4, d = 128, bf16, (64, 16)) at 8K-32K tokens, forward under no_grad and forward +
backward, with FSALAB_VALUE_CHECKS=1 (the default) and 0, timed side by side by
``fsalab.bench.timing.interleaved`` (synced before each call, so host-bound time shows; medians);
run it at this tree and at 55b0fe7, the commit before the checks ran once per input, to see
what the change saved. Launch counts from fsalab.testing.LaunchCounter. Prediction
(docs/perf-log.md, "Value checks once per input"): 35 fewer launches per forward, at most ~1 ms
less host time where the call is host-bound (8K-16K), nothing at 64K.

Ran at 3e5a55c only (checks.log, checks.json; the run at 55b0fe7 is not done): with checks on and
off alike, 81 launches per forward at 8K and 16K, 84 at 32K; forward 3.41 / 3.30 ms at 8K, 3.94 /
3.81 at 16K, 7.86 / 7.61 at 32K (on / off, 1.03x), forward + backward 8.41 / 8.59, 9.71 / 10.09,
19.15 / 19.38 (0.96-0.99x): with the same launches, checks on cost the forward 0.11-0.25 ms.

Usage on the H200 (repo root):
  PYTHONPATH=src python results/h200/checks/value-checks-host/time_value_checks.py out.json
"""
import json
import os
import sys

import torch

from fsalab.bench.timing import Rounds, interleaved
from fsalab.config import NSAConfig
from fsalab.modules import NativeSparseAttention
from fsalab.testing import LaunchCounter, cu_seqlens_of

dev = torch.device("cuda")
torch.manual_seed(0)
module = NativeSparseAttention(2048, 16, 4, head_dim=128, config=NSAConfig(), dtype=torch.bfloat16,
                               selection_impl="fsa", device=dev)
out = []
for n in (8192, 16384, 32768):
    x = torch.randn(n, 2048, dtype=torch.bfloat16, device=dev, requires_grad=True)
    cu = cu_seqlens_of([n], dev)

    def call(checks, backward):
        def run():
            os.environ["FSALAB_VALUE_CHECKS"] = checks
            if backward:
                module(x, cu).sum().backward()
            else:
                with torch.no_grad():
                    module(x, cu)
        return run

    row = {"N": n}
    for checks in ("1", "0"):
        fwd = call(checks, False)
        fwd()
        with LaunchCounter() as counter:
            fwd()
        row[f"launches_fwd_checks{checks}"] = counter.total
    timed = interleaved({f"{d}_checks{c}": call(c, d == "fwdbwd") for d in ("fwd", "fwdbwd") for c in ("1", "0")},
                        dev, rounds=Rounds(rounds=50, rep_ms=500.0), warmup=3)
    row.update({f"{name}_ms": t.summary()["median_ms"] for name, t in timed.items()})
    out.append(row)
    print(row, flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
