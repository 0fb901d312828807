"""A/B of the decode step's split counts and the score kernel's warps, batch 1, h = 64, d = 128,
(64, 16), bf16. The five attention launches of ops.decode.nsa_decode, replicated with knobs:
S_c from f_c programs per SM, S_s from f_s per SM (caps 256), the score kernel's num_warps.
Per variant: graph-replayed step (hot: consecutive replays; cold: do_bench, L2 flushed), per-kernel
device time (torch.profiler, eager), output and block_idx against nsa_decode as it stands.
Usage: python ab_decode2.py out.json. Ran against the code of e95143d, the state before 4f34bd9
landed the chosen rule (fc8 with 128-token compressed ranges, fs8, one warp)."""
import json, math, sys, statistics
import torch, triton
from fsalab.config import NSAConfig
from fsalab.ops import decode as dec
from fsalab.ops.decode_cache import NSADecodeCache
from fsalab.ops._triton import cdiv, next_pow2

dev = torch.device("cuda")
SM = torch.cuda.get_device_properties(0).multi_processor_count
cfg = NSAConfig(block_size=64, topk=16)
H, D = 64, 128
out = []

def splits(f_c, f_s, h_kv, cap):
    rows = cap // cfg.kernel_stride
    _, bb = dec._score_tile(cfg)
    s_c = max(1, min(cdiv(f_c * SM, h_kv), cdiv(rows, 64), 256))
    s_s = max(1, min(cdiv(f_s * SM, h_kv), cdiv(cfg.num_blocks(cap), bb - 1), 256))
    return s_c, s_s, max(1, min(cdiv(min(cfg.window_size, cap), 64), 8))

def step_fn(q, cache, gates, s_c, s_s, s_w, warps_s):
    batch, h, d = q.shape
    h_kv = cache.num_kv_heads; g = h // h_kv
    t_pad, bb = dec._score_tile(cfg)
    f32 = torch.float32
    o_c = torch.empty((batch, h, s_c, d), dtype=f32, device=dev)
    lse_c = torch.empty((batch, h, s_c), dtype=f32, device=dev)
    keys = torch.empty((batch, h_kv, s_s, t_pad), dtype=torch.int32, device=dev)
    block_idx = torch.empty((batch, h_kv, cfg.topk), dtype=torch.int32, device=dev)
    n_sw = cfg.topk + s_w
    o_sw = torch.empty((batch, h, n_sw, d), dtype=f32, device=dev)
    lse_sw = torch.empty((batch, h, n_sw), dtype=f32, device=dev)
    outp = torch.empty((batch, h, d), dtype=q.dtype, device=dev)
    shape = {"G": g, "G_PAD": max(16, next_pow2(g)), "HEAD_DIM": d, "D_PAD": max(16, next_pow2(d)), "DOT_PREC": "tf32"}
    qk = 1 / math.sqrt(d) * 1.4426950408889634
    kc, vc, lens, logits = cache.k_cmp, cache.v_cmp, cache.lengths, cache.cmp_logits
    def run():
        dec._cmp_partial_kernel[(batch, h_kv, s_c)](
            q, kc, vc, lens, o_c, lse_c, logits, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
            logits.stride(0), logits.stride(1), h, s_c, qk, L=cfg.kernel_size, S=cfg.kernel_stride, BLOCK_N=64, **shape, num_warps=4)
        dec._score_kernel[(batch, h_kv, s_s)](
            logits, lens, lse_c, keys, logits.stride(0), logits.stride(1), h, h_kv, s_c, s_s, G=g, G_PAD=next_pow2(g),
            L=cfg.kernel_size, S=cfg.kernel_stride, BS=cfg.block_size, T_P=t_pad, BB=bb, SC_PAD=next_pow2(s_c),
            INIT=cfg.init_blocks, LOCAL=cfg.local_blocks, num_warps=warps_s)
        dec._topk_kernel[(batch * h_kv,)](keys, lens, block_idx, h_kv, s_s, BS=cfg.block_size, T_P=t_pad, TOPK=cfg.topk,
                                          NK=next_pow2(s_s) * t_pad)
        k, v = cache.k, cache.v
        dec._sw_partial_kernel[(batch, h_kv, n_sw)](
            q, k, v, lens, block_idx, o_sw, lse_sw, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            h, h_kv, s_w, qk, BS=cfg.block_size, TOPK=cfg.topk, WINDOW=cfg.window_size, BLOCK_N=64, **shape, num_warps=4)
        dec._combine_kernel[(batch * h,)](
            o_c, lse_c, o_sw, lse_sw, gates, outp, s_c, n_sw, HEAD_DIM=d, D_PAD=shape["D_PAD"], TOPK=cfg.topk,
            SC_PAD=next_pow2(s_c), T_PAD=next_pow2(cfg.topk), SW_PAD=next_pow2(n_sw))
        return outp, block_idx
    return run

