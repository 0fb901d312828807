"""NSA decode step in Triton (DESIGN §9): one new token per sequence over an ``NSADecodeCache``.

The fp32 reference is ``reference.py`` beside it (same function names and signatures).

A step is seven launches with static grids (a fixed batch and capacity give the same launches
whatever the lengths, which live on device: CUDA-graph capturable, no host sync). Two do the
step's bookkeeping (``append_token``):

a. ``_append_kernel`` (batch): RoPE of the new token's q (every head) and k at position
   n = lengths[b], k and v appended to the raw cache, k before RoPE to the ring of recent keys,
   lengths[b] advanced. One program per sequence: the only one that reads or writes lengths[b]
   (programs of one grid are unordered, so a length read by several could be read advanced).
b. ``_compress_step_kernel`` (batch, 2·h_kv, d/2 tiles): where the new length completes a
   compressed token, its key or value (each program both halves of its columns, which RoPE
   pairs), the key rotated at its window's first token, stored at k_cmp / v_cmp row j; the
   other sequences' programs exit at once.

RoPE in both: cos/sin of position · inv_freq (fp32 angles, HF's product), times HF's
``attention_scaling``, through libdevice's ``cosf`` / ``sinf`` (full range reduction: angles
reach 10^5 rad at long contexts), applied in fp32 and rounded once to the cache dtype. HF
rounds cos/sin to the activation dtype before applying them, so the two differ by about one
rounding of the dtype (bf16: ~2^-8 relative); tests/test_decode.py bounds it.

The attention is five:

1. ``_cmp_partial_kernel`` (batch, h_kv, S_c): compressed attention, the g query heads of a KV
   head as the MMA's rows; sequence b's n_cmp compressed tokens are cut into S_c ranges
   (FlashDecoding's split), each program writing (o, lse) of its range and, for every token of
   it, the fp32 logits s = q·k_cmp·scale·log2(e) its softmax takes to the cache's
   ``cmp_logits`` [batch, h, capacity // s] (the ranges cover [0, n_cmp): every logit of the
   step is rewritten).
2. ``_score_kernel`` (batch, h_kv, S_s): block scores from those logits, not from the keys (the
   compressed keys are read once per step, by step 1): p = exp2(s − lse_cmp) summed over the
   group's heads in fp32 (lse_cmp merged from step 1's partials), mapped onto blocks with the
   overlap weights, forced / causal rules of prefill; each program keeps the top-T of its range
   of blocks (``select_common.merge_topk``). Step 1 stores a [g, BLOCK_N] tile of logits per
   iteration (64 tokens), step 2 loads [g, BB·R] tiles: both run along rows of ``cmp_logits``,
   whose tokens are contiguous.
3. ``_topk_kernel`` (batch · h_kv): merges the S_s partial top-T lists into block_idx
   [batch, h_kv, T] (ascending, -1 padding; ties to the lower block, as in prefill).
4. ``_sw_partial_kernel`` (batch, h_kv, T + S_w): one program per selected block (causal: keys
   < n) and per range of the window (keys [n − w, n)), each writing (o, lse).
5. ``_combine_kernel`` (batch · h): log-sum-exp merge of each branch's partials and the gated
   sum, rounded once to q's dtype.

Extra memory: the cache holds the step's one context-sized buffer, ``cmp_logits`` (fp32,
h·capacity/s·4 bytes per sequence, allocated with the cache: a fraction g/(s·d) of the raw
cache's 2·h_kv·d·2 bytes per token in bf16, 0.05 % at g = 1, 0.8 % at g = 16 with s = 16,
d = 128; 4 MiB at h = 64 and a capacity of 256K tokens). A step's own temporaries: the partials,
fp32 [batch, h, S_c + T + S_w, d + 1], the score keys int32 [batch, h_kv, S_s, T_P] and
block_idx: O(batch · h · d) for the fixed split counts (``decode_splits``: at most 128 + T + 8
partials per head, 4.8 MiB at batch 1, 64 heads, d = 128, T = 16), whatever the context length.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ...checks import KERNEL_DTYPES, MAX_GROUP, check_kernel_call, check_tensor
from ...config import NSAConfig
from .._triton import INTERPRET, LN2_C, LOG2E, LOG2E_C, cdiv, dot_precision, next_pow2, unit_last_stride
from ..library import op_or
from ..topk.select_common import KEY_NONE, block_key, empty_run, forced_score, key_bits, merge_topk, store_ascending
from .cache import NSADecodeCache

# Split counts, when the batch cannot fill the GPU: about 8 programs per SM (2, 4, 8 and 16
# timed; docs/performance.md, "Decode"); compressed-attention ranges of at least 128 tokens (two
# 64-key tiles: 64-token ranges lost at 64K, g = 4); window ranges of at least 64 keys.
_PROGRAMS_PER_SM = 8
_MIN_CMP_RANGE = 128
_MIN_WINDOW_RANGE = 64
_MAX_SPLITS = 128


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _score_tile(cfg) -> tuple[int, int]:
    """(T_P, BB): the top-T run width (a power of two >= 2) and the blocks of one score tile (a
    power of two >= T_P whose BB·R compressed tokens fill an MMA of >= 16 columns)."""
    t_pad = max(2, next_pow2(cfg.topk))
    r = cfg.block_size // cfg.kernel_stride
    return t_pad, max(t_pad, next_pow2(cdiv(16, r)), 4)


def decode_splits(batch: int, h_kv: int, capacity: int, cfg, device: torch.device) -> tuple[int, int, int]:
    """(S_c, S_s, S_w): ranges per (sequence, KV head) of the compressed-attention, score and
    window programs. Chosen from the batch and capacity only (static grids): about
    ``_PROGRAMS_PER_SM`` programs per SM when the batch cannot fill the GPU, compressed ranges of
    at least ``_MIN_CMP_RANGE`` tokens at capacity, S_c and S_s <= ``_MAX_SPLITS``, S_w <= 8.
    Under the interpreter, small counts that still cut tiny caches into several ranges."""
    rows = max(1, capacity // cfg.kernel_stride)
    _, bb = _score_tile(cfg)
    if INTERPRET or device.type != "cuda":
        return min(3, rows), min(2, cfg.num_blocks(capacity)), min(2, cfg.window_size)
    per_head = cdiv(_PROGRAMS_PER_SM * _sm_count(device.index or 0), batch * h_kv)
    s_c = max(1, min(per_head, cdiv(rows, _MIN_CMP_RANGE), _MAX_SPLITS))
    s_s = max(1, min(per_head, cdiv(cfg.num_blocks(capacity), bb - 1), _MAX_SPLITS))
    s_w = max(1, min(cdiv(min(cfg.window_size, capacity), _MIN_WINDOW_RANGE), 8))
    return s_c, s_s, s_w


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _group_q(q_ptr, b, kvh, s_qb, s_qh, G: tl.constexpr, G_PAD: tl.constexpr, dd, d_ok):
    """The g query heads of KV head kvh as G_PAD rows (rows >= g are zero), and their row mask."""
    gg = tl.arange(0, G_PAD)
    g_ok = gg < G
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + (kvh * G + gg)[:, None] * s_qh + dd[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    return q, gg, g_ok


@triton.jit
def _attend_range(q, k_ptr, v_ptr, s_t, lo, hi, qk_scale, dd, d_ok, logit_rows, g_ok,
                  G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                  STORE_LOGITS: tl.constexpr):
    """Online softmax (exp2) of q [G_PAD, D_PAD] over keys [lo, hi) at k_ptr + t * s_t (v alike).
    Returns (acc, m, l): unnormalised output, row max (log2 units), row sum; l = 0 when empty.
    With STORE_LOGITS, each key's fp32 logit q·k·qk_scale (the softmax's input) also goes to
    logit_rows[row] + t (pointers [G_PAD]) for the rows where g_ok."""
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([G_PAD], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        ok = t < hi
        off = t.to(tl.int64)[:, None] * s_t + dd[None, :]
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + off, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        if STORE_LOGITS:
            tl.store(logit_rows[:, None] + t[None, :], s, mask=g_ok[:, None] & ok[None, :])
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile holds a key
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + off, mask=kv_ok, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m = m_new
    return acc, m, l


@triton.jit
def _store_partial(o_ptr, lse_ptr, acc, m, l, part, dd, g_ok, d_ok, HEAD_DIM: tl.constexpr):
    """Normalised partial output (fp32) and its lse (natural log, -inf when empty) at partial index
    ``part`` [G_PAD] (row-major over [rows, splits])."""
    has = l > 0
    l_safe = tl.where(has, l, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has, (m + tl.log2(l_safe)) * LN2_C, float("-inf"))
    tl.store(o_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + dd[None, :], o, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + part, lse, mask=g_ok)


@triton.jit
def _range_partial(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, logit_ptr, b, kvh, sp, lo, hi, s_qb, s_qh, s_kb, s_kt, s_kh,
                   s_lb, s_lh, n_heads, n_parts, qk_scale, G: tl.constexpr, G_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                   STORE_LOGITS: tl.constexpr):
    """Partial sp (of n_parts per head) of the g query heads of (sequence b, KV head kvh): attention
    over keys [lo, hi) at k_ptr + b * s_kb + t * s_kt + kvh * s_kh (values alike). With
    STORE_LOGITS, key t's logits of query head h go to logit_ptr + b * s_lb + h * s_lh + t."""
    dd = tl.arange(0, D_PAD)
    d_ok = dd < HEAD_DIM
    q, gg, g_ok = _group_q(q_ptr, b, kvh, s_qb, s_qh, G, G_PAD, dd, d_ok)
    base = b.to(tl.int64) * s_kb + kvh * s_kh
    logit_rows = logit_ptr + b.to(tl.int64) * s_lb + (kvh * G + gg).to(tl.int64) * s_lh
    acc, m, l = _attend_range(q, k_ptr + base, v_ptr + base, s_kt, lo, hi, qk_scale, dd, d_ok, logit_rows, g_ok,
                              G_PAD, D_PAD, BLOCK_N, DOT_PREC, STORE_LOGITS)
    part = (b * n_heads + kvh * G + gg) * n_parts + sp
    _store_partial(o_ptr, lse_ptr, acc, m, l, part, dd, g_ok, d_ok, HEAD_DIM)


