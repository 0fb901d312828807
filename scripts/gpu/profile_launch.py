"""Where the time of a short kernel call goes: host (launch path) vs device (kernels).

For each impl at the kernel experiment's points matching --filter (default: the selected op,
g = 1, (64, 16), 8K and 64K, fwd and bwd; whole NSA attention with e.g.
'^nsaattention-(IMPL)-(fwd|fwdbwd)-N(8192|65536)-b1-hkv4-g4-d128-B64-T16-bf16$'):
- the do_bench median (what results/h200/kernel.csv reports);
- the host time to enqueue one call (mean over 50 calls, each started on an idle GPU);
- the device time (sum of the CUDA kernels' durations per call, from torch.profiler), the
  number of kernels per call and each kernel's share (largest first; --json keeps them all);
- the do_bench median of the same call replayed from a CUDA graph (no launch path; the call has
  no host sync, so it can be captured).
When the host time exceeds the device time the call is launch-bound and the median sits on the
host time; the graph replay shows what the call costs without it.

    python scripts/gpu/profile_launch.py [--impls fsa,nsa,fsa_paper] [--filter REGEX] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from fsalab.bench import grid, ops
from fsalab.bench.inputs import make_inputs
from fsalab.bench.kernel import _timed_callable, _value_checks_off

CALLS = 50


def host_ms(fn) -> float:
    """Mean time for the host to enqueue one call, each call started on an idle GPU.

    One call at a time, so the launch queue (about a thousand pending kernels) can never fill
    and block the host: queuing many calls back to back would make this time converge to the
    device time whenever the GPU is the bottleneck."""
    total = 0.0
    for _ in range(CALLS):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        total += time.perf_counter() - t
    torch.cuda.synchronize()
    return total / CALLS * 1e3


def device_ms(fn) -> tuple[float, float, dict[str, float]]:
    """(sum of kernel durations per call in ms, kernels per call, ms per call of each kernel
    name, largest first): where a whole NSA attention call spends its device time."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time / 10 / 1e3
    total_us = sum(e.device_time for e in kernels)
    return total_us / 10 / 1e3, len(kernels) / 10, dict(sorted(by_name.items(), key=lambda kv: -kv[1]))


def graph_ms(fn) -> float | None:
    """do_bench median of ``fn`` replayed from a CUDA graph; None (reason on stderr) when the
    call cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):  # capture needs warm-up work off the default stream
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # noqa: BLE001 - whatever stops the capture is the finding, reported
        print(f"CUDA graph capture failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return do_bench(graph.replay, warmup=25, rep=100, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="fsa,nsa,fsa_paper")
    ap.add_argument("--filter", default=r"^selected-(IMPL)-(fwd|bwd)-N(8192|65536)-b1-hkv4-g1-d128-B64-T16-bf16$")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    exp = grid.load_experiment("kernel")
    pattern = args.filter.replace("IMPL", args.impls.replace(",", "|").replace("_", ""))
    # Sorted by size so that points sharing inputs run back to back (inputs are cached by key).
    points = sorted((p for p in grid.expand(exp) if re.search(pattern, p["id"])), key=lambda p: p["N"])
    rows = []
    device = torch.device("cuda")
    for p in points:
        bound = ops.bind(p["op"], p["impl"], p.get("options") or {})
        x = make_inputs(p, device)
        with _value_checks_off():
            fn = _timed_callable(bound, x, p["direction"], p["seed"])
            for _ in range(3):
                fn()
            med = do_bench(fn, warmup=25, rep=100, return_mode="median")
            host = host_ms(fn)
            dev, kernels, per_kernel = device_ms(fn)
            graphed = graph_ms(fn)
        row = {"point": p["id"], "impl": p["impl"], "direction": p["direction"], "N": p["N"], "median_ms": med,
               "host_ms": host, "device_ms": dev, "kernels_per_call": kernels, "graph_ms": graphed, "device_ms_by_kernel": per_kernel}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'point':62s} {'median':>8s} {'host':>8s} {'device':>8s} {'kernels':>8s} {'graph':>8s}")
    for r in rows:
        graphed = "failed" if r["graph_ms"] is None else f"{r['graph_ms']:8.3f}"
        print(f"{r['point']:62s} {r['median_ms']:8.3f} {r['host_ms']:8.3f} {r['device_ms']:8.3f} {r['kernels_per_call']:8.1f} {graphed:>8s}")
    print("\nlargest kernels per call (ms):")
    for r in rows:
        top = ", ".join(f"{name[:40]} {ms:.3f}" for name, ms in list(r["device_ms_by_kernel"].items())[:6])
        print(f"{r['point']}: {top}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