def replay(fn, n=200):
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

def per_kernel(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10): fn()
        torch.cuda.synchronize()
    res = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", 0) / 10
        if us > 0 and "kernel" in ev.key: res[ev.key.strip("_").replace("_kernel", "")] = round(us, 2)
    return res

VARIANTS = [(fc, fs, w) for fc in (2, 4, 8) for fs in (2, 8, 32) for w in (1, 4)]
for g in (4, 1):
    h_kv = H // g
    for N in (32768, 65536, 131072, 262144):
        gen = torch.Generator(device=dev).manual_seed(N + g)
        cap = N + 64
        cache = NSADecodeCache.allocate(1, cap, h_kv, D, cfg, torch.bfloat16, dev, num_heads=H)
        for t in (cache.k, cache.v, cache.k_cmp, cache.v_cmp, cache.k_recent):
            t.normal_(generator=gen)
        cache.lengths.fill_(N); cache.filled = True
        q = torch.randn(1, H, D, device=dev, generator=gen).bfloat16()
        gates = torch.randn(1, H, 3, device=dev, generator=gen).bfloat16()
        base_o, base_idx = dec.nsa_decode(q, cache, gates)
        base_o, base_idx = base_o.clone(), base_idx.clone()
        row = {"g": g, "N": N, "current": dec.decode_splits(1, h_kv, cap, cfg, dev), "v": {}}
        for fc, fs, w in VARIANTS:
            sp = splits(fc, fs, h_kv, cap)
            fn = step_fn(q, cache, gates, *sp, w)
            o, idx = fn()
            err = (o.float() - base_o.float()).abs().max().item(); same = (idx == base_idx).float().mean().item()
            hot, cold = replay(fn)
            ker = per_kernel(fn)
            key = f"fc{fc}-fs{fs}-w{w}"
            row["v"][key] = {"splits": sp, "hot_us": hot * 1e3, "cold_us": cold * 1e3, "err": err, "idx_same": same, "kernels_us": ker}
            print(f"g{g} N{N} {key} {sp}: hot {hot*1e3:.1f} cold {cold*1e3:.1f} err {err:.1e} idx {same:.3f} {ker}", flush=True)
        out.append(row)
        json.dump(out, open(sys.argv[1], "w"), indent=1)
        del cache; torch.cuda.empty_cache()
print("\n== hot us: current (fc2-fs2-w4) vs best ==")
for r in out:
    cur = r["v"]["fc2-fs2-w4"]["hot_us"]
    best = sorted(r["v"].items(), key=lambda kv: kv[1]["hot_us"])[:3]
    print(r["g"], r["N"], r["current"], round(cur, 1), [(k, round(v["hot_us"], 1), round(v["cold_us"], 1)) for k, v in best])
print("\n== hot us of every variant over all points (sum) ==")
for key in r["v"]:
    print(key, " ".join(f"{rr['v'][key]['hot_us']:.1f}" for rr in out))
