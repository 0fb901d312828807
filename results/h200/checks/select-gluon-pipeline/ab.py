"""A/B of the Gluon selection kernel (ops/block_select_gluon.py) against its version at fa54b26
(select_gluon_fa54b26.py beside this script, the tree's kernel before the change): 64K tokens, one
sequence, 4 KV heads, d = 128, bf16, g = 1, 2, 4, 5, 8 at (64, 16) and g = 1, 4 at (128, 8).
Variants of the tree's kernel: PREFETCH (the next chunk's keys loaded during this chunk's work),
ASYNC (head h + 1's wgmma in flight during head h's exp2) and BLOCK_T (tokens a program: 128, a
row per thread, or 64, each row in two threads, half the shared memory, so 2 programs fit an SM
at g = 4 / 5). Each variant's selection is compared with the old kernel's (rows differing: near-ties
of the heads' fp32 sum only), then all are timed (do_bench medians of rounds in both orders).
Usage on the H200 (repo root): PYTHONPATH=src python results/h200/checks/select-gluon-pipeline/ab.py out.json"""
import importlib.util
import json
import pathlib
import sys

import torch
import triton

from fsalab.bench.inputs import compressed_branch, make_inputs
from fsalab.ops import block_select_gluon as new, compression
from fsalab.ops._triton import LOG2E, next_pow2, search_steps

spec = importlib.util.spec_from_file_location("old_select", pathlib.Path(__file__).with_name("select_gluon_fa54b26.py"))
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

dev = torch.device("cuda")
VARIANTS = [(1, 0, 128), (0, 0, 64), (1, 0, 64), (0, 1, 64), (1, 1, 64), (1, 1, 128)]


def launcher(q, k_cmp, lse, cu, cu_cmp, cfg, g, t_pad, bb, qk_scale, prefetch, async_, block_t):
    out = torch.empty((q.shape[0], k_cmp.shape[1], cfg.topk), dtype=torch.int32, device=q.device)
    batch = cu.numel() - 1

    def run():
        new.select_kernel[(batch + q.shape[0] // block_t, k_cmp.shape[1])](
            q, k_cmp, lse, cu, cu_cmp, out, batch, search_steps(batch), qk_scale,
            q.stride(0), q.stride(1), k_cmp.stride(0), k_cmp.stride(1), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            G=g, D=q.shape[2], L=cfg.kernel_size, S=cfg.kernel_stride, BS=cfg.block_size, TOPK=cfg.topk,
            T_P=t_pad, LOG=t_pad.bit_length() - 1, BB=bb, INIT=cfg.init_blocks, LOCAL=cfg.local_blocks,
            BLOCK_T=block_t, PREFETCH=bool(prefetch), ASYNC=bool(async_), num_warps=4)
        return out
    return run


rows = []
for g, B, T in ((1, 64, 16), (2, 64, 16), (4, 64, 16), (5, 64, 16), (8, 64, 16), (1, 128, 8), (4, 128, 8)):
    p = {"N": 65536, "g": g, "h_kv": 4, "d": 128, "batch": 1, "block_size": B, "topk": T, "dtype": "bfloat16",
         "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}
    x = make_inputs(p, dev, need_indices=False)
    cfg = x.cfg
    _, lse, k_cmp, _, cu_cmp = compressed_branch(compression, x.tensors, x.cu_seqlens, cfg)
    q = x.tensors["q"]
    t_pad = max(2, next_pow2(cfg.topk))
    bb = t_pad
    qk_scale = LOG2E / q.shape[2] ** 0.5
    ref_out = torch.empty((q.shape[0], 4, cfg.topk), dtype=torch.int32, device=dev)
    fns = {"fa54b26": lambda: old.launch(q, k_cmp, lse, x.cu_seqlens, cu_cmp, ref_out, cfg, g, t_pad, bb, qk_scale)}
    fit = new.tokens_per_program(g, q.shape[2], bb * B // 16)
    for pf, asy, bt in VARIANTS:
        if bt > fit:
            continue
        fns[f"P{pf}A{asy}T{bt}"] = launcher(q, k_cmp, lse, x.cu_seqlens, cu_cmp, cfg, g, t_pad, bb, qk_scale, pf, asy, bt)
    fns["fa54b26"]()
    ref = ref_out.clone()
    differ = {}
    for name, fn in fns.items():
        if name != "fa54b26":
            differ[name] = int((fn() != ref).any(-1).sum())
    samples = {}
    for order in (list(fns), list(fns)[::-1]):
        for name in order:
            samples.setdefault(name, []).extend(triton.testing.do_bench(fns[name], warmup=25, rep=100, return_mode="all"))
    ms = {n: sorted(s)[len(s) // 2] for n, s in samples.items()}
    rows.append({"g": g, "B": B, "T": T, "N": 65536, "rows": ref.shape[0] * ref.shape[1], "rows_differ": differ,
                 "ms": ms, "samples": samples})
    print(f"g={g} ({B},{T}): " + "  ".join(f"{n} {v:.3f} ({v / ms['fa54b26']:.3f}, differ {differ.get(n, 0)})"
                                            for n, v in ms.items()), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
