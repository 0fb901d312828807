"""FSA backward kernels that are KV-block-major: dK/dV without atomics (optionally with the dq
partials of the same pass), the merge of rows split over several programs, and delta.

``_dkdv_kernel``: one program per (CSR row, range of PER_ITEM of its tokens). For each key
sub-tile of the block it loads K/V once and walks the range once per head part of the group
(``fsa_plan.head_parts``: its largest power of two G_HI, then the G_LO heads left, padded to
G_LO_P, a power of two, rows per token), in tiles of BLOCK_M // part tokens x the part's
heads, accumulating dK and dV over every head of the group in fp32 registers. Rows map to (token,
head) by shifts, and no row pads unless the rest is not a power of two (g = 7: 3 heads in 4
rows); one walk over all heads of a group such as g = 5 per tile, rows mapped by division, is
slower (register pressure, spills; docs/performance.md, "Selected attention").

With FUSED_DQ it also writes each entry's dq partial (scale * ds K, in the buffer's dtype: q's) to
the compact buffer (entry-major, g heads inner), so q, dO, lse and delta are gathered once for both
gradients; with several key sub-tiles the later ones add to the partial the first one wrote (same
program, same layout, so no race). Without FUSED_DQ each key sub-tile gets its own program (grid
axis 1) and the token loops are the only loops: the fp16 dK of the fsa_paper backward (128-key
blocks, two sub-tiles walked in a loop around the token loop) came out wrong on an sm_90 GPU
while dV and the fused variant were right, with no difference under the interpreter.

Programs come from a work list with at least one item per row, so empty rows write zero dK/dV. A
row whose tokens are spread over several programs (row length > PER_ITEM; the sink block is
selected by every token) writes fp32 dK/dV partials to its own slots
(``fsa_plan.work_list(..., split_slots=True)``) and ``_dkdv_merge_kernel`` sums them; every other
row writes dK/dV directly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton import LOG2E_C
from .fsa_partials import _finite_values, _gather_rows, _work_item


@triton.jit
def _dkdv_kernel(
    q, k, v, do, lse, delta, dk, dv, dqbuf, dkp, dvp,
    row_ptr, token_ids, blk_start, blk_len,
    first, item_row, item_sub, slot_first,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_lt,
    r_begin, r_end, cap, g, d, block_size, qk_scale, sm_scale,
    G: tl.constexpr, G_HI: tl.constexpr, G_LO: tl.constexpr, G_LO_P: tl.constexpr, PER_ITEM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_KT: tl.constexpr, D: tl.constexpr,
    FUSED_DQ: tl.constexpr, PREC: tl.constexpr,
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

    if FUSED_DQ:
        # Sub-tiles in turn: the later ones add to the dq partial the first one wrote.
        for kt in range(NUM_KT):
            _dkdv_subtile(
                q, k, v, do, lse, delta, dk, dv, dqbuf, dkp, dvp, token_ids,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_lt,
                g, d, block_size, qk_scale, sm_scale, hk, p_row, c0, end, split, slot, base, kb, kl, kt,
                G, G_HI, G_LO, G_LO_P, BLOCK_M, BLOCK_N, D, True, PREC,
            )
    else:
        # dK/dV alone: one key sub-tile per program (grid axis 1), no loop around the token loops.
        _dkdv_subtile(
            q, k, v, do, lse, delta, dk, dv, dqbuf, dkp, dvp, token_ids,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_lt,
            g, d, block_size, qk_scale, sm_scale, hk, p_row, c0, end, split, slot, base, kb, kl, tl.program_id(1),
            G, G_HI, G_LO, G_LO_P, BLOCK_M, BLOCK_N, D, False, PREC,
        )


@triton.jit
def _dkdv_subtile(
    q, k, v, do, lse, delta, dk, dv, dqbuf, dkp, dvp, token_ids,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_lt,
    g, d, block_size, qk_scale, sm_scale, hk, p_row, c0, end, split, slot, base, kb, kl, kt,
    G: tl.constexpr, G_HI: tl.constexpr, G_LO: tl.constexpr, G_LO_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, FUSED_DQ: tl.constexpr, PREC: tl.constexpr,
):
    """dK/dV of key sub-tile kt of the block over entries [c0, end) of the row, all g heads."""
    dd = tl.arange(0, D)
    dmask = dd < d
    c = kt * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = (c < kl)[:, None] & dmask[None, :]
    kp = (kb + c).to(tl.int64)[:, None] * stride_kt + hk * stride_kh + dd[None, :]
    k_blk = tl.load(k + kp, mask=kmask, other=0.0)
    # Non-finite values zeroed (``_finite_values``): dP = dO V^T of a row that cannot see such a
    # key would be NaN there and reach dK through p = 0; rows that do see it have a NaN output,
    # hence a NaN delta, and keep their NaN gradients.
    v_blk, _ = _finite_values(tl.load(v + kp, mask=kmask, other=0.0))
    dk_acc = tl.zeros([BLOCK_N, D], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, D], tl.float32)
    dk_acc, dv_acc = _dkdv_heads(
        q, k_blk, v_blk, do, lse, delta, dqbuf, token_ids, stride_qt, stride_qh, stride_lt, g, d, qk_scale, sm_scale,
        hk, p_row, c0, end, base, kb, kl, c, dd, dmask, kt, dk_acc, dv_acc, G, G_HI, G_HI, 0, BLOCK_M, FUSED_DQ, PREC,
    )
    if G_LO > 0:
        dk_acc, dv_acc = _dkdv_heads(
            q, k_blk, v_blk, do, lse, delta, dqbuf, token_ids, stride_qt, stride_qh, stride_lt, g, d, qk_scale,
            sm_scale, hk, p_row, c0, end, base, kb, kl, c, dd, dmask, kt, dk_acc, dv_acc,
            G, G_LO_P, G_LO, G_HI, BLOCK_M, FUSED_DQ, PREC,
        )
    dk_acc = dk_acc * sm_scale
    if split:
        so = (slot.to(tl.int64) * block_size + c)[:, None] * d + dd[None, :]
        tl.store(dkp + so, dk_acc, mask=kmask)
        tl.store(dvp + so, dv_acc, mask=kmask)
    else:
        tl.store(dk + kp, dk_acc.to(dk.dtype.element_ty), mask=kmask)
        tl.store(dv + kp, dv_acc.to(dv.dtype.element_ty), mask=kmask)


@triton.jit
def _dkdv_heads(
    q, k_blk, v_blk, do, lse, delta, dqbuf, token_ids, stride_qt, stride_qh, stride_lt, g, d, qk_scale, sm_scale,
    hk, p_row, c0, end, base, kb, kl, c, dd, dmask, kt, dk_acc, dv_acc,
    G: tl.constexpr, GP: tl.constexpr, NP: tl.constexpr, J0: tl.constexpr, BLOCK_M: tl.constexpr,
    FUSED_DQ: tl.constexpr, PREC: tl.constexpr,
):
    """(dk_acc, dv_acc) plus the contributions of heads J0 .. J0 + NP of the group over entries
    [c0, end) of the row, in tiles of BLOCK_M // GP tokens x GP head rows (GP >= NP a power of
    two; rows of heads >= NP are masked); with FUSED_DQ also the entries' dq partials.

    Two spellings of one loop, as the compiler schedules them differently: over a count of tiles
    where the part is the whole group (stepping by tokens there is slower at g = 1 and 4), over
    token offsets where the group has a rest (faster than counting tiles at g = 5; both timed in
    docs/performance.md, "Selected attention")."""
    TOKP: tl.constexpr = BLOCK_M // GP
    if NP == G:
        for mt in range(tl.cdiv(end - c0, TOKP)):
            dk_acc, dv_acc = _dkdv_tile(
                q, k_blk, v_blk, do, lse, delta, dqbuf, token_ids, stride_qt, stride_qh, stride_lt, g, d, qk_scale,
                sm_scale, hk, p_row, c0 + mt * TOKP, end, base, kb, kl, c, dd, dmask, kt, dk_acc, dv_acc,
                G, GP, NP, J0, BLOCK_M, FUSED_DQ, PREC,
            )
    else:
        for t0 in range(c0, end, TOKP):
            dk_acc, dv_acc = _dkdv_tile(
                q, k_blk, v_blk, do, lse, delta, dqbuf, token_ids, stride_qt, stride_qh, stride_lt, g, d, qk_scale,
                sm_scale, hk, p_row, t0, end, base, kb, kl, c, dd, dmask, kt, dk_acc, dv_acc,
                G, GP, NP, J0, BLOCK_M, FUSED_DQ, PREC,
            )
    return dk_acc, dv_acc


@triton.jit
def _dkdv_tile(
    q, k_blk, v_blk, do, lse, delta, dqbuf, token_ids, stride_qt, stride_qh, stride_lt, g, d, qk_scale, sm_scale,
    hk, p_row, t0, end, base, kb, kl, c, dd, dmask, kt, dk_acc, dv_acc,
    G: tl.constexpr, GP: tl.constexpr, NP: tl.constexpr, J0: tl.constexpr, BLOCK_M: tl.constexpr,
    FUSED_DQ: tl.constexpr, PREC: tl.constexpr,
):
    """One tile of ``_dkdv_heads``: entries t0 + [0, BLOCK_M // GP) (below end) of the row."""
    ii = tl.arange(0, BLOCK_M) // GP  # token of each tile row
    jj = tl.arange(0, BLOCK_M) % GP  # head of each tile row within the part
    hq = hk * g + J0 + jj
    valid, pos, tok, qp, qmask, lp = _gather_rows(
        token_ids, p_row, t0, ii, end, hq, dd, dmask, stride_qt, stride_qh, stride_lt, BLOCK_M // GP
    )
    if NP < GP:  # padded head rows (a rest that is not a power of two)
        valid = valid & (jj < NP)
        qmask = qmask & (jj < NP)[:, None]
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
    if FUSED_DQ:
        dq = tl.dot(ds.to(k_blk.dtype), k_blk, input_precision=PREC) * sm_scale
        dqp = dqbuf + ((pos - base).to(tl.int64) * G + J0 + jj)[:, None] * d + dd[None, :]
        if kt > 0:
            dq += tl.load(dqp, mask=qmask, other=0.0).to(tl.float32)
        tl.store(dqp, dq.to(dqbuf.dtype.element_ty), mask=qmask)
    return dk_acc, dv_acc


@triton.jit
def _dkdv_merge_kernel(
    dkp, dvp, dk, dv, row_ptr, slot_first, blk_start, blk_len,
    stride_kt, stride_kh, r_begin, cap, per_item, block_size, d,
    BLOCK_N: tl.constexpr, D: tl.constexpr,
):
    """One program per (row, key sub-tile): rows split over several programs sum their slots."""
    r = r_begin + tl.program_id(0)
    row_len = tl.load(row_ptr + r + 1) - tl.load(row_ptr + r)
    n = tl.cdiv(row_len, per_item)
    if n <= 1:
        return
    hk = r // cap
    gb = r - hk * cap
    slot0 = tl.load(slot_first + r) - tl.load(slot_first + r_begin)
    kb = tl.load(blk_start + gb)
    kl = tl.load(blk_len + gb)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dd = tl.arange(0, D)
    kmask = (c < kl)[:, None] & (dd < d)[None, :]
    acc_k = tl.zeros([BLOCK_N, D], tl.float32)
    acc_v = tl.zeros([BLOCK_N, D], tl.float32)
    for s in range(n):
        so = ((slot0 + s).to(tl.int64) * block_size + c)[:, None] * d + dd[None, :]
        acc_k += tl.load(dkp + so, mask=kmask, other=0.0)
        acc_v += tl.load(dvp + so, mask=kmask, other=0.0)
    kp = (kb + c).to(tl.int64)[:, None] * stride_kt + hk * stride_kh + dd[None, :]
    tl.store(dk + kp, acc_k.to(dk.dtype.element_ty), mask=kmask)
    tl.store(dv + kp, acc_v.to(dv.dtype.element_ty), mask=kmask)


@triton.jit
def _delta_kernel(o, do, dlse, delta, n_rows, d, HAS_DLSE: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr):
    """delta[row] = sum_d o * dO - dlse[row] over rows = (token, head) of contiguous [total, h, d]
    tensors: ds = p * (dp - delta) then also carries the gradient of the returned lse."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dd = tl.arange(0, D)
    rmask = rows < n_rows
    offs = rows.to(tl.int64)[:, None] * d + dd[None, :]
    mask = rmask[:, None] & (dd < d)[None, :]
    x = tl.load(o + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(do + offs, mask=mask, other=0.0).to(tl.float32)
    acc = tl.sum(x * y, 1)
    if HAS_DLSE:
        acc -= tl.load(dlse + rows, mask=rmask, other=0.0)
    tl.store(delta + rows, acc, mask=rmask)
