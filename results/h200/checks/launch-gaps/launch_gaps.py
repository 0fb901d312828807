"""Where the eager call of whole NSA attention loses time to its host (eager minus graph-replayed).

For `auto` at (64, 16), 4 KV heads, d = 128, bf16, value checks off (as the versus runner):
N = 32K and 64K, g = 1 and 4, fwd and fwd+bwd. Per point:
- eager: sync, L2 flush, CUDA events around one call (median of 30), as timing.interleaved;
- host: the same call's Python return time without a sync after it (median of 30; the queue never
  fills at these sizes, so this is the host's whole enqueue time);
- graph: the call replayed from a CUDA graph (median of 30) = the device time;
- a torch.profiler trace of 3 eager calls (CPU + CUDA): each GPU idle gap > 5 us between the call's
  kernels, with the name of the kernel after it, summed per call; and the host time spent in
  cudaLaunchKernel / cuLaunchKernel(Ex) against the rest;
- cProfile of 20 host enqueues (no sync), top functions by cumulative and internal time.
Usage on the H200 (repo root): PYTHONPATH=src python results/h200/checks/launch-gaps/launch_gaps.py OUTDIR
"""
import cProfile, io, json, os, pstats, statistics, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from fsalab.bench import ops
from fsalab.bench.inputs import make_inputs
from fsalab.checks import value_checks_off

out_dir = sys.argv[1]
os.makedirs(out_dir, exist_ok=True)
dev = torch.device("cuda")
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
summary = {}


def point(n, g):
    return {"N": n, "g": g, "h_kv": 4, "d": 128, "batch": 1, "block_size": 64, "topk": 16, "dtype": "bfloat16",
            "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}


def eager_ms(fn, reps=30):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        flush.zero_()
        s.record(); fn(); e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def host_ms(fn, reps=30):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        flush.zero_()
        t0 = time.perf_counter(); fn(); out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


def graph_ms(fn, reps=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    r = eager_ms(g.replay, reps)
    del g
    return r


def gaps(fn, tag):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            torch.cuda.synchronize()
            flush.zero_()
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    path = os.path.join(out_dir, f"trace-{tag}.json")
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    kern = sorted([e for e in ev if e.get("cat") == "kernel"], key=lambda e: e["ts"])
    launches = [e for e in ev if e.get("cat") == "cuda_runtime" and "aunch" in e.get("name", "")]
    calls, cur, leads, flush_end = [], [], [], None
    for k in kern:  # split into calls at the flush kernels (fill of 256 MiB) or gaps > 2 ms
        is_flush = "FillFunctor<unsigned char>" in k["name"]
        if (is_flush or (cur and k["ts"] - (cur[-1]["ts"] + cur[-1]["dur"]) > 2000)) and cur:
            calls.append(cur); cur = []
        if is_flush:
            flush_end = k["ts"] + k["dur"]
            continue
        if not cur:
            leads.append(None if flush_end is None else round(k["ts"] - flush_end, 1))
        cur.append(k)
    if cur:
        calls.append(cur)
    res = []
    for c, lead in list(zip(calls, leads))[-2:]:
        span = c[-1]["ts"] + c[-1]["dur"] - c[0]["ts"]
        busy = sum(k["dur"] for k in c)
        gl = []
        for a, b in zip(c, c[1:]):
            gap = b["ts"] - (a["ts"] + a["dur"])
            if gap > 5:
                gl.append((round(gap, 1), b["name"][:50]))
        res.append({"span_us": round(span, 1), "busy_us": round(busy, 1), "idle_us": round(span - busy, 1),
                    "kernels": len(c), "lead_us": lead, "top_gaps": sorted(gl, reverse=True)[:12]})
    launch_us = sum(e["dur"] for e in launches) / 3
    return res, round(launch_us, 1), len(launches) // 3


def cprof(fn, tag):
    pr = cProfile.Profile()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    pr.enable()
    for _ in range(20):
        fn()
        torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(40)
    open(os.path.join(out_dir, f"cprofile-{tag}.txt"), "w").write(s.getvalue())


with value_checks_off():
    for n, g in ((65536, 1), (32768, 1), (65536, 4)):
        p = point(n, g)
        bound = ops.bind("nsa_attention", "auto")
        x = make_inputs(p, dev, need_indices=bound.need_indices)
        for direction in ("fwd", "fwd+bwd"):
            tag = f"N{n}-g{g}-{direction}"
            fn = ops.direction_callable(bound, x, direction, 0)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            r = {"eager_ms": eager_ms(fn), "host_ms": host_ms(fn), "graph_ms": graph_ms(fn)}
            r["calls"], r["launch_api_us_per_call"], r["launch_api_calls"] = gaps(fn, tag)
            cprof(fn, tag)
            summary[tag] = r
            print(tag, json.dumps({k: v for k, v in r.items() if k != "calls"}), flush=True)
            for c in r["calls"][-1:]:
                print("   ", json.dumps(c), flush=True)
        del x
        torch.cuda.empty_cache()
json.dump(summary, open(os.path.join(out_dir, "summary.json"), "w"), indent=1)
