"""Prototype: NSA's forced blocks (the init blocks and the local blocks ending at the token's own
block) attended densely instead of through FSA's gathered partials, forward only.

Every token selects its INIT init blocks and its LOCAL local blocks (select_common.forced_score
ranks them +inf, so with topk >= INIT + LOCAL they are always among its T): INIT + LOCAL of the T
(token, block) pairs per token (3 of 16 at (64, 16), 3 of 8 at (128, 8)) whose keys are the same
for every token of a block. FSA gathers q for each pair, writes a bf16 partial and its lse, and
the merge reads it back (~13 GB at 64K, g = 4, (64, 16): perf-log "Versus and 64K prefill ...");
here those pairs leave the block list and one dense kernel attends each token to its forced keys
(contiguous q tiles, K/V tiles shared by a block's tokens), merged with FSA's result over the rest
by log-sum-exp:

  A: fsa forward (index + partials + merge) over block_idx, as `auto` runs it;
  B: block_idx with the forced pairs set to -1 (re-sorted), fsa forward over the rest, the dense
     kernel over the forced keys, a log-sum-exp merge of the two (torch ops here; an integrated
     version would fold the filter into the index build and the merge into FSA's merge kernel).

One sequence (cu_seqlens = [0, N]); block_idx from the tree's compression branch and selection
on the benchmark's inputs (bench.inputs.make_inputs, need_indices). Checks B's o and lse against
A's; times A, B and B's parts (do_bench medians, L2 flushed by do_bench's cache clear).
Usage on the H200 (repo root): PYTHONPATH=src python results/h200/checks/forced-dense/forced_dense.py out.json
On CPU (TRITON_INTERPRET=1) ``--check`` runs the dense kernel against the reference at tiny sizes.
"""
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl

from fsalab.ops import reference
from fsalab.ops.reference import forced_blocks, ranked_scores

INIT, LOCAL = 1, 2


