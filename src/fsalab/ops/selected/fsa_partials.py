"""FSA's KV-block-outer partial kernel — one partial result per (token, block) entry, for the
forward (STATS, PAPER, FAST) and for the dq of the backward (DQ) — and the token-outer kernel
that merges each token's partials (no atomics anywhere).

``_partial_kernel`` runs one program per (CSR row = (KV head, block), range of the row's
tokens[, query head]). It loads the block's K/V once, then gathers the non-contiguous selecting
tokens through ``token_ids`` in tiles of BLOCK_M MMA rows: TOK tokens x G query heads,
token-major, so the g heads of a group share one K/V load and nothing is padded to the MMA
minimum once TOK * G >= 16. Modes:

- STATS (paper kernel 2): per entry and head, log2-sum-exp of the scores over the block; no V.
- PAPER (paper kernel 1): sum_j exp(s_j - lse) v_j with the token's final lse precomputed by
  STATS + merge (read in log2 units, as the merge computed it), so the partials are already
  normalised and the merge is a plain sum.
- FAST (ours): the block's own softmax, o_p = softmax(s) V and its log2-sum-exp, merged by
  log-sum-exp: no statistics pass.
- DQ (backward): scale * sum_j ds_j k_j with ds = p (dp - delta), p from the saved lse (natural log).

Partials live in a compact buffer indexed by entry: row ``(p - base) * Gc + head`` where p is
the entry's position in token_ids and ``base`` the first entry of the chunk of KV heads being
processed; o-like partials are [rows, d], lse-like partials [rows] (log2 units).

Scheduling: TABLE=True reads (row, sub-range) from a work list (``fsa_plan.work_list``), one
item per NUM_MT tiles, so no program is idle. TABLE=False is the paper's grid: a flat grid of
rows x head programs x ceil(total / (TOK * NUM_MT)) token ranges; with EARLY_RETURN a program
past its row's end returns at once and stops after the row's last tile (the paper's early
termination), without it every program up to the longest non-sink row runs NUM_MT full tiles,
masked (the paper's "w/o early return" ablation; the sink block keeps its own range, as the
paper launches it separately).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton import LN2_C, LOG2E_C

# _partial_kernel modes
STATS = tl.constexpr(0)
PAPER = tl.constexpr(1)
FAST = tl.constexpr(2)
DQ = tl.constexpr(3)

# _merge_kernel modes
SUM = tl.constexpr(0)  # o = sum of partials (paper o, dq)
LSE = tl.constexpr(1)  # o = sum 2^(lse_p - lse) o_p, and lse (ours)
LSE_ONLY = tl.constexpr(2)  # lse only (paper statistics; also in log2 units to out)


@triton.jit
def _work_item(pid, first, item_row, item_sub, r_begin, r_end):
    """(row, index of the item in its row, 1 if pid maps to an item of rows [r_begin, r_end))."""
    item = tl.load(first + r_begin) + pid
    ok = item < tl.load(first + r_end)
    item = tl.where(ok, item, 0)
    return tl.load(item_row + item), tl.load(item_sub + item), ok.to(tl.int32)


@triton.jit
def _gather_rows(token_ids, p_row, t0, ii, row_len, hq, dd, dmask, stride_qt, stride_qh, stride_lt, TOK: tl.constexpr):
    """A tile of TOK selecting tokens, entries p_row + t0 + ii of one CSR row (ii in [0, rows)):
    (valid [rows], pos [rows] entry index, tok [rows] token id, qp [rows, D] offsets of their q/dO
    rows, qmask [rows, D], lp [rows] offsets of their lse/delta)."""
    valid = (ii < TOK) & (t0 + ii < row_len)
    pos = p_row + t0 + ii
    tok = tl.load(token_ids + pos, mask=valid, other=0)
    tok64 = tok.to(tl.int64)
    qp = tok64[:, None] * stride_qt + hq[:, None] * stride_qh + dd[None, :]
    return valid, pos, tok, qp, valid[:, None] & dmask[None, :], tok64 * stride_lt + hq


@triton.jit
def _finite_values(v_blk):
    """(v_blk with non-finite entries zeroed, [BLOCK_N] 1 where a key's value was not finite).

    A tile's queries mask keys causally one by one, but share one P @ V product, where a masked
    key's p = 0 times a NaN/Inf value would still be NaN: zeroing those values keeps a later
    token's NaN out of earlier tokens; the flag then gives NaN to exactly the rows that attend
    such a key (``_attends_bad``)."""
    finite = tl.abs(v_blk.to(tl.float32)) < float("inf")  # False for NaN and +-Inf
    return tl.where(finite, v_blk, tl.zeros_like(v_blk)), tl.max(tl.where(finite, 0, 1), 1)


@triton.jit
def _attends_bad(live, v_bad):
    """[BLOCK_M] 1 where a row attends (``live``) a key whose value was not finite."""
    return tl.max(tl.where(live, v_bad[None, :], 0), 1)


@triton.jit
def _nonfinite_blocks_kernel(v, blk_start, blk_len, flags, cap, stride_kt, stride_kh, d,
                             BLOCK_N: tl.constexpr, D: tl.constexpr):
    """One program per (global block, KV head): flags[kv_head * cap + block] (the block's CSR row)
    = 1 where the block's values hold a NaN or Inf, else 0 (one read of V)."""
    gb = tl.program_id(0)
    hk = tl.program_id(1)
    kb = tl.load(blk_start + gb)
    kl = tl.load(blk_len + gb)
    cn = tl.arange(0, BLOCK_N)
    dd = tl.arange(0, D)
    bad = tl.zeros([], tl.int32)
    for c0 in range(0, kl, BLOCK_N):
        mask = ((c0 + cn) < kl)[:, None] & (dd < d)[None, :]
        x = tl.load(v + (kb + c0 + cn).to(tl.int64)[:, None] * stride_kt + hk * stride_kh + dd[None, :], mask=mask, other=0.0)
        bad = tl.maximum(bad, tl.max(tl.max(tl.where(tl.abs(x.to(tl.float32)) < float("inf"), 0, 1), 1), 0))
    tl.store(flags + hk * cap + gb, bad)


@triton.jit
def _partial_kernel(
    q, k, v, do, lse, delta, obuf, lbuf, v_bad_rows,
    row_ptr, token_ids, blk_start, blk_len, blk_local,
    first, item_row, item_sub, max_rest,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_lt,
    r_begin, r_end, cap, g, j0, Gc, n_sub, d, qk_scale, sm_scale,
    HP: tl.constexpr, G: tl.constexpr, TOK: tl.constexpr, BLOCK_M: tl.constexpr, NUM_MT: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_KT: tl.constexpr, D: tl.constexpr,
    MODE: tl.constexpr, TABLE: tl.constexpr, EARLY_RETURN: tl.constexpr, PREC: tl.constexpr,
    CONTAIN: tl.constexpr,
):
    """One program per work item (see the module docstring). PAPER and FAST run twice: plain
    (CONTAIN=False) over every row, then CONTAIN=True over the rows that ``v_bad_rows``
    [h_kv * cap] (``_nonfinite_blocks_kernel``) flags, whose partials it overwrites with values
    that keep NaN/Inf causal. The plain tiles stay those of a kernel without containment (a
    branch between the two inside one launch, or flag checks in every tile, slowed the plain path:
    docs/performance.md, "FSA's partials and merge"). The containing launch runs one program per
    (row, head program) that walks
    all of its row's token ranges itself: its grid is rows x HP, not the plain grid (the paper's
    flat grid is ceil(total / (TOK * NUM_MT)) times larger, 128x at 64K and 1024x without the
    inner loop: 2.1M and 16.8M programs at g = 4). A flagged row is then one program's serial
    work, which only a non-finite value pays for."""
    pid = tl.program_id(0)
    if CONTAIN:  # grid rows x HP: the program's row, from its first token range on
        r = r_begin + pid // HP
        if tl.load(v_bad_rows + r) == 0:
            return
        sub = 0
        jp = (pid % HP) * G
    elif TABLE:
        r, sub, ok = _work_item(pid, first, item_row, item_sub, r_begin, r_end)
        if ok == 0:
            return
        jp = 0
    else:
        rh = pid // n_sub
        sub = pid - rh * n_sub
        r = r_begin + rh // HP
        jp = (rh % HP) * G
    hk = r // cap
    gb = r - hk * cap
    p_row = tl.load(row_ptr + r)
    row_len = tl.load(row_ptr + r + 1) - p_row
    c0 = sub * (TOK * NUM_MT)
    if EARLY_RETURN:
        if c0 >= row_len:
            return
        end = row_len
        n_mt = tl.minimum(tl.cdiv(row_len - c0, TOK), NUM_MT)
    else:  # every program up to the longest non-sink row runs NUM_MT tiles (the sink: its own row)
        end = tl.where(tl.load(blk_local + gb) == 0, row_len, tl.load(max_rest))
        if c0 >= end:
            return
        n_mt = NUM_MT
    base = tl.load(row_ptr + r_begin)
    kb = tl.load(blk_start + gb)
    kl = tl.load(blk_len + gb)
    # Two call sites on purpose: one call under a one-trip loop changed the plain kernel's
    # register allocation at g = 8 (scripts/sass_loop_count.py --same-as); this way the plain
    # kernels build to the SASS they had before the containing launch walked its rows.
    if CONTAIN:  # every token range of the row, in turn
        for c in range(0, end, TOK * NUM_MT):
            if EARLY_RETURN:
                n_mt = tl.minimum(tl.cdiv(row_len - c, TOK), NUM_MT)
            _partial_tiles(q, k, v, do, lse, delta, obuf, lbuf, token_ids, p_row, row_len, c, n_mt, base, kb, kl,
                           hk, jp, stride_qt, stride_qh, stride_kt, stride_kh, stride_lt, g, j0, Gc, d, qk_scale,
                           sm_scale, G, TOK, BLOCK_M, BLOCK_N, NUM_KT, D, MODE, PREC, CONTAIN)
    else:
        _partial_tiles(q, k, v, do, lse, delta, obuf, lbuf, token_ids, p_row, row_len, c0, n_mt, base, kb, kl, hk, jp,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_lt, g, j0, Gc, d, qk_scale, sm_scale,
                       G, TOK, BLOCK_M, BLOCK_N, NUM_KT, D, MODE, PREC, CONTAIN)


@triton.jit
def _partial_tiles(
    q, k, v, do, lse, delta, obuf, lbuf, token_ids, p_row, row_len, c0, n_mt, base, kb, kl, hk, jp,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_lt, g, j0, Gc, d, qk_scale, sm_scale,
    G: tl.constexpr, TOK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_KT: tl.constexpr,
    D: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, CONTAIN: tl.constexpr,
):
    """The n_mt tiles of one program: entries c0 .. of CSR row (hk, block at kb of kl keys).
    CONTAIN: values zeroed where not finite (``_finite_values``), rows attending such a key NaN."""
    ii = tl.arange(0, BLOCK_M) // G  # token of each tile row
    jj = tl.arange(0, BLOCK_M) % G  # head of each tile row
    hq = hk * g + j0 + jp + jj  # query head of each tile row
    hcol = jp + jj  # its column in the chunk's buffers
    dd = tl.arange(0, D)
    dmask = dd < d
    cn = tl.arange(0, BLOCK_N)
    if NUM_KT == 1:  # the whole block in one key tile: load K/V once for all of the program's tiles
        kmask = (cn < kl)[:, None] & dmask[None, :]
        kp = (kb + cn).to(tl.int64)[:, None] * stride_kt + hk * stride_kh + dd[None, :]
        k_blk = tl.load(k + kp, mask=kmask, other=0.0)
        if MODE != STATS:
            v_blk = tl.load(v + kp, mask=kmask, other=0.0)
            if CONTAIN:
                v_blk, v_bad = _finite_values(v_blk)

    for mt in range(n_mt):
        valid, pos, tok, qp, qmask, lp = _gather_rows(
            token_ids, p_row, c0 + mt * TOK, ii, row_len, hq, dd, dmask, stride_qt, stride_qh, stride_lt, TOK
        )
        q_t = tl.load(q + qp, mask=qmask, other=0.0)
        if MODE == PAPER:  # the statistics merge's log2-sum-exp itself: no round trip through ln
            lse2 = tl.load(lse + lp, mask=valid, other=0.0)
        if MODE == DQ:
            lse2 = tl.load(lse + lp, mask=valid, other=0.0) * LOG2E_C
            do_t = tl.load(do + qp, mask=qmask, other=0.0)
            dl = tl.load(delta + lp, mask=valid, other=0.0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        if CONTAIN:
            bad = tl.zeros([BLOCK_M], tl.int32)
        for kt in range(NUM_KT):
            c = kt * BLOCK_N + cn
            if NUM_KT > 1:
                kmask = (c < kl)[:, None] & dmask[None, :]
                kp = (kb + c).to(tl.int64)[:, None] * stride_kt + hk * stride_kh + dd[None, :]
                k_blk = tl.load(k + kp, mask=kmask, other=0.0)
                if MODE != STATS:
                    v_blk = tl.load(v + kp, mask=kmask, other=0.0)
                    if CONTAIN:
                        v_blk, v_bad = _finite_values(v_blk)
            # Causal inside the own block: key position <= query position (same sequence).
            live = valid[:, None] & (c < kl)[None, :] & ((kb + c)[None, :] <= tok[:, None])
            if CONTAIN:
                bad = tl.maximum(bad, _attends_bad(live, v_bad))
            s = tl.dot(q_t, tl.trans(k_blk), input_precision=PREC) * qk_scale
            s = tl.where(live, s, float("-inf"))
            if MODE == PAPER:
                p = tl.exp2(s - lse2[:, None])
                acc += tl.dot(p.to(v_blk.dtype), v_blk, input_precision=PREC)
            elif MODE == DQ:
                p = tl.exp2(s - lse2[:, None])
                dp = tl.dot(do_t, tl.trans(v_blk), input_precision=PREC)
                ds = p * (dp - dl[:, None])
                acc += tl.dot(ds.to(k_blk.dtype), k_blk, input_precision=PREC)
            else:
                m_new = tl.maximum(m, tl.max(s, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_use)
                p = tl.exp2(s - m_use[:, None])
                l = l * alpha + tl.sum(p, 1)
                if MODE == FAST:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v_blk.dtype), v_blk, input_precision=PREC)
                m = m_new

        brow = (pos - base).to(tl.int64) * Gc + hcol
        if MODE == STATS or MODE == FAST:
            tl.store(lbuf + brow, tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf")), mask=valid)
        if MODE != STATS:
            if MODE == FAST:
                acc = acc * (1.0 / tl.where(l > 0, l, 1.0))[:, None]  # one division per row
            if CONTAIN:
                acc = tl.where(bad[:, None] > 0, float("nan"), acc)
            if MODE == DQ:
                acc = acc * sm_scale
            tl.store(obuf + brow[:, None] * d + dd[None, :], acc.to(obuf.dtype.element_ty), mask=qmask)


@triton.jit
def _merge_kernel(
    obuf, lbuf, slot_pos, row_ptr, out, lse_out,
    total, h_kv, topk, hk0, r_begin, g, j0, d, stride_ot, stride_oh, stride_lt,
    G: tl.constexpr, TOK: tl.constexpr, BLOCK_R: tl.constexpr, TOPK_P: tl.constexpr, D: tl.constexpr,
    MODE: tl.constexpr,
):
    """One program per (TOK tokens, KV head of the chunk): rows are token-major x G heads; each
    row merges the partials its token's topk slots point to (slot_pos).

    Two passes so that the partial loads do not wait on one another: the lse of every slot is
    gathered at once ([BLOCK_R, TOPK_P]) and reduced to the token's final lse, after which each
    partial's weight 2^(lse_p - lse) is known on its own and the o-partials are a weighted sum
    of independent loads (a running rescale would chain each load to the previous one)."""
    hk = hk0 + tl.program_id(1)
    rr = tl.arange(0, BLOCK_R)
    ii = rr // G
    jj = rr % G
    t = tl.program_id(0) * TOK + ii
    valid = (ii < TOK) & (t < total)
    t64 = t.to(tl.int64)
    hq = hk * g + j0 + jj
    dd = tl.arange(0, D)
    dmask = dd < d
    base = tl.load(row_ptr + r_begin)
    slots = slot_pos + (t64 * h_kv + hk) * topk

    if MODE != SUM:
        kk = tl.arange(0, TOPK_P)
        pos = tl.load(slots[:, None] + kk[None, :], mask=valid[:, None] & (kk < topk)[None, :], other=-1)
        x = tl.load(lbuf + (pos - base).to(tl.int64) * G + jj[:, None], mask=pos >= 0, other=float("-inf"))
        m = tl.max(x, 1)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        l = tl.sum(tl.exp2(x - m_use[:, None]), 1)
        lse2 = m_use + tl.log2(tl.where(l > 0, l, 1.0))  # finite: rows with no partials get weight 0
        tl.store(lse_out + t64 * stride_lt + hq, tl.where(l > 0, lse2 * LN2_C, float("-inf")), mask=valid)
        if MODE == LSE_ONLY:  # and in log2 units to out ([total, h] fp32), which the PAPER pass reads
            tl.store(out + t64 * stride_lt + hq, tl.where(l > 0, lse2, float("-inf")), mask=valid)

    if MODE != LSE_ONLY:
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for k in range(topk):
            pos_k = tl.load(slots + k, mask=valid, other=-1)
            ok = pos_k >= 0
            brow = (pos_k - base).to(tl.int64) * G + jj
            o_k = tl.load(obuf + brow[:, None] * d + dd[None, :], mask=ok[:, None] & dmask[None, :], other=0.0)
            if MODE == LSE:
                w = tl.exp2(tl.load(lbuf + brow, mask=ok, other=float("-inf")) - lse2)
                acc += w[:, None] * o_k.to(tl.float32)
            else:
                acc += o_k.to(tl.float32)
        op = t64[:, None] * stride_ot + hq[:, None] * stride_oh + dd[None, :]
        tl.store(out + op, acc.to(out.dtype.element_ty), mask=valid[:, None] & dmask[None, :])
