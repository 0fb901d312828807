"""A/B of FSA's forward (FAST) at a non-power-of-two group g: the tree's one launch over all g
heads (64-row tiles of 64 // g tokens x g heads at g = 3, 5, 6, 7) against the heads split into
power-of-two parts (5 = 4 + 1, 6 = 4 + 2, 3 = 2 + 1, 7 = 4 + 2 + 1), each part a head chunk of
every KV head with the 128-row tiles power-of-two groups get. Both on the same inputs (block
indices from the compression path) in one process; do_bench medians, rounds forward then
reversed; outputs compared (torch.equal and the largest difference), and each against the
fp32 reference on the first rows.

Prediction (scripts/sass_loop_count.py --kernel fsa_partial, instructions per (token, head) row
of one tile's loop, 64K, d = 128, (64, 16)): g = 4's 128-row tile 1905, g = 1's 1818, g = 5's
64-row tile 2340, so the split's partial kernels cost (4 x 1905 + 1818) / 5 / 2340 = 0.81x of
g = 5's; with the merges unchanged in bytes, the FSA forward at 64K g = 5 5.5 + 1.7 ms ->
about 4.5 + 1.8 ms (0.87x), at the price of 3 + 2 more launches (a second partial, its
containment pass and merge; a second work list). Prepared, not yet run.

Usage on the H200 (repo root):
  PYTHONPATH=src python results/h200/checks/ab-fsa-pow2-heads/ab_fsa_pow2_heads.py out.json
On CPU (interpreter; correctness of the split path only, tiny shapes):
  TRITON_INTERPRET=1 PYTHONPATH=src python results/h200/checks/ab-fsa-pow2-heads/ab_fsa_pow2_heads.py --cpu
"""
import json
import sys

import torch

from fsalab.ops import reference
from fsalab.ops.selection import fsa
from fsalab.ops.selection import fsa_plan as plan
from fsalab.ops.selection.fsa_partials import FAST, LSE


def pow2_parts(chunks):
    """Each chunk's heads as power-of-two parts, largest first, over the same KV heads."""
    out = []
    for c in chunks:
        j0, left = c.j0, c.heads
        while left:
            part = 1 << (left.bit_length() - 1)
            out.append(plan.Chunk(c.hk0, c.n_kv, j0, part))
            j0, left = j0 + part, left - part
    return out


def forward_split(pb):
    """fsa._forward_fast with the chunks split into power-of-two head parts."""
    o = torch.empty_like(pb.q)
    lse = torch.empty(pb.total, pb.h, dtype=torch.float32, device=pb.q.device)
    chunks = pow2_parts(plan.head_chunks(pb.h_kv, pb.g, pb.total * pb.topk * (pb.d * pb.q.element_size() + 4)))
    obuf, lbuf = fsa._chunk_buffers(pb, chunks, pb.q.dtype, True)
    works: dict = {}
    v_bad_rows = fsa._nonfinite_blocks(pb)
    for c in chunks:
        tiles = plan.fwd_tiles(c.heads, pb.D, pb.block_size, paper=False)
        fsa._launch_partial(pb, c, tiles, FAST, obuf, lbuf, work=fsa._work(pb, tiles, works), v_bad_rows=v_bad_rows)
        fsa._launch_merge(pb, c, LSE, obuf, lbuf, o, lse)
    return o, lse


def problem(N, g, B, T, dtype, device, batch=1):
    from fsalab.bench.inputs import make_inputs
    p = {"N": N, "g": g, "h_kv": 4 if device.type == "cuda" else 2, "d": 128 if device.type == "cuda" else 32,
         "batch": batch, "block_size": B, "topk": T, "dtype": dtype, "kernel_size": 32, "kernel_stride": 16,
         "init_blocks": 1, "local_blocks": 2, "window_size": 512, "seed": 0}
    x = make_inputs(p, device)
    t = x.tensors
    return fsa._prepare(t["q"], t["k"], t["v"], x.block_idx, x.cu_seqlens, B, None), x


def compare(pb, x, rows=None):
    """Tree vs split outputs; each against the fp32 reference on all rows (rows=None) or on the
    first ``rows`` tokens of a one-sequence batch (a causal prefix is a sequence of its own)."""
    a, b = fsa._forward_fast(pb), forward_split(pb)
    t, idx, cu = x.tensors, x.block_idx, x.cu_seqlens
    if rows is not None:
        t = {n: t[n][:rows] for n in ("q", "k", "v")}
        idx, cu = idx[:rows], torch.tensor([0, rows], dtype=torch.int32, device=cu.device)
    ref_o, _ = reference.selected_attention(t["q"].float(), t["k"].float(), t["v"].float(), idx, cu, pb.block_size)
    n = ref_o.shape[0]
    return {"equal_o": bool(torch.equal(a[0], b[0])), "equal_lse": bool(torch.equal(a[1], b[1])),
            "max_diff_o": float((a[0].float() - b[0].float()).abs().max()),
            "max_err_split_vs_ref": float((b[0][:n].float() - ref_o).abs().max()),
            "max_err_tree_vs_ref": float((a[0][:n].float() - ref_o).abs().max())}


def main():
    if sys.argv[1:] == ["--cpu"]:
        dev = torch.device("cpu")
        for g in (3, 5, 6, 7):
            pb, x = problem(512, g, 64, 4, "float16", dev, batch=2)
            print(f"CPU g={g}:", compare(pb, x), flush=True)
        return
    import triton
    dev = torch.device("cuda")
    out = []
    for N, g, B, T in [(65536, 5, 64, 16), (65536, 3, 64, 16), (65536, 6, 64, 16), (65536, 7, 64, 16),
                       (65536, 5, 128, 8), (16384, 5, 64, 16), (131072, 5, 64, 16), (65536, 4, 64, 16)]:
        pb, x = problem(N, g, B, T, "bfloat16", dev)
        check = compare(pb, x, 4096)
        fns = {"tree": lambda: fsa._forward_fast(pb), "pow2 split": lambda: forward_split(pb)}
        samples = {}
        for order in (list(fns), list(fns)[::-1]):
            for name in order:
                samples.setdefault(name, []).extend(triton.testing.do_bench(fns[name], warmup=50, rep=300,
                                                                            return_mode="all"))
        ms = {n: sorted(s)[len(s) // 2] for n, s in samples.items()}
        out.append({"N": N, "g": g, "B": B, "T": T, "ms": ms, "check": check, "samples": samples})
        print(f"N{N} g{g} ({B},{T}): tree {ms['tree']:.3f} ms, split {ms['pow2 split']:.3f} ms "
              f"({ms['pow2 split'] / ms['tree']:.2f}); {check}", flush=True)
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