@triton.jit
def _forced_dense_kernel(Q, K, V, O, LSE, n, stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
                         n_heads, group, scale_log2,
                         B: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows [m0, m0 + BLOCK_M) of one head (BLOCK_M divides B: all in block j) attend to keys
    [0, min(INIT, j + 1) * B) and [max(j - LOCAL + 1, INIT) * B, (j + 1) * B), causal."""
    m0 = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    kvh = head // group
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    dcol = tl.arange(0, D)
    q = tl.load(Q + rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh + dcol[None, :], mask=row_ok[:, None],
                other=0.0)
    j = m0 // B
    init_hi = tl.minimum(INIT, j + 1) * B
    local_lo = tl.maximum(j - LOCAL + 1, INIT) * B
    local_hi = tl.minimum((j + 1) * B, n)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    n_init = tl.cdiv(init_hi, BLOCK_N)
    n_local = tl.cdiv(tl.maximum(local_hi - local_lo, 0), BLOCK_N)
    for it in range(n_init + n_local):
        k0 = tl.where(it < n_init, it * BLOCK_N, local_lo + (it - n_init) * BLOCK_N)
        kpos = k0 + cols
        kmask = kpos < n
        kk = tl.load(K + kpos.to(tl.int64)[:, None] * stride_kt + kvh * stride_kh + dcol[None, :], mask=kmask[:, None],
                     other=0.0)
        s = tl.dot(q, tl.trans(kk)) * scale_log2
        s = tl.where((kpos[None, :] <= rows[:, None]) & kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vv = tl.load(V + kpos.to(tl.int64)[:, None] * stride_kt + kvh * stride_kh + dcol[None, :], mask=kmask[:, None],
                     other=0.0)
        acc = tl.dot(p.to(vv.dtype), vv, acc * alpha[:, None])
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(O + rows.to(tl.int64)[:, None] * stride_ot + head * stride_oh + dcol[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + rows.to(tl.int64) * n_heads + head, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)


def forced_dense(q, k, v, block_size, scale, block_m=64, block_n=64):
    """(o [n, h, d], lse [n, h] natural log) of each token over its forced keys; one sequence."""
    n, h, d = q.shape
    block_m, block_n = min(block_m, block_size), min(block_n, block_size)
    o = torch.empty_like(q)
    lse = torch.empty(n, h, dtype=torch.float32, device=q.device)
    _forced_dense_kernel[(triton.cdiv(n, block_m), h)](
        q, k, v, o, lse, n, q.stride(0), q.stride(1), k.stride(0), k.stride(1), o.stride(0), o.stride(1), h,
        h // k.shape[1], scale / math.log(2.0), B=block_size, INIT=INIT, LOCAL=LOCAL, D=d, BLOCK_M=block_m,
        BLOCK_N=block_n, num_warps=4, num_stages=2,
    )
    return o, lse


def _own_blocks(n, block_size, device):
    return (torch.arange(n, device=device) // block_size)[:, None, None]


def _ascending(blocks, keep):
    """Rows of ``blocks`` where ``keep``, ascending, -1 after (block_idx's layout)."""
    big = torch.iinfo(torch.int32).max
    key = torch.where(keep, blocks, big).sort(-1).values
    return torch.where(key == big, -1, key).to(torch.int32)


def without_forced(block_idx, block_size):
    """block_idx with each token's forced blocks set to -1, ascending again (-1 last)."""
    own = _own_blocks(block_idx.shape[0], block_size, block_idx.device)
    return _ascending(block_idx, (block_idx >= 0) & ~forced_blocks(block_idx, own, INIT, LOCAL))


def lse_merge(o_a, lse_a, o_b, lse_b):
    """Softmax-weighted merge of two partial attentions (lse_a may be -inf; lse_b is finite)."""
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    o = (o_a.float() * wa[..., None] + o_b.float() * wb[..., None]) / (wa + wb)[..., None]
    return o.to(o_a.dtype), m + torch.log(wa + wb)


def reference_forced(q, k, v, block_size, scale):
    """fp32 reference of forced_dense: the tree's selected-attention reference over each token's
    forced blocks."""
    n, h_kv = q.shape[0], k.shape[1]
    own = _own_blocks(n, block_size, q.device)
    blocks = torch.arange(n // block_size + 1)
    bi = _ascending(blocks.expand(n, h_kv, -1), forced_blocks(blocks, own, INIT, LOCAL))[..., :INIT + LOCAL]
    cu = torch.tensor([0, n], dtype=torch.int32)
    return reference.selected_attention(q.float(), k.float(), v.float(), bi.contiguous(), cu, block_size, scale)


def cpu_check():
    from fsalab.ops._triton import patch_interpreter
    patch_interpreter()  # the tests' interpreter fixes (numpy >= 2.4 loop bounds)
    torch.manual_seed(0)
    for n, g, bs in ((150, 2, 16), (40, 1, 16), (97, 3, 32)):
        h_kv, d = 2, 32
        q = torch.randn(n, h_kv * g, d)
        k, v = torch.randn(n, h_kv, d), torch.randn(n, h_kv, d)
        scale = d ** -0.5
        o, lse = forced_dense(q, k, v, bs, scale, block_m=16, block_n=16)
        o_r, lse_r = reference_forced(q, k, v, bs, scale)
        eo, el = (o - o_r).abs().max().item(), (lse - lse_r).abs().max().item()
        print(f"n={n} g={g} B={bs}: max |o - ref| {eo:.2e}, |lse - ref| {el:.2e}")
        assert eo < 5e-6 and el < 5e-6  # fp32: a few ulps of the O(1) outputs
    # B against A through the tree's FSA forward (fp32, interpreter): NSA's top-T of random
    # scores (the forced blocks and the best others), ascending, -1 last.
    from fsalab.ops.selection.dispatch import _run_forward
    n, h_kv, g, d, bs, topk = 160, 2, 2, 32, 16, 4
    q, k, v = torch.randn(n, h_kv * g, d), torch.randn(n, h_kv, d), torch.randn(n, h_kv, d)
    blocks = torch.arange(n // bs)
    ranked = ranked_scores(torch.rand(n, h_kv, n // bs), blocks, _own_blocks(n, bs, "cpu"), INIT, LOCAL)
    top = ranked.topk(topk, dim=-1)
    bi = _ascending(top.indices, top.values > float("-inf"))
    cu = torch.tensor([0, n], dtype=torch.int32)
    scale = d ** -0.5
    o_a, l_a = _run_forward("fsa", False, q, k, v, bi, cu, bs, scale)[:2]
    o_s, l_s = _run_forward("fsa", False, q, k, v, without_forced(bi, bs), cu, bs, scale)[:2]
    o_b, l_b = lse_merge(o_s, l_s, *forced_dense(q, k, v, bs, scale, block_m=16, block_n=16))
    eo, el = (o_a - o_b).abs().max().item(), (l_a - l_b).abs().max().item()
    print(f"B vs A (fsa, n={n}, T={topk}): max |o| {eo:.2e}, |lse| {el:.2e}")
    assert eo < 5e-6 and el < 5e-6  # fp32: a few ulps of the O(1) outputs


def gpu_ab(out_path):
    from fsalab.bench.inputs import make_inputs
    from fsalab.checks import value_checks_off
    from fsalab.ops.selection.dispatch import _run_forward

    dev = torch.device("cuda")
    res = {}
    for bs, topk in ((64, 16), (128, 8)):
        for g in (1, 4, 5):
            p = {"N": 65536, "g": g, "h_kv": 4, "d": 128, "batch": 1, "block_size": bs, "topk": topk,
                 "dtype": "bfloat16", "kernel_size": 32, "kernel_stride": 16, "init_blocks": INIT,
                 "local_blocks": LOCAL, "window_size": 512, "seed": 0}
            x = make_inputs(p, dev, need_indices=True)
            t, bi, cu = x.tensors, x.block_idx.contiguous(), x.cu_seqlens
            q, k, v = t["q"], t["k"], t["v"]
            scale = q.shape[2] ** -0.5
            with torch.no_grad(), value_checks_off():
                a = lambda: _run_forward("fsa", False, q, k, v, bi, cu, bs, scale)[:2]
                bi2 = without_forced(bi, bs)
                sparse = lambda: _run_forward("fsa", False, q, k, v, bi2, cu, bs, scale)[:2]
                dense = lambda: forced_dense(q, k, v, bs, scale)
                filt = lambda: without_forced(bi, bs)

                def b():
                    o_s, l_s = _run_forward("fsa", False, q, k, v, without_forced(bi, bs), cu, bs, scale)[:2]
                    o_d, l_d = forced_dense(q, k, v, bs, scale)
                    return lse_merge(o_s, l_s, o_d, l_d)

                o_a, l_a = a()
                o_b, l_b = b()
                err_o = (o_a.float() - o_b.float()).abs().max().item()
                err_l = (l_a - l_b).abs().max().item()
                o_s, l_s = sparse()
                o_d, l_d = dense()
                merge = lambda: lse_merge(o_s, l_s, o_d, l_d)
                ms = {name: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                      for name, fn in (("A", a), ("B", b), ("sparse", sparse), ("dense", dense), ("filter", filt),
                                       ("merge", merge), ("A2", a))}
            tag = f"B{bs}-T{topk}-g{g}"
            res[tag] = {"max_abs_o": err_o, "max_abs_lse": err_l, **{f"{k_}_ms": v_ for k_, v_ in ms.items()}}
            print(tag, json.dumps({k_: round(v_, 4) for k_, v_ in res[tag].items()}), flush=True)
            del x
            torch.cuda.empty_cache()
    json.dump(res, open(out_path, "w"), indent=1)
    print("\npoint         A ms   B ms  B/A | sparse dense (sparse+dense)/A | |o_A-o_B|")
    for tag, r in res.items():
        a_ms = (r["A_ms"] + r["A2_ms"]) / 2
        print(f"{tag:12s} {a_ms:6.3f} {r['B_ms']:6.3f} {r['B_ms'] / a_ms:.3f} | {r['sparse_ms']:6.3f} {r['dense_ms']:6.3f} "
              f"{(r['sparse_ms'] + r['dense_ms']) / a_ms:.3f} | {r['max_abs_o']:.2e}")


if __name__ == "__main__":
    if "--check" in sys.argv:
        cpu_check()
    else:
        gpu_ab(sys.argv[1])
