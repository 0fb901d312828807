"""A/B of FSA at a non-power-of-two group g, forward and backward, tree against power-of-two
head parts (5 = 4 + 1, 6 = 4 + 2, 3 = 2 + 1, 7 = 4 + 2 + 1):
- forward (FAST): the tree's one launch over all g heads (64-row tiles of 64 // g tokens x g
  heads) against each part as a head chunk of every KV head with the 128-row tile its
  power-of-two group gets (``forward_split``);
- backward (fused dK/dV + dq partials): the tree's 128-row tiles of 128 // g tokens x g heads
  against one program walking its token range twice, power-of-two part then the rest
  (``fsa_bwd_pow2.backward_split``; dK/dV still summed over the whole group in registers).
Both on the same inputs (block indices from the compression path) in one process, timed side by
side by ``fsalab.bench.timing.interleaved`` (round-robin, synced, L2 flushed, medians); outputs
compared with the tree's and, forward, with the fp32 reference on a prefix.

Prediction (scripts/sass_loop_count.py, instructions of one tile's loop per (token, head) row,
64K, d = 128, (64, 16)). Forward partial (`--kernel fsa_partial`): g = 4's 128-row tile 1905,
g = 1's 1818, g = 5's 64-row tile 2340, so the split's partials cost (4 x 1905 + 1818) / 5 / 2340 = 0.81x of g = 5's;
with the merges unchanged in bytes, the g = 5 forward at 64K about 0.87x (5.5 + 1.7 ms ->
4.5 + 1.8), at the price of 5 more launches. dK/dV (`--kernel fsa_dkdv --config 5,128,8`): the
tree's g = 5 tile 2514 per row with 152 B of spills and 27 local reloads per tile; the variant
(`--kernel fsa_dkdv --source results/h200/checks/ab-fsa-pow2-heads/fsa_bwd_pow2.py --function
_dkdv_pow2_kernel --const G_HI=4 --const G_LO=1 --const G_LO_P=1 --const PER_ITEM=2048 --rows 128
--loops 2 --config 5,128,8`) 2322 and 2316 per row in its two loops, 48 B spilled, 1 reload per
loop: 0.92x from the count, more if the
reloads cost what they did in the forward's 125-row tile; g = 5 fwd+bwd over g = 4 at 64K 1.36x
-> about 1.28x. Under the interpreter both split paths match the tree (forward bit-identical,
dq bit-identical, dK/dV within 2e-5 relative in fp16, split rows included).

Ran at 3e5a55c (pow2.log, pow2.json; 64K, (64, 16) unless stated), split / tree: forward g = 5
0.85x, g = 3 0.86x, g = 6 0.87x, g = 7 0.88x, g = 5 (128, 8) 0.98x, 16K 0.87x, 128K 0.89x;
backward 0.80x, 0.87x, 0.87x, 0.91x, 0.81x, 0.85x, 0.79x; forward outputs within one bf16 ulp of
the tree's (same error against the fp32 reference), dq bit-identical, dK/dV within 2e-4
relative. The forward's partials came as predicted (0.81x of 5.5 ms is 4.5; the whole forward
0.85x), the backward beat its >= 0.92x bound. Landed in 188fb1d (fsa_plan.pow2_chunks,
fsa_bwd._dkdv_kernel with head parts); that change's own A/B is ../ab-fsa-pow2-landed/. Since
then the tree's forward is the split itself: run this at 3e5a55c.

Usage on the H200 (repo root):
  PYTHONPATH=src:results/h200/checks/ab-fsa-pow2-heads python results/h200/checks/ab-fsa-pow2-heads/ab_fsa_pow2_heads.py out.json
On CPU (interpreter; correctness of both split paths, tiny shapes):
  TRITON_INTERPRET=1 PYTHONPATH=src:results/h200/checks/ab-fsa-pow2-heads python results/h200/checks/ab-fsa-pow2-heads/ab_fsa_pow2_heads.py --cpu
"""
import json
import sys

import torch

from fsalab.bench.timing import Rounds, interleaved
from fsalab.ops import reference
from fsalab.ops.selection import fsa
from fsalab.ops.selection import fsa_plan as plan
from fsalab.ops.selection.fsa_partials import FAST, LSE
from fsa_bwd_pow2 import backward_split


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


