"""A/B of the branch launch order of whole NSA attention (eager), and where its host time goes.

A: the order of the tree (compress_kv, compressed attention, selection, selected, window, gate);
B: the window branch launched first (it needs only q, k, v), so its kernel runs while the host
   prepares the compression branch; C: B with FSA's partial buffers in one head chunk
   (fsa_plan.BUFFER_BUDGET_BYTES = 8 GiB: 3 launches instead of 3 per chunk).
`auto`, (64, 16), 4 KV heads, d = 128, bf16, value checks off. Per point, interleaved rounds
(30 rounds, A B C and C B A alternately): sync, L2 flush (256 MiB zero), CUDA events around one call; plus each variant's host
enqueue time (no sync after the call) and A's CUDA-graph replay (device time). The outputs of A,
B and C are compared (forward: equal; fwd+bwd's dq may differ in rounding, as its branch
gradients are summed in another order). For 32K/64K g = 1 fwd, a compact timeline of one call
of A and B (kernel starts and durations, host launch-API calls), in the JSON.
Usage on the H200 (repo root): PYTHONPATH=src python results/h200/checks/ab-window-first/ab_window_first.py out.json
"""
import json, statistics, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from fsalab.bench import ops
from fsalab.bench.inputs import make_inputs
from fsalab.checks import value_checks_off
from fsalab.ops.selection import fsa_plan

dev = torch.device("cuda")
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
out = {}


def point(n, g):
    return {"N": n, "g": g, "h_kv": 4, "d": 128, "batch": 1, "block_size": 64, "topk": 16, "dtype": "bfloat16",
            "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}


parts = ops.nsa_parts("auto", None)


def nsa(x, window_first):
    t = x.tensors
    if window_first:
        o_win = parts.window(t["q"], t["k"], t["v"], x.cu_seqlens, x.cfg.window_size)
    o_cmp, block_idx = ops._compress_and_select(parts.compression, x)
    o_slc = parts.selected(t["q"], t["k"], t["v"], block_idx, x.cu_seqlens, x.cfg.block_size)
    if not window_first:
        o_win = parts.window(t["q"], t["k"], t["v"], x.cu_seqlens, x.cfg.window_size)
    return parts.gated_sum(o_cmp, o_slc, o_win, t["gate"])


def variant(name, x, leaves, do, direction):
    wf = name != "A"
    budget = 8 << 30 if name == "C" else fsa_plan.BUFFER_BUDGET_BYTES

    def call():
        old = fsa_plan.BUFFER_BUDGET_BYTES
        fsa_plan.BUFFER_BUDGET_BYTES = budget
        try:
            if direction == "fwd":
                with torch.no_grad():
                    return nsa(x, wf)
            return torch.autograd.grad(nsa(x, wf), leaves, do)
        finally:
            fsa_plan.BUFFER_BUDGET_BYTES = old
    return call


def timeline(fn):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize(); flush.zero_(); torch.cuda.synchronize()
        fn()
        torch.cuda.synchronize()
    ev = prof.events()
    items = []
    for e in ev:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            items.append(("K", e.name[:40], e.time_range.start, e.time_range.end - e.time_range.start))
        elif "aunch" in e.name and e.name.startswith("cu"):
            items.append(("L", e.name[:24], e.time_range.start, e.time_range.end - e.time_range.start))
    items.sort(key=lambda i: i[2])
    ks = [i for i in items if i[0] == "K" and "FillFunctor<unsigned char>" not in i[1]]
    t0 = min(i[2] for i in items)
    return [(k, n, round(s - t0, 1), round(d, 1)) for k, n, s, d in items], \
        round(sum(b[2] - (a[2] + a[3]) for a, b in zip(ks, ks[1:]) if b[2] > a[2] + a[3]), 1)


with value_checks_off():
    for n, g in ((32768, 1), (65536, 1), (32768, 4), (65536, 4)):
        p = point(n, g)
        x0 = make_inputs(p, dev, need_indices=False)
        for direction in ("fwd", "fwd+bwd"):
            names = ("q", "k", "v", "w_k", "w_v", "pe", "gate")
            x = x0.with_leaves(names) if direction != "fwd" else x0
            leaves = [x.tensors[k] for k in names] if direction != "fwd" else []
            do = torch.randn_like(x0.tensors["q"]) if direction != "fwd" else None
            fns = {v: variant(v, x, leaves, do, direction) for v in "ABC"}
            res = {}
            for v, fn in fns.items():
                for _ in range(3):
                    r = fn()
                res[v] = r if direction == "fwd" else r[0]
            torch.cuda.synchronize()
            same = all(torch.equal(res["A"], res[v]) for v in "BC")
            samples = {v: [] for v in fns}
            host = {v: [] for v in fns}
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for r in range(30):
                order = "ABC" if r % 2 == 0 else "CBA"
                for v in order:
                    torch.cuda.synchronize(); flush.zero_()
                    s.record(); fns[v](); e.record(); torch.cuda.synchronize()
                    samples[v].append(s.elapsed_time(e))
                    torch.cuda.synchronize(); flush.zero_()
                    t0 = time.perf_counter(); fns[v](); host[v].append((time.perf_counter() - t0) * 1e3)
                    torch.cuda.synchronize()
            gs = torch.cuda.Stream(); gs.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(gs):
                fns["A"](); fns["A"]()
            torch.cuda.current_stream().wait_stream(gs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fns["A"]()
            gsamp = []
            for _ in range(30):
                torch.cuda.synchronize(); flush.zero_()
                s.record(); graph.replay(); e.record(); torch.cuda.synchronize()
                gsamp.append(s.elapsed_time(e))
            del graph
            tag = f"N{n}-g{g}-{direction}"
            row = {"same_outputs": same, "graph_A_ms": statistics.median(gsamp),
                   **{f"eager_{v}_ms": statistics.median(samples[v]) for v in fns},
                   **{f"host_{v}_ms": statistics.median(host[v]) for v in fns},
                   "samples": samples, "graph_samples": gsamp}
            if g == 1 and direction == "fwd":
                for v in "AB":
                    row[f"timeline_{v}"], row[f"gpu_idle_{v}_us"] = timeline(fns[v])
            out[tag] = row
            print(tag, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                        if not k.startswith(("samples", "graph_samples", "timeline"))}, flush=True)
            torch.cuda.empty_cache()
        del x0
        torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"))
print("\npoint              eager A   B     C    | host A   B    C   | graph A | B/A   C/A")
for tag, r in out.items():
    print(f"{tag:18s} {r['eager_A_ms']:7.3f} {r['eager_B_ms']:7.3f} {r['eager_C_ms']:7.3f} | {r['host_A_ms']:6.3f} "
          f"{r['host_B_ms']:6.3f} {r['host_C_ms']:6.3f} | {r['graph_A_ms']:7.3f} | {r['eager_B_ms'] / r['eager_A_ms']:.3f} "
          f"{r['eager_C_ms'] / r['eager_A_ms']:.3f} same={r['same_outputs']}")
