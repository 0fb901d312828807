"""Tile sweep of FSA's forward partial kernel (fwd_tiles, FAST mode) and fused backward (bwd_tiles)
at 64K: variants by monkeypatching fsa_plan.fwd_tiles / bwd_tiles; forward_pass / backward_pass
timed alone (do_bench medians, L2 flushed), rounds forward then reversed; outputs compared with
the default tiles. Usage on the H200: PYTHONPATH=src python ab_tiles.py out.json [SWEEP]
SWEEP "first" (default; ab-tiles-14ba4c0.*, code with 64-row tiles): 64K g = 4, 1, 8 (64, 16) and
g = 4 (128, 8); "second" (code with 128-row backward tiles and 128-row forward tiles where the key
sub-tile is <= 64 wide): g = 2 and 5, d = 64, 16K, and wider backward tiles."""
import json, math, sys
import torch, triton
from fsalab.bench.inputs import make_inputs
from fsalab.ops.selection import fsa, fsa_plan as plan
from fsalab.ops.selection.index import build_selection_index

orig_fwd, orig_bwd = plan.fwd_tiles, plan.bwd_tiles
SWEEPS = {
    "first": ({"f64w4s2 (default)": None, "f128w8s2": (128, 8, 2), "f64w8s2": (64, 8, 2), "f64w4s3": (64, 4, 3),
               "f128w4s2": (128, 4, 2)},
              {"b64w8s2 (default)": None, "b128w8s2": (128, 8, 2), "b64w4s2": (64, 4, 2), "b64w8s3": (64, 8, 3),
               "b32w8s2": (32, 8, 2)},
              [(65536, 4, 64, 16, 128), (65536, 1, 64, 16, 128), (65536, 8, 64, 16, 128), (65536, 4, 128, 8, 128)]),
    "second": ({"default": None, "f64w4s2": (64, 4, 2), "f128w4s3": (128, 4, 3)},
               {"default": None, "b64w8s2": (64, 8, 2), "b256w8s2": (256, 8, 2), "b128w8s3": (128, 8, 3),
                "b128w4s2": (128, 4, 2)},
               [(65536, 2, 64, 16, 128), (65536, 5, 64, 16, 128), (65536, 4, 64, 16, 64), (16384, 4, 64, 16, 128),
                (65536, 4, 64, 16, 128)]),
}
FWD, BWD, POINTS = SWEEPS[sys.argv[2] if len(sys.argv) > 2 else "first"]


def use_fwd(v):
    if v is None:
        plan.fwd_tiles = orig_fwd
        return
    def tiles(G, D, block_size, paper, dq=False, inner_loop=True):
        t = orig_fwd(G, D, block_size, paper, dq, inner_loop)
        if paper or dq:
            return t
        m = max(v[0], triton.next_power_of_2(G))
        return plan.Tiles(m, m // G, t.block_n, t.num_mt, v[1], v[2])
    plan.fwd_tiles = tiles


def use_bwd(v):
    if v is None:
        plan.bwd_tiles = orig_bwd
        return
    def tiles(G, D, block_size):
        t = orig_bwd(G, D, block_size)
        m = max(v[0], triton.next_power_of_2(G))
        return plan.Tiles(m, m // G, t.block_n, 0, v[1], v[2])
    plan.bwd_tiles = tiles


def point(N, g, B, T, d):
    return {"N": N, "g": g, "h_kv": 4, "d": d, "batch": 1, "block_size": B, "topk": T, "dtype": "bfloat16",
            "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=100, rep=400, return_mode="all")


out = []
dev = torch.device("cuda")
for N, g, B, T, d in POINTS:
    x = make_inputs(point(N, g, B, T, d), dev)
    q, k, v = (x.tensors[n] for n in ("q", "k", "v"))
    cu, bi, scale = x.cu_seqlens, x.block_idx, 1 / math.sqrt(q.shape[-1])
    index = build_selection_index(bi, cu, B)
    o, lse = fsa.forward_pass(q, k, v, bi, cu, B, scale, index)
    do = torch.randn_like(q)
    base_bwd = fsa.backward_pass(q, k, v, o, lse, do, None, bi, cu, B, scale, index)
    row = {"N": N, "g": g, "B": B, "T": T, "d": d, "fwd": {}, "bwd": {}, "fwd_samples": {}, "bwd_samples": {}, "diff": {}}
    for name, var in FWD.items():
        use_fwd(var)
        try:
            o2, lse2 = fsa.forward_pass(q, k, v, bi, cu, B, scale, index)
            row["diff"][name] = max((o2.float() - o.float()).abs().max().item(), (lse2 - lse).abs().max().item())
        except Exception as e:  # a config that does not compile or fit
            row["diff"][name] = f"error: {type(e).__name__}: {e}"[:300]
    for name, var in BWD.items():
        use_bwd(var)
        try:
            got = fsa.backward_pass(q, k, v, o, lse, do, None, bi, cu, B, scale, index)
            row["diff"][name] = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, base_bwd))
        except Exception as e:
            row["diff"][name] = f"error: {type(e).__name__}: {e}"[:300]
    for order in (list(FWD), list(FWD)[::-1]):
        for name in order:
            if isinstance(row["diff"][name], str):
                continue
            use_fwd(FWD[name])
            row["fwd_samples"].setdefault(name, []).extend(bench(lambda: fsa.forward_pass(q, k, v, bi, cu, B, scale, index)))
    use_fwd(None)
    for order in (list(BWD), list(BWD)[::-1]):
        for name in order:
            if isinstance(row["diff"][name], str):
                continue
            use_bwd(BWD[name])
            row["bwd_samples"].setdefault(name, []).extend(bench(lambda: fsa.backward_pass(q, k, v, o, lse, do, None, bi, cu, B, scale, index)))
    use_bwd(None)
    for kind in ("fwd", "bwd"):
        for name, s in row[f"{kind}_samples"].items():
            s = sorted(s)
            row[kind][name] = s[len(s) // 2]
    out.append(row)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
    for kind, table in (("fwd", FWD), ("bwd", BWD)):
        base = row[kind][next(iter(table))]
        print(f"N{N} g{g} d{d} ({B},{T}) {kind}: " + "  ".join(
            f"{n} {row[kind][n]:.3f} ({row[kind][n] / base:.2f}) d={row['diff'][n]:.1e}" if n in row[kind] else f"{n} {row['diff'][n]}"
            for n in table), flush=True)
