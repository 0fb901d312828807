"""Peak memory of each NSA branch's forward + backward at one shape (CUDA), to find which one
makes a whole-NSA-attention fwd+bwd run out of memory.

For every point of ``--experiment`` whose id matches ``--filter`` (default: the longctx 128K
(128, 8) points at h_kv = 64 and 32, with N replaced by ``--tokens``), and for each branch op
(compressed, selected with the point's impl, window), one fwd+bwd call through the kernel
runner's callable, then ``torch.cuda.max_memory_allocated`` minus what was allocated before.

    python scripts/gpu/probe_memory.py [--tokens 32768] [--filter REGEX]
"""

from __future__ import annotations

import argparse
import re

import torch

from fsalab.bench import grid, ops
from fsalab.bench.inputs import make_inputs
from fsalab.bench.kernel import _timed_callable


def peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiment", default="longctx")
    ap.add_argument("--filter", default=r"^nsaattention-.*-fwdbwd-N131072-b1-hkv(64|32)-.*-B128-T8")
    ap.add_argument("--tokens", type=int, default=32768)
    args = ap.parse_args()
    device = torch.device("cuda")
    for p in grid.expand(grid.load_experiment(args.experiment)):
        if not re.search(args.filter, p["id"]):
            continue
        p = {**p, "N": args.tokens}
        for op, impl in (("compressed", "triton"), ("selected", p["impl"]), ("window", "triton"), ("nsa_attention", p["impl"])):
            bound = ops.bind(op, impl, p.get("options"))
            inputs = make_inputs({**p, "op": op}, device, need_indices=bound.need_indices)
            try:
                fn = _timed_callable(bound, inputs, "fwd+bwd", p["seed"])
                fn()
                gib = f"{peak_gib(fn):8.2f}"
            except torch.OutOfMemoryError:
                gib = "     oom"
            print(f"{p['impl']:4s} h_kv={p['h_kv']:3d} g={p['g']} N={args.tokens:7d} {op:14s} peak {gib} GiB", flush=True)
            del bound
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