@triton.jit
def _n_cmp(n, L: tl.constexpr, S: tl.constexpr):
    """Compressed tokens of a sequence of n tokens: floor((n - l) / s) + 1, 0 when n < l."""
    return tl.where(n >= L, (tl.maximum(n, L) - L) // S + 1, 0)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _rope_factors(freq_ptr, pos, scaling, cc, c_ok):
    """(cos, sin) fp32 of angle pos · inv_freq[cc], times HF's ``attention_scaling``: the
    rotation of one position, one value per frequency cc of the half head dim."""
    angle = pos.to(tl.float32) * tl.load(freq_ptr + cc, mask=c_ok, other=0.0)
    return tl.cos(angle) * scaling, tl.sin(angle) * scaling


@triton.jit
def _rotate_rows(src, dst, rows, row_ok, s_src, s_dst, cos, sin, cc, c_ok, HALF: tl.constexpr):
    """RoPE (rotate-half convention) of rows [R] of head-dim vectors, fp32, rounded once to dst's
    dtype: dst[r] = (x1·cos − x2·sin, x2·cos + x1·sin) for the halves x1, x2 of src[r]."""
    ok = row_ok[:, None] & c_ok[None, :]
    at = src + rows[:, None] * s_src + cc[None, :]
    x1 = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=ok, other=0.0).to(tl.float32)
    out = dst + rows[:, None] * s_dst + cc[None, :]
    tl.store(out, (x1 * cos[None, :] - x2 * sin[None, :]).to(dst.dtype.element_ty), mask=ok)
    tl.store(out + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _append_kernel(
    q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, kr_ptr, len_ptr, freq_ptr, scaling,
    s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_ob, s_oh, s_cb, s_ct, s_ch, s_rb, s_rt, s_rh, capacity,
    H: tl.constexpr, H_KV: tl.constexpr, H_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, L: tl.constexpr,
):
    """Sequence b's new token at position n = lengths[b]: q rotated to qo; k rotated to the raw
    cache's row n, v beside it, k un-rotated to ring slot n % l; lengths[b] = n + 1. One program
    per sequence, the only one reading or writing lengths[b]. A full sequence (value checks off)
    writes to the scratch row and slot and keeps its length. The cache's k and v share strides
    (allocated alike, as the attention kernels assume)."""
    b = tl.program_id(0)
    n = tl.load(len_ptr + b)
    full = n >= capacity
    at = tl.where(full, capacity, n).to(tl.int64)
    slot = tl.where(full, L, n % L)
    cc = tl.arange(0, HALF_PAD)
    c_ok = cc < HALF
    cos, sin = _rope_factors(freq_ptr, n, scaling, cc, c_ok)
    hq = tl.arange(0, H_PAD)
    _rotate_rows(q_ptr + b.to(tl.int64) * s_qb, qo_ptr + b.to(tl.int64) * s_ob, hq, hq < H, s_qh, s_oh,
                 cos, sin, cc, c_ok, HALF)
    hk = tl.arange(0, HKV_PAD)
    hk_ok = hk < H_KV
    k_in = k_ptr + b.to(tl.int64) * s_kb
    row = b.to(tl.int64) * s_cb + at * s_ct
    _rotate_rows(k_in, kc_ptr + row, hk, hk_ok, s_kh, s_ch, cos, sin, cc, c_ok, HALF)
    dd = tl.arange(0, 2 * HALF_PAD)
    ok = hk_ok[:, None] & (dd < 2 * HALF)[None, :]
    k_plain = tl.load(k_in + hk[:, None] * s_kh + dd[None, :], mask=ok)
    tl.store(kr_ptr + b.to(tl.int64) * s_rb + slot * s_rt + hk[:, None] * s_rh + dd[None, :], k_plain, mask=ok)
    v = tl.load(v_ptr + b.to(tl.int64) * s_vb + hk[:, None] * s_vh + dd[None, :], mask=ok)
    tl.store(vc_ptr + row + hk[:, None] * s_ch + dd[None, :], v, mask=ok)
    tl.store(len_ptr + b, tl.where(full, n, n + 1))


@triton.jit
def _compress_step_kernel(
    kr_ptr, v_ptr, len_ptr, wk_ptr, wv_ptr, pe_ptr, freq_ptr, scaling, kc_ptr, vc_ptr,
    s_rb, s_rt, s_rh, s_vb, s_vt, s_vh, s_wh, s_wx, s_ph, s_cb, s_ct, s_ch,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, L: tl.constexpr, S: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """For the sequences whose length n completes compressed token j = (n − l)/s: its columns
    [n0, n0 + BLOCK_N) and the same columns of the second half, flatten(x[n−l:n] (+ pe)) @ w[h]
    (NSA Eq. 7); the key rounded to the cache dtype, rotated at its window's first token n − l
    and stored at k_cmp[b, j, h], the value at v_cmp[b, j, h]. The other sequences' programs exit
    at once (no weight is read). A program computes both halves: RoPE pairs column c with c + d/2."""
    b = tl.program_id(0)
    h = tl.program_id(1) // 2
    is_v = tl.program_id(1) % 2
    n = tl.load(len_ptr + b)
    if (n >= L) & ((n - L) % S == 0):
        nn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = nn < HALF
        kk = tl.arange(0, BLOCK_K)
        acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        for x0 in range(0, L * HEAD_DIM, BLOCK_K):
            xx = x0 + kk
            x_ok = xx < L * HEAD_DIM
            i = xx // HEAD_DIM
            c = xx % HEAD_DIM
            t = n - L + i  # raw position in the window
            if is_v == 1:
                x = tl.load(v_ptr + b.to(tl.int64) * s_vb + t.to(tl.int64) * s_vt + h * s_vh + c, mask=x_ok, other=0.0)
                w_ptr = wv_ptr
            else:
                x = tl.load(kr_ptr + b.to(tl.int64) * s_rb + (t % L) * s_rt + h * s_rh + c, mask=x_ok, other=0.0)
                pe = tl.load(pe_ptr + h * s_ph + xx, mask=x_ok, other=0.0)
                # k + pe rounds once to the cache dtype, as prefill's compression does.
                x = (x.to(tl.float32) + pe.to(tl.float32)).to(kr_ptr.dtype.element_ty)
                w_ptr = wk_ptr
            w_at = w_ptr + h * s_wh + xx[:, None] * s_wx + nn[None, :]
            w_ok = x_ok[:, None] & n_ok[None, :]
            # The weights round to the cache dtype, as prefill's compression casts them.
            w1 = tl.load(w_at, mask=w_ok, other=0.0).to(kr_ptr.dtype.element_ty).to(tl.float32)
            w2 = tl.load(w_at + HALF, mask=w_ok, other=0.0).to(kr_ptr.dtype.element_ty).to(tl.float32)
            x = x.to(tl.float32)[:, None]
            acc1 += tl.sum(x * w1, axis=0)
            acc2 += tl.sum(x * w2, axis=0)
        out = b.to(tl.int64) * s_cb + ((n - L) // S).to(tl.int64) * s_ct + h * s_ch + nn
        if is_v == 1:
            tl.store(vc_ptr + out, acc1.to(vc_ptr.dtype.element_ty), mask=n_ok)
            tl.store(vc_ptr + out + HALF, acc2.to(vc_ptr.dtype.element_ty), mask=n_ok)
        else:
            # The key rounds to the cache dtype before its rotation, as prefill's compressed keys do.
            x1 = acc1.to(kc_ptr.dtype.element_ty).to(tl.float32)
            x2 = acc2.to(kc_ptr.dtype.element_ty).to(tl.float32)
            cos, sin = _rope_factors(freq_ptr, n - L, scaling, nn, n_ok)
            tl.store(kc_ptr + out, (x1 * cos - x2 * sin).to(kc_ptr.dtype.element_ty), mask=n_ok)
            tl.store(kc_ptr + out + HALF, (x2 * cos + x1 * sin).to(kc_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _cmp_partial_kernel(
    q_ptr, kc_ptr, vc_ptr, len_ptr, o_ptr, lse_ptr, logit_ptr,
    s_qb, s_qh, s_cb, s_ct, s_ch, s_lb, s_lh, n_heads, n_splits, qk_scale,
    G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    L: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Range sp of sequence b's n_cmp compressed tokens for the g query heads of KV head kvh:
    (o, lse) partial sp, and every token's logits in the range to the cache's ``cmp_logits``
    (the S_c ranges cover [0, n_cmp): every logit the score kernel reads is this step's)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    n_cmp = _n_cmp(tl.load(len_ptr + b), L, S)
    chunk = tl.cdiv(n_cmp, n_splits)
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, n_cmp)
    _range_partial(q_ptr, kc_ptr, vc_ptr, o_ptr, lse_ptr, logit_ptr, b, kvh, sp, lo, hi, s_qb, s_qh,
                   s_cb, s_ct, s_ch, s_lb, s_lh, n_heads, n_splits, qk_scale, G, G_PAD, HEAD_DIM, D_PAD, BLOCK_N,
                   DOT_PREC, True)


@triton.jit
def _score_kernel(
    logit_ptr, len_ptr, lse_c_ptr, keys_ptr,
    s_lb, s_lh, n_heads, n_kv_heads, n_splits_c, n_splits,
    G: tl.constexpr, G_PAD: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BS: tl.constexpr,
    T_P: tl.constexpr, BB: tl.constexpr, SC_PAD: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
):
    """Range sp of sequence b's blocks for KV head kvh: block scores from the compressed logits
    ``_cmp_partial_kernel`` stored (log2 units) and the merged lse_cmp, p = exp2(s − lse) summed
    over the group's g heads in fp32, mapped onto blocks by the overlap weights; the range's top-T
    as ``block_key`` int32 keys (the ranking prefill's selection uses) at keys_ptr row (b, kvh, sp)."""
    R: tl.constexpr = BS // S  # compressed tokens starting in one block
    JT: tl.constexpr = BB * R  # compressed tokens of one tile: blocks b0 - 1 .. b0 + BB - 2 start there
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(len_ptr + b)
    n_cmp = _n_cmp(n, L, S)
    own = (n - 1) // BS
    gg = tl.arange(0, G_PAD)
    g_ok = gg < G
    # lse_cmp of the group's heads, merged from the compressed-attention partials (log2 units).
    ss = tl.arange(0, SC_PAD)
    rows = b * n_heads + kvh * G + gg
    lp = tl.load(lse_c_ptr + (rows * n_splits_c)[:, None] + ss[None, :],
                 mask=g_ok[:, None] & (ss < n_splits_c)[None, :], other=float("-inf")) * LOG2E_C
    mx = tl.max(lp, 1)
    mx_s = tl.where(mx == float("-inf"), 0.0, mx)
    tot = tl.sum(tl.exp2(lp - mx_s[:, None]), 1)
    live = g_ok & (tot > 0)
    lse2 = tl.where(live, mx_s + tl.log2(tl.where(live, tot, 1.0)), 0.0)

    n_blocks = own + 1
    per = tl.cdiv(n_blocks, n_splits)
    blo = sp * per
    bhi = tl.minimum(blo + per, n_blocks)
    col = tl.arange(0, T_P)
    run = empty_run(1, T_P)
    kb = key_bits(own)
    jo = tl.arange(0, JT)
    bb = tl.arange(0, BB)
    logit_rows = logit_ptr + b.to(tl.int64) * s_lb + (kvh * G + gg).to(tl.int64) * s_lh
    # Tiles of BB - 1 complete blocks: tile tokens [b0·R - R, b0·R - R + JT) hold every compressed
    # token overlapping blocks b0 .. b0 + BB - 2 (a window spills at most into the next block).
    for b0 in range(blo, bhi, BB - 1):
        jj = b0 * R - R + jo
        j_ok = (jj >= 0) & (jj < n_cmp)
        # Masked logits load as -inf: p = exp2(-inf - lse2) = 0 (lse2 is finite on every row).
        s = tl.load(logit_rows[:, None] + jj[None, :], mask=live[:, None] & j_ok[None, :], other=float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        ps = tl.sum(p, 0)  # [JT], fp32 sum over the group's heads
        blk = b0 + bb
        lo_t = tl.maximum(jj[:, None] * S, blk[None, :] * BS)
        hi_t = tl.minimum(jj[:, None] * S + L, blk[None, :] * BS + BS)
        w = (tl.maximum(hi_t - lo_t, 0) // S).to(tl.float32)  # [JT, BB] overlap in strides
        score = tl.sum(ps[:, None] * w, 0)
        score = forced_score(score, blk, own, INIT, LOCAL)
        key = tl.where((blk < bhi) & (bb < BB - 1), block_key(score, blk, kb), KEY_NONE)
        run = merge_topk(run, key[None, :], T_P)
    out = keys_ptr + ((b * n_kv_heads + kvh) * n_splits + sp).to(tl.int64) * T_P
    tl.store(out + col[None, :], run)


@triton.jit
def _topk_kernel(keys_ptr, len_ptr, idx_ptr, n_kv_heads, n_splits, BS: tl.constexpr, T_P: tl.constexpr,
                 TOPK: tl.constexpr, NK: tl.constexpr):
    """block_idx row (b, kvh): the top-T of its S_s partial runs, ascending, -1 padding."""
    pid = tl.program_id(0)
    kb = key_bits((tl.load(len_ptr + pid // n_kv_heads) - 1) // BS)
    i = tl.arange(0, NK)
    cand = tl.load(keys_ptr + pid.to(tl.int64) * n_splits * T_P + i, mask=i < n_splits * T_P, other=KEY_NONE)
    run = merge_topk(empty_run(1, T_P), cand[None, :], T_P)
    store_ascending(idx_ptr + pid.to(tl.int64) * TOPK + tl.zeros([1, 1], dtype=tl.int64), run, kb,
                     tl.full([1, 1], 1, dtype=tl.int1), TOPK, T_P)


@triton.jit
def _sw_partial_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, idx_ptr, o_ptr, lse_ptr,
    s_qb, s_qh, s_kb, s_kt, s_kh, n_heads, n_kv_heads, n_splits_w, qk_scale,
    G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BS: tl.constexpr, TOPK: tl.constexpr, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Program sp < T: selected block sp (keys < n); sp >= T: range sp - T of the window [n - w, n)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(len_ptr + b)
    blk = tl.load(idx_ptr + (b * n_kv_heads + kvh) * TOPK + tl.minimum(sp, TOPK - 1))
    sel_lo = tl.maximum(blk, 0) * BS
    sel_hi = tl.where(blk >= 0, tl.minimum(sel_lo + BS, n), sel_lo)
    w_lo = tl.maximum(n - WINDOW, 0)
    per = tl.cdiv(n - w_lo, n_splits_w)
    win_lo = w_lo + (sp - TOPK) * per
    win_hi = tl.minimum(win_lo + per, n)
    is_sel = sp < TOPK
    lo = tl.where(is_sel, sel_lo, win_lo)
    hi = tl.where(is_sel, sel_hi, win_hi)
    # No logits stored here (STORE_LOGITS off: the logit pointer and strides are placeholders).
    _range_partial(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, o_ptr, b, kvh, sp, lo, hi, s_qb, s_qh, s_kb, s_kt, s_kh,
                   0, 0, n_heads, TOPK + n_splits_w, qk_scale, G, G_PAD, HEAD_DIM, D_PAD, BLOCK_N, DOT_PREC, False)


@triton.jit
def _combine_kernel(
    oc_ptr, lc_ptr, osw_ptr, lsw_ptr, g_ptr, out_ptr, n_splits_c, n_sw,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, TOPK: tl.constexpr,
    SC_PAD: tl.constexpr, T_PAD: tl.constexpr, SW_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * h + head
    dd = tl.arange(0, D_PAD)
    d_ok = dd < HEAD_DIM
    o = tl.sigmoid(tl.load(g_ptr + row * 3).to(tl.float32)) * _merged(
        oc_ptr + row * n_splits_c * HEAD_DIM, lc_ptr + row * n_splits_c, 0, n_splits_c, dd, d_ok, HEAD_DIM, SC_PAD)
    sw_o = osw_ptr + row * n_sw * HEAD_DIM
    sw_l = lsw_ptr + row * n_sw
    o += tl.sigmoid(tl.load(g_ptr + row * 3 + 1).to(tl.float32)) * _merged(sw_o, sw_l, 0, TOPK, dd, d_ok, HEAD_DIM, T_PAD)
    o += tl.sigmoid(tl.load(g_ptr + row * 3 + 2).to(tl.float32)) * _merged(sw_o, sw_l, TOPK, n_sw, dd, d_ok, HEAD_DIM, SW_PAD)
    tl.store(out_ptr + row * HEAD_DIM + dd, o.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _merged(o_ptr, lse_ptr, lo, hi, dd, d_ok, HEAD_DIM: tl.constexpr, S_PAD: tl.constexpr):
    """Log-sum-exp merge of one row's partials [lo, hi): o [D_PAD] fp32, 0 when all are empty."""
    ss = lo + tl.arange(0, S_PAD)
    ok = ss < hi
    lse = tl.load(lse_ptr + ss, mask=ok, other=float("-inf"))
    mx = tl.max(lse, 0)
    w = tl.exp(lse - tl.where(mx == float("-inf"), 0.0, mx))
    tot = tl.sum(w, 0)
    o = tl.load(o_ptr + ss.to(tl.int64)[:, None] * HEAD_DIM + dd[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    return tl.sum(w[:, None] * o, 0) / tl.where(tot > 0, tot, 1.0)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def append_token(
    cache: NSADecodeCache,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    pe: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
) -> torch.Tensor:
    """A decode step's bookkeeping in two launches; returns q rotated, [batch, h, d].

    Sequence b's new token sits at position n = lengths[b]: q [batch, h, d] and k [batch, h_kv, d]
    (projected, before RoPE) are rotated there, k and v appended to the raw cache, k before RoPE
    to the ring of recent keys, lengths advanced (``_append_kernel``, one program per sequence);
    then, where n + 1 completes a compressed token, the token (NSA Eq. 7 with w_k, w_v
    [h_kv, l*d, d] and pe [h_kv, l, d]) is computed, its key rotated at its window's first token,
    and both stored (``_compress_step_kernel``). RoPE: cos/sin of position · inv_freq (float32
    [d/2], HF's ``rotary_emb.inv_freq``) in fp32, times ``attention_scaling``, applied in fp32
    and rounded once (HF rounds cos/sin to the activation dtype first: the two differ by the
    dtype's rounding). Semantics: ``reference.append_token``. Call ``cache.check_step``
    first (the module's decode does).
    """
    check_kernel_call(cache.device, cache.cfg.block_size, "the decode kernels")
    cache.check_token(q, k, v, w_k, w_v, pe, inv_freq)
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    w_k, w_v, pe = w_k.contiguous(), w_v.contiguous(), pe.contiguous()
    return op_or("decode_append", _append)(
        q, k, v, w_k, w_v, pe, inv_freq, float(attention_scaling), cache.k, cache.v, cache.k_recent, cache.lengths,
        cache.k_cmp, cache.v_cmp, cache.cfg.as_ints(),
    )


def _append(q, k, v, w_k, w_v, pe, inv_freq, attention_scaling: float, kc, vc, kr, lengths, k_cmp, v_cmp,
            cfg_ints: list[int]) -> torch.Tensor:
    """``append_token`` on checked inputs and the cache's tensors (kc, vc: k, v; kr: k_recent),
    which it writes; returns q rotated. cfg as ``NSAConfig.as_ints``."""
    cfg = NSAConfig.from_ints(cfg_ints)
    batch, h, d = q.shape
    h_kv, capacity = kc.shape[2], kc.shape[1] - 1
    q_rot = torch.empty((batch, h, d), dtype=q.dtype, device=q.device)
    half = d // 2
    _append_kernel[(batch,)](
        q, k, v, q_rot, kc, vc, kr, lengths, inv_freq, attention_scaling,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_rot.stride(0), q_rot.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), kr.stride(0), kr.stride(1), kr.stride(2), capacity,
        H=h, H_KV=h_kv, H_PAD=next_pow2(h), HKV_PAD=next_pow2(h_kv), HALF=half, HALF_PAD=next_pow2(half),
        L=cfg.kernel_size,
    )
    block_n = min(64, next_pow2(max(half, 16)))
    block_k = 64 if INTERPRET else 128
    _compress_step_kernel[(batch, 2 * h_kv, cdiv(half, block_n))](
        kr, vc, lengths, w_k, w_v, pe, inv_freq, attention_scaling, k_cmp, v_cmp,
        kr.stride(0), kr.stride(1), kr.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        w_k.stride(0), w_k.stride(1), pe.stride(0), k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
        HEAD_DIM=d, HALF=half, L=cfg.kernel_size, S=cfg.kernel_stride, BLOCK_K=block_k, BLOCK_N=block_n,
    )
    return q_rot


def nsa_decode(
    q: torch.Tensor,
    cache: NSADecodeCache,
    gate_logits: torch.Tensor,
    scale: float | None = None,
    splits: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's attention: (o [batch, h, d] in q's dtype, block_idx int32 [batch, h_kv, T]).

    q [batch, h, d] after RoPE, in the cache's dtype and device; gate_logits [batch, h, 3]. The
    new token is already appended (``lengths`` counts it). ``splits`` = (S_c, S_s, S_w) overrides
    ``decode_splits`` (tests). Semantics: ``reference.nsa_decode``.
    """
    cfg = cache.cfg
    check_kernel_call(cache.device, cfg.block_size, "the decode kernels")
    cache.check_q(q)
    batch, h, d = q.shape
    h_kv = cache.num_kv_heads
    g = h // h_kv
    if g > MAX_GROUP:
        raise ValueError(f"GQA group size g = h / h_kv = {g} exceeds {MAX_GROUP}")
    check_tensor("gate_logits", gate_logits, 3, KERNEL_DTYPES, cache.device)
    if tuple(gate_logits.shape) != (batch, h, 3):
        raise ValueError(f"gate_logits must be [batch, h, 3] = {[batch, h, 3]}, got {tuple(gate_logits.shape)}")
    q, gate_logits = q.contiguous(), gate_logits.contiguous()
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    return op_or("nsa_decode", _decode)(
        q, gate_logits, cache.k, cache.v, cache.k_cmp, cache.v_cmp, cache.lengths, cache.cmp_logits, cfg.as_ints(),
        float(scale), list(splits or ()),
    )


def _decode(q, gate_logits, k, v, kc, vc, lens, logits, cfg_ints: list[int], scale: float, splits: list[int]):
    """``nsa_decode`` on checked, contiguous q and gate_logits and the cache's tensors (k, v raw;
    kc, vc compressed; lens: lengths; logits: cmp_logits, written); cfg as ``NSAConfig.as_ints``,
    splits [] for ``decode_splits``."""
    cfg = NSAConfig.from_ints(cfg_ints)
    batch, h, d = q.shape
    h_kv, capacity = k.shape[2], k.shape[1] - 1
    g = h // h_kv
    s_c, s_s, s_w = splits or decode_splits(batch, h_kv, capacity, cfg, q.device)
    topk = cfg.topk
    t_pad, bb = _score_tile(cfg)
    dev, f32 = q.device, torch.float32
    o_c = torch.empty((batch, h, s_c, d), dtype=f32, device=dev)
    lse_c = torch.empty((batch, h, s_c), dtype=f32, device=dev)
    keys = torch.empty((batch, h_kv, s_s, t_pad), dtype=torch.int32, device=dev)
    block_idx = torch.empty((batch, h_kv, topk), dtype=torch.int32, device=dev)
    n_sw = topk + s_w
    o_sw = torch.empty((batch, h, n_sw, d), dtype=f32, device=dev)
    lse_sw = torch.empty((batch, h, n_sw), dtype=f32, device=dev)
    out = torch.empty((batch, h, d), dtype=q.dtype, device=dev)

    shape = {"G": g, "G_PAD": max(16, next_pow2(g)), "HEAD_DIM": d, "D_PAD": max(16, next_pow2(d)),
             "DOT_PREC": dot_precision(q.dtype)}
    block_n = 16 if INTERPRET else 64
    warps = {} if INTERPRET else {"num_warps": 4}
    qk = scale * LOG2E
    _cmp_partial_kernel[(batch, h_kv, s_c)](
        q, kc, vc, lens, o_c, lse_c, logits, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        logits.stride(0), logits.stride(1), h, s_c, qk, L=cfg.kernel_size, S=cfg.kernel_stride, BLOCK_N=block_n,
        **shape, **warps,
    )
    # No MMA here: the group's heads need no padding to 16 rows. One warp: the tiles are [g, BB·R]
    # and the top-T merges a serial chain, which more warps only replicate (docs/performance.md,
    # "Decode").
    _score_kernel[(batch, h_kv, s_s)](
        logits, lens, lse_c, keys, logits.stride(0), logits.stride(1), h, h_kv, s_c, s_s, G=g, G_PAD=next_pow2(g),
        L=cfg.kernel_size, S=cfg.kernel_stride, BS=cfg.block_size, T_P=t_pad, BB=bb, SC_PAD=next_pow2(s_c),
        INIT=cfg.init_blocks, LOCAL=cfg.local_blocks, **({} if INTERPRET else {"num_warps": 1}),
    )
    _topk_kernel[(batch * h_kv,)](keys, lens, block_idx, h_kv, s_s, BS=cfg.block_size, T_P=t_pad, TOPK=topk,
                                  NK=next_pow2(s_s) * t_pad)
    _sw_partial_kernel[(batch, h_kv, n_sw)](
        q, k, v, lens, block_idx, o_sw, lse_sw, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        h, h_kv, s_w, qk, BS=cfg.block_size, TOPK=topk, WINDOW=cfg.window_size, BLOCK_N=block_n, **shape, **warps,
    )
    _combine_kernel[(batch * h,)](
        o_c, lse_c, o_sw, lse_sw, gate_logits, out, s_c, n_sw, HEAD_DIM=d, D_PAD=shape["D_PAD"], TOPK=topk,
        SC_PAD=next_pow2(s_c), T_PAD=next_pow2(topk), SW_PAD=next_pow2(n_sw),
    )
    return out, block_idx


# torch.compile's view of the step (ops/library.py): opaque ops with fake kernels, which write
# the cache's tensors in place (declared in mutates_args).
@torch.library.custom_op("fsalab::decode_append",
                         mutates_args=("cache_k", "cache_v", "k_recent", "lengths", "k_cmp", "v_cmp"))
def _decode_append_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, pe: torch.Tensor,
    inv_freq: torch.Tensor, attention_scaling: float, cache_k: torch.Tensor, cache_v: torch.Tensor,
    k_recent: torch.Tensor, lengths: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, cfg_ints: list[int],
) -> torch.Tensor:
    """q rotated [batch, h, d]."""
    return _append(q, k, v, w_k, w_v, pe, inv_freq, attention_scaling, cache_k, cache_v, k_recent, lengths, k_cmp,
                   v_cmp, cfg_ints)


@_decode_append_op.register_fake
def _(q, k, v, w_k, w_v, pe, inv_freq, attention_scaling, cache_k, cache_v, k_recent, lengths, k_cmp, v_cmp,
      cfg_ints):
    return q.new_empty(q.shape)


@torch.library.custom_op("fsalab::nsa_decode", mutates_args=("cmp_logits",))
def _nsa_decode_op(
    q: torch.Tensor, gate_logits: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cmp: torch.Tensor,
    v_cmp: torch.Tensor, lengths: torch.Tensor, cmp_logits: torch.Tensor, cfg_ints: list[int], scale: float,
    splits: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [batch, h, d], block_idx int32 [batch, h_kv, topk])."""
    return _decode(q, gate_logits, k, v, k_cmp, v_cmp, lengths, cmp_logits, cfg_ints, scale, splits)


@_nsa_decode_op.register_fake
def _(q, gate_logits, k, v, k_cmp, v_cmp, lengths, cmp_logits, cfg_ints, scale, splits):
    topk = NSAConfig.from_ints(cfg_ints).topk
    return q.new_empty(q.shape), q.new_empty((q.shape[0], k.shape[2], topk), dtype=torch.int32)
