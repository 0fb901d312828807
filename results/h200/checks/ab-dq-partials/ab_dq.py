"""A/B of FSA's fused backward: dq partial dtype (fp32 vs q's) x dK/dV tile rows (32 vs 64).
Times backward_pass alone (do_bench median, L2 flushed), rounds A B C D D C B A; errors of each
variant against the fp32 backward on the same (upcast) inputs."""
import json, math, sys, time
import torch, triton
from fsalab.bench.inputs import make_inputs
from fsalab.ops.selection import fsa, fsa_plan as plan
from fsalab.ops.selection.index import build_selection_index

orig_tiles = plan.bwd_tiles
orig_dtype = fsa._fused_dq_dtype
VARIANTS = {"A_fp32_m32": (torch.float32, None), "B_qdt_m32": ("q", None),
            "C_fp32_m64": (torch.float32, 64), "D_qdt_m64": ("q", 64)}

def use(name):
    dt, bm = VARIANTS[name]
    fsa._fused_dq_dtype = orig_dtype if dt == "q" else (lambda pb: torch.float32)
    if bm is None:
        plan.bwd_tiles = orig_tiles
    else:
        def tiles(G, D, block_size, _bm=bm):
            t = orig_tiles(G, D, block_size)
            m = max(_bm, triton.next_power_of_2(G))
            return plan.Tiles(m, m // G, t.block_n, 0, t.num_warps, t.num_stages)
        plan.bwd_tiles = tiles

def point(N, g, B, T, dtype="bfloat16"):
    return {"N": N, "g": g, "h_kv": 4, "d": 128, "batch": 1, "block_size": B, "topk": T, "dtype": dtype,
            "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}

POINTS = [(65536, 4, 64, 16), (65536, 1, 64, 16), (65536, 8, 64, 16), (65536, 5, 64, 16), (65536, 4, 128, 8), (16384, 4, 64, 16)]
dev = torch.device("cuda")
out = []
for N, g, B, T in POINTS:
    p = point(N, g, B, T)
    x = make_inputs(p, dev)
    q, k, v = (x.tensors[n] for n in ("q", "k", "v"))
    cu, bi = x.cu_seqlens, x.block_idx
    scale = 1 / math.sqrt(q.shape[-1])
    index = build_selection_index(bi, cu, B)
    o, lse = fsa.forward_pass(q, k, v, bi, cu, B, scale, index)
    do = torch.randn_like(q)
    use("A_fp32_m32")
    truth = fsa.backward_pass(q.float(), k.float(), v.float(), o.float(), lse, do.float(), None, bi, cu, B, scale, index)
    row = {"N": N, "g": g, "B": B, "T": T, "err": {}, "ms": {}, "samples": {}}
    for name in VARIANTS:
        use(name)
        got = fsa.backward_pass(q, k, v, o, lse, do, None, bi, cu, B, scale, index)
        torch.cuda.synchronize()
        row["err"][name] = {n: ((a.float() - t).abs().max() / t.abs().max()).item() for n, a, t in zip(("dq", "dk", "dv"), got, truth)}
        row["nan"] = row.get("nan", 0) + sum(int(torch.isnan(a).sum()) for a in got)
    del truth
    order = list(VARIANTS) + list(VARIANTS)[::-1]
    for name in order:
        use(name)
        fn = lambda: fsa.backward_pass(q, k, v, o, lse, do, None, bi, cu, B, scale, index)
        ms = triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="all")
        row["samples"].setdefault(name, []).extend(ms)
    for name in VARIANTS:
        s = sorted(row["samples"][name]); row["ms"][name] = s[len(s) // 2]
    use("A_fp32_m32")
    out.append(row)
    a = row["ms"]["A_fp32_m32"]
    print(f"N{N} g{g} ({B},{T}): " + "  ".join(f"{n} {row['ms'][n]:.3f} ms ({row['ms'][n]/a:.3f}) dq_err {row['err'][n]['dq']:.2e} dk {row['err'][n]['dk']:.2e}" for n in VARIANTS) + f" nan {row['nan']}", flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
    del q, k, v, o, lse, do, x, index
    torch.cuda.empty_cache()
print("| point | " + " | ".join(VARIANTS) + " |")
for r in out:
    a = r["ms"]["A_fp32_m32"]
    print(f"| N{r['N']} g{r['g']} ({r['B']},{r['T']}) | " + " | ".join(f"{r['ms'][n]:.3f} ({r['ms'][n]/a:.2f}×)" for n in VARIANTS) + " |")
