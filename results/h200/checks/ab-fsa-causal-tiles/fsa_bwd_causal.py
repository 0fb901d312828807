"""Variant of FSA's dK/dV kernel (``selection.fsa_bwd._dkdv_kernel``, same signature) that applies
the causal and key-range mask only to the tiles that need it. A CSR row lists the tokens that
selected one KV block in ascending order, so only its first entries — tokens inside the block,
before its last key — can see part of it; every later tile sees all BLOCK keys and needs no
mask (a padding row loads q = dO = 0 and adds nothing; its dq partial is not stored). A
partial block (the sequence's last) keeps the mask everywhere. The item's tiles run as two
loops, masked then plain, so each loop keeps one straight body.

For the A/B in ab_fsa_causal_tiles.py (prediction there); not part of the library.
"""
import triton
import triton.language as tl

from fsalab.ops._triton import LOG2E_C
from fsalab.ops.selection.fsa_partials import _finite_values, _gather_rows, _work_item


@triton.jit
def _tiles(q, k_blk, v_blk, do, lse, delta, dqbuf, token_ids, stride_qt, stride_qh, stride_lt, d, qk_scale,
           sm_scale, p_row, row_len, t_begin, n_tiles, base, kb, kl, c, ii, jj, hq, dd, dmask, kt, dk_acc, dv_acc,
           G: tl.constexpr, TOK: tl.constexpr, FUSED_DQ: tl.constexpr, PREC: tl.constexpr, MASK: tl.constexpr):
    for mt in range(n_tiles):
        valid, pos, tok, qp, qmask, lp = _gather_rows(
            token_ids, p_row, t_begin + mt * TOK, ii, row_len, hq, dd, dmask, stride_qt, stride_qh, stride_lt, TOK
        )
        q_t = tl.load(q + qp, mask=qmask, other=0.0)
        do_t = tl.load(do + qp, mask=qmask, other=0.0)
        lse2 = tl.load(lse + lp, mask=valid, other=0.0) * LOG2E_C
        dl = tl.load(delta + lp, mask=valid, other=0.0)
        s = tl.dot(q_t, tl.trans(k_blk), input_precision=PREC) * qk_scale
        if MASK:
            live = valid[:, None] & (c < kl)[None, :] & ((kb + c)[None, :] <= tok[:, None])
            s = tl.where(live, s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        dv_acc += tl.dot(tl.trans(p.to(do_t.dtype)), do_t, input_precision=PREC)
        dp = tl.dot(do_t, tl.trans(v_blk), input_precision=PREC)
        ds = p * (dp - dl[:, None])
        dk_acc += tl.dot(tl.trans(ds.to(q_t.dtype)), q_t, input_precision=PREC)
        if FUSED_DQ:
            dq = tl.dot(ds.to(k_blk.dtype), k_blk, input_precision=PREC) * sm_scale
            dqp = dqbuf + ((pos - base).to(tl.int64) * G + jj)[:, None] * d + dd[None, :]
            if kt > 0:
                dq += tl.load(dqp, mask=qmask, other=0.0).to(tl.float32)
            tl.store(dqp, dq.to(dqbuf.dtype.element_ty), mask=qmask)
    return dk_acc, dv_acc


@triton.jit
def _subtile(q, k, v, do, lse, delta, dk, dv, dqbuf, dkp, dvp, token_ids,
             stride_qt, stride_qh, stride_kt, stride_kh, stride_lt,
             g, d, block_size, qk_scale, sm_scale, hk, p_row, row_len, c0, n_mt, n_masked, split, slot, base, kb,
             kl, kt, G: tl.constexpr, TOK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             D: tl.constexpr, FUSED_DQ: tl.constexpr, PREC: tl.constexpr):
    ii = tl.arange(0, BLOCK_M) // G
    jj = tl.arange(0, BLOCK_M) % G
    hq = hk * g + jj
    dd = tl.arange(0, D)
    dmask = dd < d
    c = kt * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = (c < kl)[:, None] & dmask[None, :]
    kp = (kb + c).to(tl.int64)[:, None] * stride_kt + hk * stride_kh + dd[None, :]
    k_blk = tl.load(k + kp, mask=kmask, other=0.0)
    v_blk, _ = _finite_values(tl.load(v + kp, mask=kmask, other=0.0))
    dk_acc = tl.zeros([BLOCK_N, D], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, D], tl.float32)
    dk_acc, dv_acc = _tiles(q, k_blk, v_blk, do, lse, delta, dqbuf, token_ids, stride_qt, stride_qh, stride_lt, d,
                            qk_scale, sm_scale, p_row, row_len, c0, n_masked, base, kb, kl, c, ii, jj, hq, dd, dmask,
                            kt, dk_acc, dv_acc, G, TOK, FUSED_DQ, PREC, True)
    dk_acc, dv_acc = _tiles(q, k_blk, v_blk, do, lse, delta, dqbuf, token_ids, stride_qt, stride_qh, stride_lt, d,
                            qk_scale, sm_scale, p_row, row_len, c0 + n_masked * TOK, n_mt - n_masked, base, kb, kl,
                            c, ii, jj, hq, dd, dmask, kt, dk_acc, dv_acc, G, TOK, FUSED_DQ, PREC, False)
    dk_acc = dk_acc * sm_scale
    if split:
        so = (slot.to(tl.int64) * block_size + c)[:, None] * d + dd[None, :]
        tl.store(dkp + so, dk_acc, mask=kmask)
        tl.store(dvp + so, dv_acc, mask=kmask)
    else:
        tl.store(dk + kp, dk_acc.to(dk.dtype.element_ty), mask=kmask)
        tl.store(dv + kp, dv_acc.to(dv.dtype.element_ty), mask=kmask)


