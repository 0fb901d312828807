"""FSA's merge kernel (fsa_partials._merge_kernel) under other tiles: rows per program (BLOCK_R),
warps and pipeline stages, for the forward's LSE merge and the backward's dq SUM merge.

The merges move the selected branch's partials back (64K, g = 4, (64, 16): 1.33 ms forward for
≈ 4.4 GB read, 3.3 TB/s; 1.56 ms for the backward's two, perf-log "Versus, prefill and the GPU
suite at 570fc02"); the tree (87fa029, when this ran) launched BLOCK_R = max(next_pow2(G), 64) rows
on 4 warps. Here one chunk's partials are made by the tree's own launches (fsa._launch_partial / _launch_dkdv on the
benchmark's inputs and selection), then the merge of that chunk is timed alone under each
config (do_bench median, L2 flushed) and its output compared with the tree's config's (equal:
every row sums the same slots in the same order). Bytes: each program reads its rows' slots'
partials once (o in q's dtype, lse fp32) and writes o.
Usage on the H200 (repo root): [MERGE_G=1,4,5] PYTHONPATH=src python results/h200/checks/fsa-merge-tiles/merge_tiles.py out.json
"""
import json
import os
import sys

import torch
import triton

from fsalab.bench.inputs import make_inputs
from fsalab.ops._triton import cdiv, next_pow2
from fsalab.ops.selection import fsa, fsa_plan as plan
from fsalab.ops.selection.fsa_partials import FAST, LSE, SUM, _merge_kernel

dev = torch.device("cuda")
CONFIGS = [(64, 4, 1), (64, 4, 3), (64, 8, 3), (128, 4, 3), (128, 8, 3), (128, 8, 4), (256, 8, 3), (32, 4, 3)]


def merge(pb, c, mode, obuf, lbuf, out, lse_out, block_r, warps, stages):
    G = c.heads
    block_r = max(block_r, next_pow2(G))
    tok = block_r // G
    _merge_kernel[(cdiv(pb.total, tok), c.n_kv)](
        obuf, lbuf if lbuf is not None else pb.q, pb.index.slot_pos, pb.index.row_ptr, out,
        lse_out if lse_out is not None else pb.q,
        pb.total, pb.h_kv, pb.topk, c.hk0, c.hk0 * pb.cap, pb.g, c.j0, pb.d, pb.q.stride(0), pb.q.stride(1), pb.h,
        G=G, TOK=tok, BLOCK_R=block_r, TOPK_P=next_pow2(pb.topk), D=pb.D, MODE=mode, num_warps=warps,
        num_stages=stages,
    )


