"""A/B of the decode step's launch shape at batch 1, h = 64, d = 128, (64, 16), bf16:
(1) per-kernel device time of the current step (torch.profiler, eager calls);
(2) nsa_decode graph-replayed under split counts per SM f in {2 (current), 4, 8, 16};
(3) the compressed-attention kernel alone: S_c x BLOCK_N x warps x stages x layout
    (token-major as the cache stores it, or head-major copies passed through strides).
Outputs checked against the current configuration. Usage: python ab_decode.py out.json. Ran against the code of e95143d (split counts of 2 per SM, the
score kernel on 4 warps), the state before this A/B landed in 4f34bd9."""
import json, math, sys, statistics
import torch, triton
from fsalab.config import NSAConfig
from fsalab.ops import decode as dec
from fsalab.ops.decode_cache import NSADecodeCache
from fsalab.ops._triton import cdiv

dev = torch.device("cuda")
SM = torch.cuda.get_device_properties(0).multi_processor_count
cfg = NSAConfig(block_size=64, topk=16)
H, D = 64, 128
out = []

def splits_for(f, h_kv, N):
    rows = N // cfg.kernel_stride
    _, bb = dec._score_tile(cfg)
    per = cdiv(f * SM, h_kv)
    return (max(1, min(per, cdiv(rows, 64), 256)), max(1, min(per, cdiv(cfg.num_blocks(N), bb - 1), 256)),
            max(1, min(cdiv(min(cfg.window_size, N), 64), 8)))

def replay_ms(fn, n=200):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for e in ev[1:]:
        g.replay(); e.record()
    torch.cuda.synchronize()
    hot = statistics.median(a.elapsed_time(b) for a, b in zip(ev, ev[1:]))
    cold = triton.testing.do_bench(lambda: g.replay(), warmup=20, rep=200, return_mode="median")
    return hot, cold

def merged(o, lse):
    m = lse.max(-1, keepdim=True).values
    w = torch.exp(lse - m)
    return (o * w[..., None]).sum(-2) / w.sum(-1)[..., None]

for g in (4, 1):
    h_kv = H // g
    for N in (32768, 65536, 131072, 262144):
        gen = torch.Generator(device=dev).manual_seed(N + g)
        cache = NSADecodeCache.allocate(1, N + 64, h_kv, D, cfg, torch.bfloat16, dev, num_heads=H)
        for t in (cache.k, cache.v, cache.k_cmp, cache.v_cmp, cache.k_recent):
            t.normal_(generator=gen)
        cache.lengths.fill_(N); cache.filled = True
        q = torch.randn(1, H, D, device=dev, generator=gen).bfloat16()
        gates = torch.randn(1, H, 3, device=dev, generator=gen).bfloat16()
        row = {"g": g, "N": N, "base_splits": dec.decode_splits(1, h_kv, N + 64, cfg, dev), "kernels_us": {}, "step": {}, "cmp": {}}
        # (1) per-kernel device time, eager
        for _ in range(3): dec.nsa_decode(q, cache, gates)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20): dec.nsa_decode(q, cache, gates)
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if ev.device_type == torch.autograd.DeviceType.CUDA or getattr(ev, "device_time_total", 0):
                us = getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0)) / 20
                if us > 0: row["kernels_us"][ev.key[:40]] = round(us, 2)
        base_o, base_idx = dec.nsa_decode(q, cache, gates)
        # (2) whole attention step under split factors
        for f in (2, 4, 8, 16):
            sp = splits_for(f, h_kv, N + 64)
            o, idx = dec.nsa_decode(q, cache, gates, splits=sp)
            err = (o.float() - base_o.float()).abs().max().item()
            same = (idx == base_idx).float().mean().item()
            hot, cold = replay_ms(lambda: dec.nsa_decode(q, cache, gates, splits=sp))
            row["step"][f] = {"splits": sp, "hot_ms": hot, "cold_ms": cold, "err": err, "idx_same": same}
            print(f"g{g} N{N} f{f} splits {sp}: hot {hot*1e3:.1f} us cold {cold*1e3:.1f} us err {err:.2e} idx {same:.3f}", flush=True)
        # (3) compressed-attention kernel alone
        kc, vc = cache.k_cmp, cache.v_cmp
        layouts = {"tok": (kc, vc), "head": tuple(t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for t in (kc, vc))}
        logits = cache.cmp_logits
        ref = None
        for lay, (k_, v_) in layouts.items():
            for f in (2, 8):
                s_c = splits_for(f, h_kv, N + 64)[0]
                for bn in (64, 128):
                    for w in (4, 8):
                        for st in (2, 3, 4):
                            o_c = torch.empty(1, H, s_c, D, device=dev); l_c = torch.empty(1, H, s_c, device=dev)
                            launch = lambda: dec._cmp_partial_kernel[(1, h_kv, s_c)](
                                q, k_, v_, cache.lengths, o_c, l_c, logits, q.stride(0), q.stride(1), k_.stride(0), k_.stride(1), k_.stride(2),
                                logits.stride(0), logits.stride(1), H, s_c, 1 / math.sqrt(D) * 1.4426950408889634,
                                L=cfg.kernel_size, S=cfg.kernel_stride, BLOCK_N=bn, G=g, G_PAD=max(16, triton.next_power_of_2(g)),
                                HEAD_DIM=D, D_PAD=D, DOT_PREC="tf32", num_warps=w, num_stages=st)
                            try:
                                launch(); torch.cuda.synchronize()
                            except Exception as e:
                                print("fail", lay, f, bn, w, st, repr(e)[:200]); continue
                            mo = merged(o_c, l_c)
                            if ref is None: ref = mo
                            err = (mo - ref).abs().max().item()
                            ms = triton.testing.do_bench(launch, warmup=20, rep=100, return_mode="median")
                            key = f"{lay}-f{f}-sc{s_c}-bn{bn}-w{w}-st{st}"
                            bytes_ = 2 * (N // 16) * h_kv * D * 2
                            row["cmp"][key] = {"ms": ms, "err": err, "TBps": bytes_ / ms / 1e9}
                            print(f"g{g} N{N} cmp {key}: {ms*1e3:.1f} us {bytes_/ms/1e9:.2f} TB/s err {err:.1e}", flush=True)
        print(f"g{g} N{N} kernels(us): {row['kernels_us']}", flush=True)
        out.append(row)
        json.dump(out, open(sys.argv[1], "w"), indent=1)
        del cache, layouts
        torch.cuda.empty_cache()
# summary
print("\n== step (nsa_decode, graph) hot/cold us by split factor ==")
for r in out:
    print(r["g"], r["N"], {f: (round(v["hot_ms"] * 1e3, 1), round(v["cold_ms"] * 1e3, 1)) for f, v in r["step"].items()})
print("\n== cmp kernel: best 3 per point ==")
for r in out:
    best = sorted(r["cmp"].items(), key=lambda kv: kv[1]["ms"])[:3]
    base = [v for k, v in r["cmp"].items() if k.startswith("tok-f2-") and "-bn64-w4-st3" in k]
    print(r["g"], r["N"], "base", round(base[0]["ms"] * 1e3, 1) if base else None, [(k, round(v["ms"] * 1e3, 1), round(v["TBps"], 2)) for k, v in best])