@triton.jit
def _dkdv_kernel(
    q, k, v, do, lse, delta, dk, dv, dqbuf, dkp, dvp,
    row_ptr, token_ids, blk_start, blk_len,
    first, item_row, item_sub, slot_first,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_lt,
    r_begin, r_end, cap, g, d, block_size, qk_scale, sm_scale,
    G: tl.constexpr, TOK: tl.constexpr, BLOCK_M: tl.constexpr, NUM_MT: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_KT: tl.constexpr, D: tl.constexpr,
    FUSED_DQ: tl.constexpr, PREC: tl.constexpr,
):
    r, sub, ok = _work_item(tl.program_id(0), first, item_row, item_sub, r_begin, r_end)
    if ok == 0:
        return
    hk = r // cap
    gb = r - hk * cap
    p_row = tl.load(row_ptr + r)
    row_len = tl.load(row_ptr + r + 1) - p_row
    c0 = sub * (TOK * NUM_MT)
    n_mt = tl.maximum(tl.minimum(tl.cdiv(row_len - c0, TOK), NUM_MT), 0)
    split = row_len > TOK * NUM_MT
    slot = tl.load(slot_first + r) - tl.load(slot_first + r_begin) + sub
    base = tl.load(row_ptr + r_begin)
    kb = tl.load(blk_start + gb)
    kl = tl.load(blk_len + gb)
    # Entries that may not see the whole block: tokens before its last key (at most BLOCK_N *
    # NUM_KT - 1 of them, all at the row's start); all of a partial block's.
    own = tl.arange(0, BLOCK_N * NUM_KT)
    tok0 = tl.load(token_ids + p_row + own, mask=own < row_len, other=2147483647)
    n_own = tl.sum((tok0 < kb + block_size - 1).to(tl.int32), 0)
    n_own = tl.where(kl < block_size, row_len, n_own)
    n_masked = tl.minimum(tl.maximum(tl.cdiv(n_own - c0, TOK), 0), n_mt)
    if FUSED_DQ:
        for kt in range(NUM_KT):
            _subtile(q, k, v, do, lse, delta, dk, dv, dqbuf, dkp, dvp, token_ids,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_lt,
                     g, d, block_size, qk_scale, sm_scale, hk, p_row, row_len, c0, n_mt, n_masked, split, slot, base,
                     kb, kl, kt, G, TOK, BLOCK_M, BLOCK_N, D, True, PREC)
    else:
        _subtile(q, k, v, do, lse, delta, dk, dv, dqbuf, dkp, dvp, token_ids,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_lt,
                 g, d, block_size, qk_scale, sm_scale, hk, p_row, row_len, c0, n_mt, n_masked, split, slot, base,
                 kb, kl, tl.program_id(1), G, TOK, BLOCK_M, BLOCK_N, D, False, PREC)