res = {}
for g in [int(x) for x in os.environ.get("MERGE_G", "1,4,5").split(",")]:
    p = {"N": 65536, "g": g, "h_kv": 4, "d": 128, "batch": 1, "block_size": 64, "topk": 16, "dtype": "bfloat16",
         "kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}
    x = make_inputs(p, dev, need_indices=True)
    t = x.tensors
    with torch.no_grad():
        pb = fsa._prepare(t["q"], t["k"], t["v"], x.block_idx.contiguous(), x.cu_seqlens, 64, None)
        # forward partials of the first chunk, as _forward_fast makes them
        chunks = plan.pow2_chunks(plan.head_chunks(pb.h_kv, pb.g, pb.total * pb.topk * (pb.d * pb.q.element_size() + 4)))
        c = chunks[0]
        obuf, lbuf = fsa._chunk_buffers(pb, chunks, pb.q.dtype, True)
        tiles = plan.fwd_tiles(c.heads, pb.D, pb.block_size, paper=False)
        fsa._launch_partial(pb, c, tiles, FAST, obuf, lbuf, work=fsa._work(pb, tiles, {}), v_bad_rows=fsa._nonfinite_blocks(pb))
        o = torch.empty_like(pb.q)
        lse = torch.empty(pb.total, pb.h, dtype=torch.float32, device=dev)
        nbytes = pb.entries(c.n_kv) * c.heads * (pb.d * 2 + 4) + pb.total * c.n_kv * c.heads * pb.d * 2
        ref = None
        for mode, name in ((LSE, "fwd-lse"),):
            rows = []
            for br, w, s in CONFIGS:
                fn = lambda: merge(pb, c, mode, obuf, lbuf, o, lse, br, w, s)
                fn()
                torch.cuda.synchronize()
                same = None
                if ref is None:
                    ref = o.clone()
                else:
                    same = bool(torch.equal(ref, o))
                ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
                rows.append({"block_r": br, "warps": w, "stages": s, "ms": ms, "tb_s": nbytes / ms / 1e9,
                             "same_as_first": same})
                print(f"g={g} {name} chunk heads={c.heads} n_kv={c.n_kv}: BLOCK_R={br} warps={w} stages={s}: {ms:.4f} ms "
                      f"{nbytes / ms / 1e9:.2f} TB/s same={same}", flush=True)
            res[f"g{g}-{name}"] = {"bytes": nbytes, "rows": rows}
        # dq SUM merge: the fused backward's partials of its first chunk
        do = torch.randn_like(pb.q)
        o_f, lse_f = fsa._forward_fast(pb)
        delta = fsa._delta(o_f, do, None)
        per_head = pb.total * pb.topk * pb.d * pb.q.dtype.itemsize
        bchunks = plan.head_chunks(pb.h_kv, pb.g, per_head, allow_partial_groups=False)
        dqbuf, _ = fsa._chunk_buffers(pb, bchunks, pb.q.dtype, False)
        btiles = plan.bwd_tiles(pb.g, pb.D, pb.block_size)
        split = fsa._split_work(pb, bchunks, btiles)
        dk, dv, dq = torch.empty_like(pb.k), torch.empty_like(pb.v), torch.empty_like(pb.q)
        bc = bchunks[0]
        fsa._launch_dkdv(pb, bc, btiles, do, lse_f, delta, dk, dv, *split, dqbuf=dqbuf)
        nbytes = pb.entries(bc.n_kv) * bc.heads * pb.d * 2 + pb.total * bc.n_kv * bc.heads * pb.d * 2
        ref, rows = None, []
        for br, w, s in CONFIGS:
            fn = lambda: merge(pb, bc, SUM, dqbuf, None, dq, None, br, w, s)
            fn()
            torch.cuda.synchronize()
            same = None if ref is None else bool(torch.equal(ref, dq))
            ref = dq.clone() if ref is None else ref
            ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
            rows.append({"block_r": br, "warps": w, "stages": s, "ms": ms, "tb_s": nbytes / ms / 1e9, "same_as_first": same})
            print(f"g={g} bwd-dq-sum chunk heads={bc.heads} n_kv={bc.n_kv}: BLOCK_R={br} warps={w} stages={s}: {ms:.4f} ms "
                  f"{nbytes / ms / 1e9:.2f} TB/s same={same}", flush=True)
        res[f"g{g}-bwd-dq-sum"] = {"bytes": nbytes, "rows": rows}
    del x, pb, obuf, lbuf, dqbuf
    torch.cuda.empty_cache()
json.dump(res, open(sys.argv[1], "w"), indent=1)
TREE = CONFIGS.index((64, 4, 3))  # _launch_merge at 87fa029: 64 rows at g <= 16, 4 warps, Triton's default 3 stages
print("\nbest per merge against the tree's config:")
for tag, r in res.items():
    best = min(r["rows"], key=lambda x: x["ms"])
    print(f"{tag:18s} tree {r['rows'][TREE]['ms']:.4f} ms, best BLOCK_R={best['block_r']} w={best['warps']} "
          f"s={best['stages']} {best['ms']:.4f} ms ({best['tb_s']:.2f} TB/s)")
