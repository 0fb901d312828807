"""A/B of the block-selection kernel: head groups of non-power-of-two size without padding.

B (``fsalab.ops.compression``, this commit): the g heads of a group go through the QK product as
a power-of-two part and, for g = 3, 5, 6, 9, ..., a second product for the remaining heads
(g = 5 -> 4 + 1 rows per token instead of 8). A (the parent commit's kernel, a snapshot file given
by --old): g padded to the next power of two.

1. Correctness (bf16, fp16): B's selection is a valid top-T under the fp32 reference scores and
   equal to reference.select_blocks on every row without a near-tie (packed batches at 8K, one
   64K sequence at g = 5 and 6), and identical to A's.
2. Timing, select_blocks alone at 16K/64K, g in {3, 4, 5, 6, 8}, (64,16) and (128,8): A and B
   alternately (A B B A), do_bench medians.

    python scripts/gpu/ab_select_split.py --old .ab/compression_v0.py --json $OUT/ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

from fsalab.config import NSAConfig
from fsalab.ops import compression as new_mod
from fsalab.ops import reference
from fsalab.testing import check_selection, cu_seqlens_of
from fsalab.varlen import compressed_cu_seqlens

DEV = torch.device("cuda")
H_KV, D = 4, 128
PAIRS = [(64, 16), (128, 8)]


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("fsalab.ops._compression_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def select_inputs(lengths, g, cfg, dtype, gen):
    cu = cu_seqlens_of(lengths, DEV)
    total = sum(lengths)
    q = torch.randn(total, H_KV * g, D, generator=gen, device=DEV).to(dtype)
    k_cmp = torch.randn(total // cfg.kernel_stride, H_KV, D, generator=gen, device=DEV).to(dtype)
    cu_cmp = compressed_cu_seqlens(cu, cfg.kernel_size, cfg.kernel_stride)
    _, lse = new_mod.compressed_attention(q, k_cmp, k_cmp, cu, cu_cmp, cfg)
    return q, k_cmp, lse.float(), cu, cu_cmp


def check(lengths, g, cfg, dtype, gen, old) -> dict:
    q, k_cmp, lse, cu, cu_cmp = select_inputs(lengths, g, cfg, dtype, gen)
    got = torch.full((q.shape[0], H_KV, cfg.topk), -7, dtype=torch.int32, device=DEV)
    got.copy_(new_mod.select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg))
    expected = reference.select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)
    scores = reference.block_scores(q, k_cmp, lse, cu, cu_cmp, cfg)
    near, rows = 0, 8192
    n = q.shape[0]
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        if len(lengths) == 1:
            near += check_selection(got[lo:hi], expected[lo:hi], scores[lo:hi], cu, cfg,
                                    positions=torch.arange(lo, hi, device=DEV))
    if len(lengths) > 1:
        near = check_selection(got, expected, scores, cu, cfg)
    same_old = int((got == old.select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)).all(-1).sum())
    return {"rows": n * H_KV, "identical_to_reference": int((got == expected).all(-1).sum()),
            "near_tie_rows": near, "identical_to_old": same_old}


def bench_select(n, g, cfg, gen, old, reps=2) -> dict:
    q, k_cmp, lse, cu, cu_cmp = select_inputs([n], g, cfg, torch.bfloat16, gen)
    fa = lambda: old.select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)
    fb = lambda: new_mod.select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)
    fa(), fb()
    a, b = [], []
    for _ in range(reps):  # A B B A
        a.append(do_bench(fa, warmup=25, rep=200, return_mode="median"))
        b.append(do_bench(fb, warmup=25, rep=200, return_mode="median"))
        b.append(do_bench(fb, warmup=25, rep=200, return_mode="median"))
        a.append(do_bench(fa, warmup=25, rep=200, return_mode="median"))
    return {"old_ms": a, "new_ms": b, "old_median": sorted(a)[len(a) // 2], "new_median": sorted(b)[len(b) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    old = load_old(args.old)
    gen = torch.Generator(device=DEV).manual_seed(1234)
    res = {"checks": {}, "select": {}}
    t0 = time.time()
    for g in (3, 5, 6, 7, 9, 12):
        for bs, topk in PAIRS:
            cfg = NSAConfig(block_size=bs, topk=topk)
            for dtype in (torch.bfloat16, torch.float16) if g == 5 else (torch.bfloat16,):
                key = f"packed g{g} ({bs},{topk}) {str(dtype)[6:]}"
                res["checks"][key] = check([8192, 3000, 17, 31, 500, 1], g, cfg, dtype, gen, old)
                print(key, res["checks"][key], flush=True)
    for g in (5, 6):
        key = f"64K g{g} (64,16) bf16"
        res["checks"][key] = check([65536], g, NSAConfig(), torch.bfloat16, gen, old)
        print(key, res["checks"][key], flush=True)
    print(f"checks done in {time.time() - t0:.0f} s", flush=True)
    for n in (65536, 16384):
        for g in (3, 4, 5, 6, 8):
            for bs, topk in PAIRS:
                if n == 16384 and (g != 5 or bs == 128):
                    continue
                key = f"N{n} g{g} ({bs},{topk})"
                res["select"][key] = bench_select(n, g, NSAConfig(block_size=bs, topk=topk), gen, old)
                r = res["select"][key]
                print(key, f"old {r['old_median']:.3f} new {r['new_median']:.3f} ms", flush=True)
    Path(args.json).write_text(json.dumps(res, indent=1))
    print("\nselect_blocks alone (ms, do_bench medians, A B B A):")
    print("| point | old | new | old/new |\n|---|---|---|---|")
    for key, r in res["select"].items():
        print(f"| {key} | {r['old_median']:.3f} | {r['new_median']:.3f} | {r['old_median'] / r['new_median']:.2f} |")


if __name__ == "__main__":
    main()
