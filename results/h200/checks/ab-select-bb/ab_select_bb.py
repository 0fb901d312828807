"""A/B of select_blocks' chunk width BB (blocks per score-loop iteration): default (max(T_P, 16/r))
vs 2x and 4x, by monkeypatching block_select._chunk_blocks. select_blocks alone at 64K, do_bench
medians, rounds forward then reversed; selections compared with the default's.
Usage on the H200: PYTHONPATH=src python ab_select_bb.py out.json"""
import json, sys
import torch, triton
from fsalab.bench.inputs import make_inputs
from fsalab.ops import block_select, compression
from fsalab.config import NSAConfig

default = block_select._chunk_blocks
VARIANTS = {"BBx1": 1, "BBx2": 2, "BBx4": 4}
out = []
dev = torch.device("cuda")
for N, g, B, T in [(65536, 1, 64, 16), (65536, 4, 64, 16), (65536, 8, 64, 16), (65536, 5, 64, 16), (65536, 4, 128, 8), (131072, 4, 64, 16)]:
    p = {"N": N, "g": g, "h_kv": 4, "d": 128, "batch": 1, "block_size": B, "topk": T, "dtype": "bfloat16",
         "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}
    x = make_inputs(p, dev, need_indices=False)
    t = x.tensors
    cfg = x.cfg
    k_cmp, v_cmp, cu_cmp = compression.compress_kv(t["k"], t["v"], t["w_k"], t["w_v"], t["pe"], x.cu_seqlens, cfg)
    _, lse = compression.compressed_attention(t["q"], k_cmp, v_cmp, x.cu_seqlens, cu_cmp, cfg)
    args = (t["q"], k_cmp, lse, x.cu_seqlens, cu_cmp, cfg)
    row = {"N": N, "g": g, "B": B, "T": T, "ms": {}, "samples": {}, "same_as_default": {}}
    base = None
    for name, m in VARIANTS.items():
        block_select._chunk_blocks = lambda t_pad, r, m=m: m * default(t_pad, r)
        try:
            got = block_select.select_blocks(*args)
            base = got if base is None else base
            row["same_as_default"][name] = (got == base).float().mean().item()
        except Exception as e:
            row["same_as_default"][name] = f"error: {type(e).__name__}: {e}"[:300]
    for order in (list(VARIANTS), list(VARIANTS)[::-1]):
        for name in order:
            if isinstance(row["same_as_default"][name], str):
                continue
            block_select._chunk_blocks = lambda t_pad, r, m=VARIANTS[name]: m * default(t_pad, r)
            row["samples"].setdefault(name, []).extend(
                triton.testing.do_bench(lambda: block_select.select_blocks(*args), warmup=100, rep=400, return_mode="all"))
    block_select._chunk_blocks = default
    for name, s in row["samples"].items():
        s = sorted(s)
        row["ms"][name] = s[len(s) // 2]
    out.append(row)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
    b = row["ms"].get("BBx1")
    print(f"N{N} g{g} ({B},{T}): " + "  ".join(
        f"{n} {row['ms'][n]:.3f} ms ({row['ms'][n] / b:.2f}) same {row['same_as_default'][n]:.5f}" if n in row["ms"] else f"{n} {row['same_as_default'][n]}"
        for n in VARIANTS), flush=True)