def compare(pb, x, do, rows=None):
    """Tree vs split outputs and gradients; the forward also against the fp32 reference on all
    rows (rows=None) or on the first ``rows`` tokens of a one-sequence batch (a causal prefix is
    a sequence of its own)."""
    a, b = fsa._forward_fast(pb), forward_split(pb)
    t, idx, cu = x.tensors, x.block_idx, x.cu_seqlens
    if rows is not None:
        t = {n: t[n][:rows] for n in ("q", "k", "v")}
        idx, cu = idx[:rows], torch.tensor([0, rows], dtype=torch.int32, device=cu.device)
    ref_o, _ = reference.selected_attention(t["q"].float(), t["k"].float(), t["v"].float(), idx, cu, pb.block_size)
    n = ref_o.shape[0]
    out = {"equal_o": bool(torch.equal(a[0], b[0])), "equal_lse": bool(torch.equal(a[1], b[1])),
           "max_diff_o": float((a[0].float() - b[0].float()).abs().max()),
           "max_err_split_vs_ref": float((b[0][:n].float() - ref_o).abs().max()),
           "max_err_tree_vs_ref": float((a[0][:n].float() - ref_o).abs().max())}
    ga, gb = fsa._backward_fast(pb, a[0], a[1], do, None), backward_split(pb, a[0], a[1], do)
    for name, u, w in zip(("dq", "dk", "dv"), ga, gb):
        out[f"rel_diff_{name}"] = float((u.float() - w.float()).norm() / u.float().norm().clamp(min=1e-30))
        out[f"nan_{name}"] = bool(w.isnan().any())
    return out


def main():
    if sys.argv[1:] == ["--cpu"]:
        dev = torch.device("cpu")
        for g in (3, 5, 6, 7):
            pb, x = problem(512, g, 64, 4, "float16", dev, batch=2)
            do = torch.randn(pb.q.shape, generator=torch.Generator().manual_seed(1)).to(pb.q.dtype)
            print(f"CPU g={g}:", compare(pb, x, do), flush=True)
        return
    dev = torch.device("cuda")
    out = []
    rounds = Rounds(rounds=30, rep_ms=300.0)
    for N, g, B, T in [(65536, 5, 64, 16), (65536, 3, 64, 16), (65536, 6, 64, 16), (65536, 7, 64, 16),
                       (65536, 5, 128, 8), (16384, 5, 64, 16), (131072, 5, 64, 16), (65536, 4, 64, 16)]:
        pb, x = problem(N, g, B, T, "bfloat16", dev)
        do = torch.randn(pb.q.shape, device=dev, generator=torch.Generator(dev).manual_seed(1)).to(pb.q.dtype)
        o, lse = fsa._forward_fast(pb)
        fns = {"fwd tree": lambda: fsa._forward_fast(pb), "bwd tree": lambda: fsa._backward_fast(pb, o, lse, do, None)}
        check = None
        if g & (g - 1):  # the split too; g = 4 runs the tree alone (the g = 5 / g = 4 target's reference)
            check = compare(pb, x, do, 4096)
            fns.update({"fwd split": lambda: forward_split(pb), "bwd split": lambda: backward_split(pb, o, lse, do)})
        timed = interleaved(fns, dev, rounds=rounds, warmup=3)
        ms = {n: t.summary()["median_ms"] for n, t in timed.items()}
        out.append({"N": N, "g": g, "B": B, "T": T, "ms": ms, "check": check,
                    "samples": {n: t.samples_ms for n, t in timed.items()}})
        line = f"N{N} g{g} ({B},{T}): fwd tree {ms['fwd tree']:.3f} ms, bwd tree {ms['bwd tree']:.3f} ms"
        if check is not None:
            line += (f"; fwd split {ms['fwd split']:.3f} ({ms['fwd split'] / ms['fwd tree']:.2f}), bwd split "
                     f"{ms['bwd split']:.3f} ({ms['bwd split'] / ms['bwd tree']:.2f}); {check}")
        print(line, flush=True)
        json.dump(out, open(sys.argv[1], "w"), indent=1)

if __name__ == "__main__":
    main()
