"""NSA's query-outer selected-attention kernel (NSA paper §3.4, DESIGN §5), forward and backward.

Forward: one program per (token, KV head). The g query heads of the token are the MMA's M
dimension, padded to BLOCK_H = max(16, next_pow2(g)) and masked; the program walks the
token's selected blocks in order (stopping at the first -1) with an exp2 online softmax, causal
only inside the last (own) block. Head dims are padded to BLOCK_D = next_pow2(d) and masked.
One token per program: two tokens select different blocks, so their rows cannot share a K/V tile.

Backward:
- dq (and delta = rowsum(o * do) - dlse): one program per (token, KV head), same loop as forward.
- dk/dv: KV-block-outer over the CSR lists of ``index.build_selection_index``; one program per
  (KV head, block, BLOCK_N keys, segment) walks the (token, head) rows that selected the block, so
  no atomics are needed. Lists longer than ``_segment_entries`` (the attention sink is selected by
  every token) are split into segments run by the same launch; such rows write fp32 partials that
  a small merge kernel adds in segment order, keeping the result deterministic and the load balanced.

Every loop loads the indices of its next step one iteration ahead (``PREFETCH``): the gathers of
step i+1 then depend on a loop-carried value, not on a load of the same iteration, so Triton's
pipeliner issues them (cp.async) while step i computes. ``prefetch=False`` in the host wrappers is
the ablation. Its byte and FLOP floors and times: docs/performance.md, "Selected attention".

Shapes: q [total, h, d], k/v [total, h_kv, d], block_idx int32 [total, h_kv, topk] (local block
ids, ascending, -1 padding), cu_seqlens int32 [batch + 1]. Outputs: o [total, h, d] in q.dtype,
lse [total, h] fp32 natural log (-inf where nothing is selected, with o = 0).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...checks import check_kernel_call
from .._triton import LN2_C, LOG2E, LOG2E_C, autotune, dot_precision, interpreter_meta, next_pow2
from ..library import grads_like, lse_like, op_or
from .. import scratch
from . import worklist
from .index import SelectionIndex, build_selection_index, token_starts


def _prune(configs, named_args, **kwargs):
    """Drop configs whose key tile exceeds the selection block (tiles never straddle blocks)."""
    block_size = kwargs.get("BLOCK_SIZE", named_args.get("BLOCK_SIZE"))
    kept = [c for c in configs if c.kwargs["BLOCK_N"] <= block_size]
    return kept or [triton.Config({**configs[0].kwargs, "BLOCK_N": block_size}, num_warps=4, num_stages=3)]


def _fixed_config(block_d: int, block_size: int, kv_outer: bool) -> triton.Config:
    """The config of a launch that is not autotuned (interpreter, ``settings.autotune`` off): one that fits
    any shape on sm_80+.

    Query-outer kernels: BLOCK_N = 64 keys (32 for d > 128), 4 warps, two stages. The KV-outer
    dk/dv kernel: 8 warps, BLOCK_M = 32 rows, BLOCK_N = 64 keys and four stages for d <= 128, 32
    keys and three stages above (spill-free on sm_90 and within shared memory even for fp32).
    BLOCK_N is capped by the block.
    """
    wide = block_d > 128
    block_n = min(32 if wide else 64, block_size)
    if kv_outer:
        return triton.Config({"BLOCK_M": 32, "BLOCK_N": block_n}, num_warps=8, num_stages=3 if wide else 4)
    return triton.Config({"BLOCK_N": block_n}, num_warps=4, num_stages=2)


def _autotune(configs, kv_outer: bool = False):
    """Autotune keyed on (d, g, block_size) (``_triton.autotune``; the fixed config when untuned)."""
    return autotune(configs, key=["D", "G", "BLOCK_SIZE"], prune=_prune,
                    untuned=lambda args: _fixed_config(args["BLOCK_D"], args["BLOCK_SIZE"], kv_outer))


def _launch_defaults(meta: dict, block_size: int, kv_outer: bool) -> dict:
    """Launch meta-parameters: the fixed config under the interpreter, {} on a GPU (autotuner's)."""
    cfg = _fixed_config(meta["BLOCK_D"], block_size, kv_outer)
    return interpreter_meta(**cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _cfg(block_n, warps, stages, block_m=None):
    kw = {"BLOCK_N": block_n} if block_m is None else {"BLOCK_M": block_m, "BLOCK_N": block_n}
    return triton.Config(kw, num_warps=warps, num_stages=stages)


# Few configs each: the GPU check compiles all of them for every shape key. Query-outer kernels
# (fwd, dq): [BLOCK_H, d] x [d, BLOCK_N] tiles whose K/V loads come mostly from L2, so the
# configs trade pipeline depth (shared memory) against resident programs.
_FWD_CONFIGS = [_cfg(64, 4, 2), _cfg(64, 4, 3), _cfg(64, 2, 3), _cfg(32, 4, 3)]
_DQ_CONFIGS = [_cfg(64, 4, 2), _cfg(64, 4, 3), _cfg(32, 4, 3), _cfg(32, 4, 4)]
# KV-outer dk/dv kernel: [BLOCK_N, d] fp32 accumulators (dk, dv) stay in registers, so 8 warps
# (16 are capped at 128 registers and spill) and one CTA per SM: nothing but the pipeline hides the
# HBM latency of the q/do row gathers, so every config keeps >= 1 row chunk in flight while one
# computes (stages >= 3; with 2, Triton waits for a chunk right after issuing it). Spills on sm_90
# (ptxas, bf16): none for BLOCK_M = 32 at d <= 128, <= 100 bytes for BLOCK_M = 64; the last config
# is the spill-free one at d = 256 (and the only one for 32-key blocks).
_KV_CONFIGS = [_cfg(64, 8, 4, 32), _cfg(64, 8, 5, 32), _cfg(64, 8, 3, 64), _cfg(64, 8, 4, 64), _cfg(32, 8, 3, 32)]


@triton.jit
def _num_steps(
    idx_base, pos, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Key tiles to visit: every tile of the selected blocks before the first -1, except the tiles
    of the last block that lie wholly after the token (pos = its position in its sequence)."""
    offs = tl.arange(0, TOPK_PAD)
    sel = tl.load(idx_base + offs, mask=offs < TOPK, other=-1)
    n_sel = tl.min(tl.where(sel < 0, offs, TOPK_PAD), axis=0)
    last = tl.load(idx_base + tl.maximum(n_sel - 1, 0))
    tail = tl.minimum(pos - last * BLOCK_SIZE + 1, BLOCK_SIZE)
    steps = (n_sel - 1) * (BLOCK_SIZE // BLOCK_N) + tl.cdiv(tail, BLOCK_N)
    return tl.where(n_sel > 0, steps, 0)


@_autotune(_FWD_CONFIGS)
@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, BLOCK_IDX, TOK_START, qk_scale,
    H_KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """o and lse of the g query heads of token t (program axis 0) that share KV head hk (axis 1).

    Axis 0 runs fastest, so resident programs share one KV head's K/V working set in L2.
    """
    t = tl.program_id(0)
    hk = tl.program_id(1)
    start = tl.load(TOK_START + t)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < G
    d_mask = offs_d < D
    rows = t.to(tl.int64) * (H_KV * G) + hk * G + offs_h
    q_mask = h_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + rows[:, None] * D + offs_d[None, :], mask=q_mask, other=0.0)

    idx_base = BLOCK_IDX + (t.to(tl.int64) * H_KV + hk) * TOPK
    steps = _num_steps(idx_base, t - start, TOPK, TOPK_PAD, BLOCK_SIZE, BLOCK_N)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    blk_next = tl.load(idx_base)
    for j in range(steps):
        if PREFETCH:  # the block id of step j + 1, loaded while step j computes
            blk = blk_next
            blk_next = tl.load(idx_base + (j + 1) // (BLOCK_SIZE // BLOCK_N), mask=j + 1 < steps, other=0)
        else:
            blk = tl.load(idx_base + j // (BLOCK_SIZE // BLOCK_N))
        key = start + blk * BLOCK_SIZE + (j % (BLOCK_SIZE // BLOCK_N)) * BLOCK_N + offs_n
        k_mask = key <= t  # causal; only ever false inside the own (last) block
        kv_ptr = (key.to(tl.int64) * H_KV + hk) * D
        kv_mask = k_mask[:, None] & d_mask[None, :]
        k = tl.load(K + kv_ptr[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(k_mask[None, :], s, float("-inf"))
        # The first tile of every block holds key blk * B <= t, so m is finite from the first step on.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(V + kv_ptr[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    seen = l > 0
    l_safe = tl.where(seen, l, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(seen, (m + tl.log2(l_safe)) * LN2_C, float("-inf"))
    tl.store(O + rows[:, None] * D + offs_d[None, :], o.to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + rows, lse, mask=h_mask)


@_autotune(_DQ_CONFIGS)
@triton.jit
def _bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DLSE, DELTA, DQ, BLOCK_IDX, TOK_START, sm_scale, qk_scale,
    H_KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    HAS_DLSE: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dq, and DELTA = rowsum(o * do) - dlse for the dk/dv kernel (d lse / d s = p)."""
    t = tl.program_id(0)
    hk = tl.program_id(1)
    start = tl.load(TOK_START + t)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < G
    d_mask = offs_d < D
    rows = t.to(tl.int64) * (H_KV * G) + hk * G + offs_h
    q_mask = h_mask[:, None] & d_mask[None, :]
    row_ptr = rows[:, None] * D + offs_d[None, :]
    q = tl.load(Q + row_ptr, mask=q_mask, other=0.0)
    do = tl.load(DO + row_ptr, mask=q_mask, other=0.0)
    o = tl.load(O + row_ptr, mask=q_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + rows, mask=h_mask, other=0.0)
    tl.store(DELTA + rows, delta, mask=h_mask)
    # Empty rows (lse = -inf) run no step; padded heads read 0 and contribute 0 (do = 0).
    lse2 = tl.load(LSE + rows, mask=h_mask, other=0.0) * LOG2E_C

    idx_base = BLOCK_IDX + (t.to(tl.int64) * H_KV + hk) * TOPK
    steps = _num_steps(idx_base, t - start, TOPK, TOPK_PAD, BLOCK_SIZE, BLOCK_N)
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    blk_next = tl.load(idx_base)
    for j in range(steps):
        if PREFETCH:
            blk = blk_next
            blk_next = tl.load(idx_base + (j + 1) // (BLOCK_SIZE // BLOCK_N), mask=j + 1 < steps, other=0)
        else:
            blk = tl.load(idx_base + j // (BLOCK_SIZE // BLOCK_N))
        key = start + blk * BLOCK_SIZE + (j % (BLOCK_SIZE // BLOCK_N)) * BLOCK_N + offs_n
        k_mask = key <= t
        kv_ptr = (key.to(tl.int64) * H_KV + hk) * D
        kv_mask = k_mask[:, None] & d_mask[None, :]
        k = tl.load(K + kv_ptr[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_ptr[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        p = tl.where(k_mask[None, :], tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + row_ptr, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


@triton.jit
def _dkdv_segment(
    Q, DO, LSE, DELTA, TOKEN_IDS, k, v, key, lo, hi, hk, qk_scale,
    H_KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Unscaled dk, dv [BLOCK_N, BLOCK_D] (fp32) of keys ``key`` from CSR entries [lo, hi).

    The entries' (token, head) pairs are flattened to rows r -> (entry lo + r // G, head r % G),
    so any g fills the MMA's M dimension without padding.
    """
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    n_rows = (hi - lo) * G
    tok_next = tl.load(TOKEN_IDS + lo + offs_m // G, mask=offs_m < n_rows, other=0)
    for r0 in range(0, n_rows, BLOCK_M):
        r = r0 + offs_m
        r_mask = r < n_rows
        if PREFETCH:
            # The token ids feed both the gathers' addresses and the causal mask, so Triton's pipeliner
            # does not pipeline their load: loaded one chunk ahead, the q/do/lse/delta gathers of
            # chunk i + 1 depend on a loop-carried value and are issued while chunk i computes.
            tok = tok_next
            tok_next = tl.load(TOKEN_IDS + lo + (r + BLOCK_M) // G, mask=r + BLOCK_M < n_rows, other=0)
        else:
            tok = tl.load(TOKEN_IDS + lo + r // G, mask=r_mask, other=0)
        rows = tok.to(tl.int64) * (H_KV * G) + hk * G + r % G
        mask = r_mask[:, None] & d_mask[None, :]
        q = tl.load(Q + rows[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
        do = tl.load(DO + rows[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
        lse2 = tl.load(LSE + rows, mask=r_mask, other=0.0) * LOG2E_C
        delta = tl.load(DELTA + rows, mask=r_mask, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
        visible = r_mask[None, :] & (key[:, None] <= tok[None, :])
        p_t = tl.where(visible, tl.exp2(s_t - lse2[None, :]), 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@_autotune(_KV_CONFIGS, kv_outer=True)
@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, TOKEN_IDS, ROW_PTR, EXTRA_PTR, EXTRA_ROW, BLOCK_START, BLOCK_LEN,
    BUF_DK, BUF_DV, sm_scale, qk_scale, capacity, num_rows, max_extra,
    H_KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, SEG: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dk/dv of BLOCK_N keys of one (KV head, block) from one segment of its CSR row.

    Programs [0, max_extra) run the extra segments 1, 2, ... of long rows (the longest work first),
    the rest the first segment of every row. A row without extra segments stores dk/dv; a row with
    them stores fp32 partials in BUF [2 * max_extra, BLOCK_SIZE, D]: segment s >= 1 in slot
    extra_ptr[row] + s - 1, the first segment in slot max_extra + extra_ptr[row].
    """
    # The key tiles of one segment run back to back, so the gathered q/do rows are reused from L2.
    seg_id = tl.program_id(0) // (BLOCK_SIZE // BLOCK_N)
    sub = tl.program_id(0) % (BLOCK_SIZE // BLOCK_N)
    is_extra = seg_id < max_extra
    row = tl.where(is_extra, tl.load(EXTRA_ROW + seg_id, mask=is_extra, other=0), seg_id - max_extra)
    valid = row < num_rows  # the extra slots are an upper bound on the extra segments
    row = tl.minimum(row, num_rows - 1)
    hk = row // capacity
    blk = row % capacity
    length = tl.load(BLOCK_LEN + blk)  # 0 for block ids past the batch's last block
    if valid & (sub * BLOCK_N < length):
        offs_n = sub * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        key = tl.load(BLOCK_START + blk) + offs_n
        kv_ptr = (key.to(tl.int64) * H_KV + hk) * D
        kv_mask = (offs_n < length)[:, None] & (offs_d < D)[None, :]
        k = tl.load(K + kv_ptr[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_ptr[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        x0 = tl.load(EXTRA_PTR + row)
        first = tl.load(ROW_PTR + row)
        lo = first + tl.where(is_extra, seg_id - x0 + 1, 0) * SEG
        hi = tl.minimum(tl.load(ROW_PTR + row + 1), lo + SEG)
        dk, dv = _dkdv_segment(Q, DO, LSE, DELTA, TOKEN_IDS, k, v, key, lo, hi, hk, qk_scale,
                               H_KV, G, D, BLOCK_D, PRECISION, PREFETCH, BLOCK_M, BLOCK_N)  # fmt: skip
        if tl.load(EXTRA_PTR + row + 1) > x0:
            slot = tl.where(is_extra, seg_id, max_extra + x0)
            buf = (slot.to(tl.int64) * BLOCK_SIZE + offs_n[:, None]) * D + offs_d[None, :]
            tl.store(BUF_DK + buf, dk, mask=kv_mask)
            tl.store(BUF_DV + buf, dv, mask=kv_mask)
        else:
            out = kv_ptr[:, None] + offs_d[None, :]
            tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
            tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dkdv_merge_kernel(
    DK, DV, EXTRA_PTR, EXTRA_ROW, BLOCK_START, BLOCK_LEN, BUF_DK, BUF_DV, sm_scale, capacity, num_rows, max_extra,
    H_KV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, MERGE_N: tl.constexpr,
):  # fmt: skip
    """dk/dv of the rows with extra segments: first-segment partial + extras, in segment order.

    Program (e, keys): e is an extra slot; the row's first slot (e == extra_ptr[row]) does the work.
    """
    e = tl.program_id(0)
    row = tl.load(EXTRA_ROW + e)
    if row < num_rows:
        x0 = tl.load(EXTRA_PTR + row)
        if e == x0:
            hk = row // capacity
            blk = row % capacity
            offs_n = tl.program_id(1) * MERGE_N + tl.arange(0, MERGE_N)
            offs_d = tl.arange(0, BLOCK_D)
            mask = (offs_n < tl.load(BLOCK_LEN + blk))[:, None] & (offs_d < D)[None, :]
            tile = offs_n[:, None] * D + offs_d[None, :]
            buf = (max_extra + x0).to(tl.int64) * BLOCK_SIZE * D + tile
            dk = tl.load(BUF_DK + buf, mask=mask, other=0.0)
            dv = tl.load(BUF_DV + buf, mask=mask, other=0.0)
            buf = x0.to(tl.int64) * BLOCK_SIZE * D + tile
            for _ in range(x0, tl.load(EXTRA_PTR + row + 1)):
                dk += tl.load(BUF_DK + buf, mask=mask, other=0.0)
                dv += tl.load(BUF_DV + buf, mask=mask, other=0.0)
                buf += BLOCK_SIZE * D
            key = tl.load(BLOCK_START + blk) + offs_n
            out = ((key.to(tl.int64) * H_KV + hk) * D)[:, None] + offs_d[None, :]
            tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask)
            tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=mask)


def _segment_entries(g: int) -> int:
    """CSR entries per dk/dv segment: ~16K (token, head) rows of work, at least 1024 entries.

    The floor bounds the partial buffers at 2 * total * h_kv * topk / 1024 fp32 [block_size, d]
    tiles (dk and dv each); rows below the segment size (the common case, ~block_size * topk
    entries) need none.
    """
    return max(1024, 16384 // g)


def _kernel_meta(q: torch.Tensor, k: torch.Tensor, block_size: int) -> dict:
    """Compile-time parameters of every kernel: heads, head dim and its tile, block size, dot precision.

    fp32 inputs get IEEE dots (exact fp32, for tests); the precision is ignored for fp16/bf16.
    """
    h_kv, d = k.shape[1], k.shape[2]
    return {"H_KV": h_kv, "G": q.shape[1] // h_kv, "D": d, "BLOCK_SIZE": block_size,
            "BLOCK_D": next_pow2(d), "PRECISION": dot_precision(q.dtype)}


def _query_meta(block_idx: torch.Tensor, g: int) -> dict:
    """Query-outer kernels: the block_idx row (tile padded to a power of two), the padded head tile."""
    topk = block_idx.shape[2]
    return {"TOPK": topk, "TOPK_PAD": next_pow2(topk), "BLOCK_H": max(16, next_pow2(g))}


def _forward(q, k, v, block_idx, cu_seqlens, block_size, scale, prefetch=True):
    """(o, lse, tok_start). ``prefetch=False`` is the ablation of the block-id prefetch."""
    total, h, _ = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(total, h, dtype=torch.float32, device=q.device)
    tok_start = token_starts(cu_seqlens, total)
    if total == 0:
        return o, lse, tok_start
    meta = _kernel_meta(q, k, block_size)
    _fwd_kernel[(total, meta["H_KV"])](
        q, k, v, o, lse, block_idx, tok_start, scale * LOG2E, PREFETCH=prefetch, **meta,
        **_query_meta(block_idx, meta["G"]), **_launch_defaults(meta, block_size, kv_outer=False),
    )  # fmt: skip
    return o, lse, tok_start


def _bwd_dq(q, k, v, o, lse, do, dlse, block_idx, tok_start, block_size, scale, prefetch=True):
    """(dq [total, h, d], delta [total, h] fp32) from the query-outer kernel; total > 0."""
    meta = _kernel_meta(q, k, block_size)
    dq = torch.empty_like(q)
    delta = scratch.empty(q.shape[:2], torch.float32, q.device)
    _bwd_dq_kernel[(q.shape[0], meta["H_KV"])](
        q, k, v, o, do, lse, dlse if dlse is not None else lse, delta, dq, block_idx, tok_start,
        scale, scale * LOG2E, HAS_DLSE=dlse is not None, PREFETCH=prefetch, **meta,
        **_query_meta(block_idx, meta["G"]), **_launch_defaults(meta, block_size, kv_outer=False),
    )  # fmt: skip
    return dq, delta


def _dkdv_plan(index: SelectionIndex, g: int) -> dict:
    """Segments of the CSR rows for the dk/dv kernel, on device from shapes (no host sync, two
    launches: the row scan and the slot -> row search of ``worklist``).

    block_start/block_len int32 [capacity]: each global block's first key and key count (the
    index's block table); extra_ptr int32 [rows + 1]: exclusive prefix sum of each row's extra
    segments (beyond the first); extra_row int32 [max(max_extra, 1)]: the row of each extra slot
    (num_rows for unused slots); max_extra: host int, an upper bound on the extra segments
    (entries // seg).
    """
    num_rows = index.row_ptr.numel() - 1
    seg = _segment_entries(g)
    extra_ptr, _, _ = worklist.scan_rows(index.row_ptr, seg, worklist.EXTRA)
    max_extra = index.token_ids.numel() // seg  # sum_r floor((c_r - 1) / seg) <= entries / seg
    extra_row, _ = worklist.row_items(extra_ptr, max(max_extra, 1), with_sub=False)  # never empty: no null pointers
    return {"block_start": index.block_start, "block_len": index.block_len, "extra_ptr": extra_ptr,
            "extra_row": extra_row, "max_extra": max_extra, "seg": seg, "num_rows": num_rows,
            "capacity": index.block_capacity}


def _bwd_dkdv(q, k, v, do, lse, delta, token_ids, row_ptr, plan, block_size, scale, prefetch=True):
    """(dk, dv) [total, h_kv, d] from the KV-outer kernel over the segments of ``plan``; total > 0."""
    meta = _kernel_meta(q, k, block_size)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    max_extra, num_rows, capacity = plan["max_extra"], plan["num_rows"], plan["capacity"]
    common = (plan["extra_ptr"], plan["extra_row"], plan["block_start"], plan["block_len"])
    # fp32 partials; one unused tile when max_extra = 0 (same kernel signature, no null pointer).
    buf_dk = scratch.empty((max(2 * max_extra, 1), block_size, k.shape[2]), torch.float32, q.device)
    buf_dv = scratch.empty(buf_dk.shape, buf_dk.dtype, q.device)
    _bwd_dkdv_kernel[lambda launch: ((max_extra + num_rows) * (block_size // launch["BLOCK_N"]),)](
        q, k, v, do, lse, delta, dk, dv, token_ids, row_ptr, *common, buf_dk, buf_dv,
        scale, scale * LOG2E, capacity, num_rows, max_extra, SEG=plan["seg"], PREFETCH=prefetch,
        **meta, **_launch_defaults(meta, block_size, kv_outer=True),
    )  # fmt: skip
    if max_extra > 0:
        merge_n = 16  # block_size >= 16
        _bwd_dkdv_merge_kernel[(max_extra, block_size // merge_n)](
            dk, dv, *common, buf_dk, buf_dv, scale, capacity, num_rows, max_extra, H_KV=meta["H_KV"], D=meta["D"],
            BLOCK_SIZE=block_size, BLOCK_D=meta["BLOCK_D"], MERGE_N=merge_n, num_warps=4,
        )  # fmt: skip
    return dk, dv


def _backward(q, k, v, o, lse, do, dlse, block_idx, tok_start, block_size, scale, index):
    if q.shape[0] == 0:
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dq, delta = _bwd_dq(q, k, v, o, lse, do, dlse, block_idx, tok_start, block_size, scale)
    plan = _dkdv_plan(index, q.shape[1] // k.shape[1])
    dk, dv = _bwd_dkdv(q, k, v, do, lse, delta, index.token_ids, index.row_ptr, plan, block_size, scale)
    return dq, dk, dv


def forward_pass(q, k, v, block_idx, cu_seqlens, block_size, scale, index):
    """(o, lse) of the query-outer kernel, no autograd; contiguous inputs, float ``scale``.
    ``index`` is unused (the forward needs no index lists): the signature is the one
    ``dispatch`` composes across impls."""
    o, lse, _ = _forward(q, k, v, block_idx, cu_seqlens, block_size, scale)
    return o, lse


def backward_pass(q, k, v, o, lse, do, dlse, block_idx, cu_seqlens, block_size, scale, index):
    """(dq, dk, dv) of the query-outer kernels for any forward's (o, lse); ``index`` is
    ``build_selection_index(block_idx, cu_seqlens, block_size)``; dlse [total, h] fp32 or None."""
    tok_start = token_starts(cu_seqlens, q.shape[0])
    return _backward(q, k, v, o, lse, do, dlse, block_idx, tok_start, block_size, scale, index)


def _backward_on(do, dlse, q, k, v, o, lse, block_idx, cu_seqlens, tok_start, block_size, scale, index):
    """(dq, dk, dv) on the index lists ``index`` (``SelectionIndex.tensors()``), or on lists built
    here where it is empty (the forward needs none)."""
    key = ("nsa.backward", *scratch.shapes(q, k, block_idx, cu_seqlens), dlse is None, block_size, bool(index))
    with scratch.planned(key, q.device):
        if not index:
            index = build_selection_index(block_idx, cu_seqlens, block_size, in_scratch=True)
        else:
            index = SelectionIndex.from_tensors(index)
        return _backward(q, k, v, o, lse, do, dlse, block_idx, tok_start, block_size, scale, index)


class _SelectedAttentionNSA(torch.autograd.Function):
    """(q, k, v, block_idx, cu_seqlens, block_size, scale, index) -> (o, lse), index
    ``SelectionIndex.tensors()`` or [] (built by the backward). Its ``setup`` and ``backward`` are also the autograd of
    the op ``fsalab::selected_attention_nsa`` below, which torch.compile sees in its place and
    which returns the token starts as well."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward(*inputs[:-1])
        _SelectedAttentionNSA.setup(ctx, inputs, output)
        return output[:2]

    @staticmethod
    def setup(ctx, inputs, output):
        q, k, v, block_idx, cu_seqlens, block_size, scale, index = inputs
        ctx.save_for_backward(q, k, v, *output, block_idx, cu_seqlens, *index)
        ctx.block_size, ctx.scale = block_size, scale
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, do, dlse, *_):  # _: the op's token starts' gradient (None)
        q, k, v, o, lse, tok_start, block_idx, cu_seqlens, *index = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = op_or("selected_attention_nsa_backward", _backward_on, do)(
            do.contiguous(), None if dlse is None else dlse.contiguous(), q, k, v, o, lse, block_idx, cu_seqlens,
            tok_start, ctx.block_size, ctx.scale, index,
        )  # fmt: skip
        # The op's list argument takes a list of gradients (its needs_input_grad entry is a list);
        # the Function's argument, None.
        index_grad = [None] * len(index) if isinstance(ctx.needs_input_grad[7], (list, tuple)) else None
        return dq, dk, dv, None, None, None, None, index_grad


# torch.compile's view of the kernels (ops/library.py): opaque ops with fake kernels.
@torch.library.custom_op("fsalab::selected_attention_nsa", mutates_args=())
def _selected_attention_nsa_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, cu_seqlens: torch.Tensor,
    block_size: int, scale: float, index: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, lse, token starts int32 [total])."""
    return _forward(q, k, v, block_idx, cu_seqlens, block_size, scale)


@_selected_attention_nsa_op.register_fake
def _(q, k, v, block_idx, cu_seqlens, block_size, scale, index):
    return q.new_empty(q.shape), lse_like(q), q.new_empty(q.shape[0], dtype=torch.int32)


@torch.library.custom_op("fsalab::selected_attention_nsa_backward", mutates_args=())
def _selected_attention_nsa_backward_op(
    do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, block_idx: torch.Tensor, cu_seqlens: torch.Tensor, tok_start: torch.Tensor, block_size: int,
    scale: float, index: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_on(do, dlse, q, k, v, o, lse, block_idx, cu_seqlens, tok_start, block_size, scale, index)


@_selected_attention_nsa_backward_op.register_fake
def _(do, dlse, q, k, v, o, lse, block_idx, cu_seqlens, tok_start, block_size, scale, index):
    return grads_like(q, k, v)


_selected_attention_nsa_op.register_autograd(_SelectedAttentionNSA.backward, setup_context=_SelectedAttentionNSA.setup)


def selected_attention_nsa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    index: SelectionIndex | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected attention with NSA's query-outer kernel; differentiable in q, k, v.

    q [total, h, d], k/v [total, h_kv, d] (fp16/bf16/fp32, d <= 256, h / h_kv <= 16),
    block_idx int32 [total, h_kv, topk], cu_seqlens int32 [batch + 1], block_size a power of two
    >= 16. ``index`` is an already built ``build_selection_index(block_idx, cu_seqlens,
    block_size)`` to reuse in backward (built there otherwise). Inputs are validated by
    ``selected.selected_attention``. Returns o [total, h, d] in q.dtype and lse [total, h] fp32.
    """
    check_kernel_call(q.device, block_size, "the NSA kernels")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    q, k, v, block_idx, cu_seqlens = (t.contiguous() for t in (q, k, v, block_idx, cu_seqlens))
    o, lse = op_or("selected_attention_nsa", _SelectedAttentionNSA.apply)(
        q, k, v, block_idx, cu_seqlens, block_size, scale, [] if index is None else index.tensors())[:2]
    return o, lse
