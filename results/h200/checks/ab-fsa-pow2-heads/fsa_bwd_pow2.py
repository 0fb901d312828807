"""Variant of FSA's fused backward (dK/dV + dq partials, ``selection.fsa_bwd._dkdv_kernel``) for a
non-power-of-two group g: one program still owns a (KV block, token range) item and accumulates
dK/dV over every head of the group, but walks the range twice, first in tiles of
BLOCK_M / G_HI tokens x the G_HI heads of the group's power-of-two part, then in tiles of
BLOCK_M / G_LO_P tokens x the G_LO remaining heads (padded to G_LO_P, a power of two). Rows map
to (token, head) by shifts instead of a division by g, and no tile row is padding at g = 5 or 6.
Items are PER_ITEM tokens (a multiple of both tile widths). dq partials keep the tree's layout
(entry x g heads), so the tree's SUM merge reads them.

For the A/B in ab_fsa_pow2_heads.py (prediction and outcome there), which ran at 3e5a55c; the
library's fsa_bwd._dkdv_kernel walks head parts the same way since c02f881, so this file is the
record of what that A/B ran, not code to change.
"""
import dataclasses

import torch
import triton
import triton.language as tl

from fsalab.ops._triton import LOG2E_C, next_pow2
from fsalab.ops.selection import fsa
from fsalab.ops.selection import fsa_plan as plan
from fsalab.ops.selection.fsa_bwd import _dkdv_merge_kernel
from fsalab.ops.selection.fsa_partials import SUM, _finite_values, _gather_rows, _work_item


@triton.jit
def _dkdv_part(q, k_blk, v_blk, do, lse, delta, dqbuf, token_ids, stride_qt, stride_qh, stride_lt,
               g, d, qk_scale, sm_scale, hk, p_row, end, c0, base, kb, kl, c, dd, dmask, kt, dk_acc, dv_acc,
               G: tl.constexpr, GP: tl.constexpr, NP: tl.constexpr, J0: tl.constexpr, BLOCK_M: tl.constexpr,
               PREC: tl.constexpr):
    """Tiles of BLOCK_M // GP tokens x heads J0 .. J0 + NP of the group (GP >= NP, a power of two)
    over entries [c0, end) of the row; returns dK/dV accumulated; writes the dq partials."""
    TOKP: tl.constexpr = BLOCK_M // GP
    ii = tl.arange(0, BLOCK_M) // GP
    jj = tl.arange(0, BLOCK_M) % GP
    head_ok = jj < NP
    hq = hk * g + J0 + jj
    for t0 in range(c0, end, TOKP):
        valid, pos, tok, qp, qmask, lp = _gather_rows(token_ids, p_row, t0, ii, end, hq, dd, dmask,
                                                      stride_qt, stride_qh, stride_lt, TOKP)
        valid = valid & head_ok
        qmask = qmask & head_ok[:, None]
        q_t = tl.load(q + qp, mask=qmask, other=0.0)
        do_t = tl.load(do + qp, mask=qmask, other=0.0)
        lse2 = tl.load(lse + lp, mask=valid, other=0.0) * LOG2E_C
        dl = tl.load(delta + lp, mask=valid, other=0.0)
        live = valid[:, None] & (c < kl)[None, :] & ((kb + c)[None, :] <= tok[:, None])
        s = tl.dot(q_t, tl.trans(k_blk), input_precision=PREC) * qk_scale
        p = tl.exp2(tl.where(live, s, float("-inf")) - lse2[:, None])
        dv_acc += tl.dot(tl.trans(p.to(do_t.dtype)), do_t, input_precision=PREC)
        dp = tl.dot(do_t, tl.trans(v_blk), input_precision=PREC)
        ds = p * (dp - dl[:, None])
        dk_acc += tl.dot(tl.trans(ds.to(q_t.dtype)), q_t, input_precision=PREC)
        dq = tl.dot(ds.to(k_blk.dtype), k_blk, input_precision=PREC) * sm_scale
        dqp = dqbuf + ((pos - base).to(tl.int64) * G + J0 + jj)[:, None] * d + dd[None, :]
        if kt > 0:
            dq += tl.load(dqp, mask=qmask, other=0.0).to(tl.float32)
        tl.store(dqp, dq.to(dqbuf.dtype.element_ty), mask=qmask)
    return dk_acc, dv_acc


