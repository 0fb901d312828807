"""Eager host cost of the value checks in a module forward: NativeSparseAttention (fsa, 4 KV
heads, g = 4, d = 128, bf16, (64, 16)) at 8K-32K tokens, forward under no_grad and forward +
backward, with FSALAB_VALUE_CHECKS=1 (the default) and 0 in one process (run it at this tree and
at 55b0fe7, the commit before the checks ran once per input, to see what the change saved).
do_bench medians; launch counts from fsalab.testing.LaunchCounter. Prepared, not
yet run. Prediction (docs/perf-log.md, "Value checks once per input"): ~35 fewer launches per
forward, 0.2-0.3 ms less host time where the call is host-bound (8K-16K), nothing at 64K.

Usage on the H200 (repo root):
  PYTHONPATH=src python results/h200/checks/value-checks-host/time_value_checks.py out.json
"""
import json
import os
import sys

import torch
import triton

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
    row = {"N": n}
    for checks in ("1", "0"):
        os.environ["FSALAB_VALUE_CHECKS"] = checks

        def fwd():
            with torch.no_grad():
                return module(x, cu)

        def fwd_bwd():
            module(x, cu).sum().backward()

        fwd(), fwd_bwd()
        with LaunchCounter() as counter:
            fwd()
        row[f"launches_fwd_checks{checks}"] = counter.total
        row[f"fwd_ms_checks{checks}"] = triton.testing.do_bench(fwd, warmup=20, rep=200)
        row[f"fwdbwd_ms_checks{checks}"] = triton.testing.do_bench(fwd_bwd, warmup=10, rep=200)
    out.append(row)
    print(row, flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