@triton.jit
def _dkdv_pow2_kernel(
    q, k, v, do, lse, delta, dk, dv, dqbuf, dkp, dvp,
    row_ptr, token_ids, blk_start, blk_len,
    first, item_row, item_sub, slot_first,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_lt,
    r_begin, r_end, cap, g, d, block_size, qk_scale, sm_scale,
    G: tl.constexpr, G_HI: tl.constexpr, G_LO: tl.constexpr, G_LO_P: tl.constexpr, PER_ITEM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_KT: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr,
):
    r, sub, ok = _work_item(tl.program_id(0), first, item_row, item_sub, r_begin, r_end)
    if ok == 0:
        return
    hk = r // cap
    gb = r - hk * cap
    p_row = tl.load(row_ptr + r)
    row_len = tl.load(row_ptr + r + 1) - p_row
    c0 = sub * PER_ITEM
    end = tl.minimum(row_len, c0 + PER_ITEM)  # empty rows: no tile, zero dK/dV
    split = row_len > PER_ITEM
    slot = tl.load(slot_first + r) - tl.load(slot_first + r_begin) + sub
    base = tl.load(row_ptr + r_begin)
    kb = tl.load(blk_start + gb)
    kl = tl.load(blk_len + gb)
    dd = tl.arange(0, D)
    dmask = dd < d
    for kt in range(NUM_KT):
        c = kt * BLOCK_N + tl.arange(0, BLOCK_N)
        kmask = (c < kl)[:, None] & dmask[None, :]
        kp = (kb + c).to(tl.int64)[:, None] * stride_kt + hk * stride_kh + dd[None, :]
        k_blk = tl.load(k + kp, mask=kmask, other=0.0)
        v_blk, _ = _finite_values(tl.load(v + kp, mask=kmask, other=0.0))
        dk_acc = tl.zeros([BLOCK_N, D], tl.float32)
        dv_acc = tl.zeros([BLOCK_N, D], tl.float32)
        dk_acc, dv_acc = _dkdv_part(q, k_blk, v_blk, do, lse, delta, dqbuf, token_ids, stride_qt, stride_qh,
                                    stride_lt, g, d, qk_scale, sm_scale, hk, p_row, end, c0, base, kb, kl, c, dd,
                                    dmask, kt, dk_acc, dv_acc, G, G_HI, G_HI, 0, BLOCK_M, PREC)
        if G_LO > 0:
            dk_acc, dv_acc = _dkdv_part(q, k_blk, v_blk, do, lse, delta, dqbuf, token_ids, stride_qt, stride_qh,
                                        stride_lt, g, d, qk_scale, sm_scale, hk, p_row, end, c0, base, kb, kl, c,
                                        dd, dmask, kt, dk_acc, dv_acc, G, G_LO_P, G_LO, G_HI, BLOCK_M, PREC)
        dk_acc = dk_acc * sm_scale
        if split:
            so = (slot.to(tl.int64) * block_size + c)[:, None] * d + dd[None, :]
            tl.store(dkp + so, dk_acc, mask=kmask)
            tl.store(dvp + so, dv_acc, mask=kmask)
        else:
            tl.store(dk + kp, dk_acc.to(dk.dtype.element_ty), mask=kmask)
            tl.store(dv + kp, dv_acc.to(dv.dtype.element_ty), mask=kmask)


def backward_split(pb, o, lse, do):
    """fsa._backward_fast (whole groups fit the budget) with _dkdv_pow2_kernel; dq by the tree's merge."""
    g = pb.g
    g_hi = 1 << (g.bit_length() - 1)
    g_lo = g - g_hi
    g_lo_p = next_pow2(g_lo) if g_lo else 1
    delta = fsa._delta(o, do, None)
    dq, dk, dv = torch.empty_like(pb.q), torch.empty_like(pb.k), torch.empty_like(pb.v)
    per_head = pb.total * pb.topk * pb.d * pb.q.element_size()
    assert plan.fits_whole_groups(per_head)
    chunks = plan.head_chunks(pb.h_kv, g, per_head, allow_partial_groups=False)
    dqbuf, _ = fsa._chunk_buffers(pb, chunks, pb.q.dtype, False)
    tree = plan.bwd_tiles(g, pb.D, pb.block_size)  # block_m, block_n, warps, stages as the tree's
    # Items and split-row slots as the tree sizes them, for tiles of the wider part's tokens.
    wide = dataclasses.replace(tree, tok=max(tree.block_m // g_hi, tree.block_m // g_lo_p))
    work, dkp, dvp = fsa._split_work(pb, chunks, wide)
    per_item = work.per_item
    ix = pb.index
    num_kt = triton.cdiv(pb.block_size, tree.block_n)
    for c in chunks:
        r_begin, r_end = c.hk0 * pb.cap, (c.hk0 + c.n_kv) * pb.cap
        _dkdv_pow2_kernel[(work.grid(pb.entries(c.n_kv), r_end - r_begin),)](
            pb.q, pb.k, pb.v, do, lse, delta, dk, dv, dqbuf, dkp, dvp,
            ix.row_ptr, ix.token_ids, ix.block_start, ix.block_len, work.first, work.item_row, work.item_sub,
            work.slots, *fsa._strides(pb), r_begin, r_end, pb.cap, g, pb.d, pb.block_size, pb.scale * fsa.LOG2E,
            pb.scale, G=g, G_HI=g_hi, G_LO=g_lo, G_LO_P=g_lo_p, PER_ITEM=per_item, BLOCK_M=tree.block_m,
            BLOCK_N=tree.block_n, NUM_KT=num_kt, D=pb.D, PREC=pb.prec, num_warps=tree.num_warps,
            num_stages=tree.num_stages,
        )
        _dkdv_merge_kernel[(r_end - r_begin, num_kt)](
            dkp, dvp, dk, dv, ix.row_ptr, work.slots, ix.block_start, ix.block_len,
            pb.k.stride(0), pb.k.stride(1), r_begin, pb.cap, per_item, pb.block_size, pb.d,
            BLOCK_N=tree.block_n, D=pb.D, num_warps=4,
        )
        fsa._launch_merge(pb, c, SUM, dqbuf, None, dq, None)
    return dq, dk, dv
