"""Generic varlen, GQA FlashAttention-2 kernels (forward with lse; backward dq, dk, dv) in Triton.

One kernel family serves every dense-mask branch of fsalab through a positional mask. Key j of
a sequence sits at position ``p_j = j * key_stride + key_offset`` on the query axis, and query t
(local position) sees key j iff ``t - window < p_j <= t``:

- ``mask="window"``: keys share the queries' positions (stride 1, offset 0); query t sees keys
  (t - w, t]. ``window_size >= sequence length`` is plain causal attention.
- ``mask="compressed"``: keys are compressed tokens (stride s, offset l - 1, no window); query t
  sees compressed j iff t >= j * s + l - 1. Rows that see nothing give o = 0, lse = -inf and zero
  (finite) gradients.

Varlen without host syncs: the grid has ``batch + total // BLOCK`` tiles; sequence b owns the
tiles from ``b + cu_seqlens[b] // BLOCK`` on, which always leaves room for its ceil(n_b / BLOCK)
tiles, so a program finds its (sequence, tile) by a binary search over cu_seqlens and surplus
programs exit. Each program walks only the key (or query) tiles its mask can reach, in two
loops: the masked edge tiles on both sides, then the unmasked interior. Window attention costs
O(N * w).

Backward (bitwise deterministic: no atomics): a row-statistics kernel first (lse / scale
and delta = rowsum(o * do) - dlse, head-major); dq by a query-outer kernel like the forward;
dk/dv by a key-outer kernel that loops over the g query heads of its KV head times the query
tiles that see its key tile, flattened into long loops. When there are too few key tiles to fill
the GPU (compressed keys, short causal batches) the query axis is cut into chunks whose fp32
partials are summed in a fixed order. FA2's alternative, dq added with fp32 atomics inside the
dk/dv kernel (5 products instead of 7), is slower (its fp32 reductions into L2 cost more than the
two products the dq kernel recomputes) and is not offered. Floors, times and the rejected
variants: docs/performance.md, "Shared FlashAttention kernels".

Shapes: q [total_q, h, d], k/v [total_k, h_kv, d] (unit stride on d), cu_seqlens_q/k int32
[batch + 1]; h = g * h_kv with any g in 1..16, any d <= 256 (padded to a power of two and
masked). fp16/bf16/fp32 inputs, fp32 accumulation, exp2 softmax. Returns o [total_q, h, d] in
q.dtype and lse [total_q, h] fp32 (natural log); autograd gives dq, dk, dv (and accepts a
gradient on lse).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..checks import KERNEL_DTYPES, check_attention_inputs, check_scale, check_tensor
from ._triton import (
    INTERPRET,
    LN2_C,
    LOG2E,
    autotune,
    cdiv,
    dot_precision,
    interpreter_meta,
    next_pow2,
    search_steps,
    unit_last_stride,
)
from . import scratch
from .library import grads_like, lse_like, op_or

MASKS = ("window", "compressed")
# Window of masks without one: wider than any sequence, yet window + positions stays in int32.
NO_WINDOW = 1 << 30


# ----------------------------------------------------------------------------------------------
# Launch configurations
# ----------------------------------------------------------------------------------------------


def _cfg(block_m: int, block_n: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


# Only configs that compile for sm_90 (d = 128) without register spills, or with a few bytes
# spilled outside the inner loops (ptxas -v; scripts/ptxas_report.py): a spilling config is slow
# whatever the autotuner measures, and each extra config costs compile time.
# Query-outer kernels (forward, dq): BLOCK_M query rows stay in registers, BLOCK_N keys stream.
# The forward's 128-key tile is the compressed mask's pick (its few, long key rows; the window
# keeps 64-key tiles), 255 registers and no spills.
_FWD_CONFIGS = [_cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3), _cfg(128, 128, 8, 3)]
_DQ_CONFIGS = [_cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3)]
# Key-outer dk/dv kernel: BLOCK_N keys with their fp32 dk, dv accumulators, BLOCK_M queries stream.
_DKDV_CONFIGS = [_cfg(32, 128, 8, 3), _cfg(64, 64, 8, 3), _cfg(32, 64, 4, 3)]
# Tried for d = 256 only: 8 warps hold [64, 256] fp32 accumulators.
_D256_ONLY = [_cfg(64, 64, 8, 2), _cfg(32, 64, 8, 2)]


def _prune(configs, named_args, **kwargs):
    """d = 256 gets its own configs; smaller d never tries them."""
    big = kwargs.get("D_PAD", named_args.get("D_PAD")) >= 256
    return [c for c in configs if any(c is x for x in _D256_ONLY) == big]


def _autotune(configs, restore: tuple[str, ...] = ()):
    """``_triton.autotune`` keyed on padded d, key stride and window (sliding, causal and compressed
    masks tune apart) and a size class (see _size_class), d = 256 pruned to its own configs.
    ``restore``: outputs the kernel may add to (ACCUMULATE), put back after each timed trial."""
    key = ["D_PAD", "key_stride", "window", "size_class"]
    return autotune(configs + _D256_ONLY, key=key, prune=_prune, restore_value=list(restore))


# Runtime ints that vary between calls: not specialized (== 1, % 16), so a new batch size, group
# or window reuses the compiled kernels instead of recompiling every autotune config.
_DYNAMIC = ["batch", "n_search", "group", "key_stride", "key_offset", "window", "size_class"]


def _meta(block_m: int, block_n: int) -> dict:
    """Tile sizes under the interpreter (small, so tiny tests cross many tile edges); autotuned on GPU."""
    return interpreter_meta(BLOCK_M=block_m, BLOCK_N=block_n)


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------
# The per-tile steps inline their masks (fewer nested jit calls for the interpreter to run), and on
# GPU a d-mask `arange(D_PAD) < D` keeps loads vectorized (its constancy is the divisibility of
# D). Steps rebuild their tile pointers from a scalar row: loop-carried [tile, D] tensors of
# 64-bit pointers cost the registers that made the dk/dv kernel spill.


@triton.jit
def _tile_of(pid, cu_ptr, batch, n_search, BLOCK: tl.constexpr):
    """(sequence, its first packed row, its length, tile start) of tile ``pid``.

    Sequence b owns tiles [b + cu[b] // BLOCK, b + 1 + cu[b + 1] // BLOCK): strictly increasing
    starts, found by binary search. The tile start may lie past the sequence end (then skip).
    """
    lo = pid * 0
    hi = lo + batch
    for _ in range(n_search):
        mid = (lo + hi) // 2
        go_right = mid + tl.load(cu_ptr + mid) // BLOCK <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    start = tl.load(cu_ptr + lo)
    length = tl.load(cu_ptr + lo + 1) - start
    return lo, start, length, (pid - lo - start // BLOCK) * BLOCK


@triton.jit
def _tile_ranges(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Cut [lo, hi) into BLOCK-tiles from lo: unmasked tiles [mid_lo, mid_hi) inside [full_lo, full_hi),
    and n_edge masked ones around them, the first n_first from lo (see _edge_start).

    Returns (n_first, n_edge, mid_lo, mid_hi); any range may be empty.
    """
    mid_lo = lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK) * BLOCK
    mid_hi = mid_lo + tl.maximum(tl.minimum(full_hi, hi) - mid_lo, 0) // BLOCK * BLOCK
    n_first = tl.cdiv(tl.maximum(tl.minimum(mid_lo, hi) - lo, 0), BLOCK)
    n_edge = n_first + tl.cdiv(tl.maximum(hi - mid_hi, 0), BLOCK)
    return n_first, n_edge, mid_lo, mid_hi


@triton.jit
def _edge_start(t, lo, n_first, mid_hi, BLOCK: tl.constexpr):
    """Start of masked tile t of _tile_ranges: one loop walks the edges on both sides."""
    return tl.where(t < n_first, lo + t * BLOCK, mid_hi + (t - n_first) * BLOCK)


@triton.jit
def _key_bounds(t, n_k, key_stride, key_offset, window):
    """Keys [lo, hi) seen by query position t (scalar or vector).

    Key j sits at p_j = j * key_stride + key_offset and is seen iff t - window < p_j <= t.
    Numerators are clamped at 0 before dividing (Triton's integer division truncates).
    """
    hi = tl.minimum(n_k, tl.maximum(t - key_offset + key_stride, 0) // key_stride)
    lo = tl.maximum(t - window - key_offset + key_stride, 0) // key_stride
    return lo, hi


@triton.jit
def _key_tiles(m0, n_q, n_k, key_stride, key_offset, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles of query rows [m0, m0 + BLOCK_M): (lo, n_first, n_edge, mid_lo, mid_hi) as in
    _tile_ranges, plus each row's visible keys as (row_lo, row_count) with unsigned counts."""
    rows = m0 + tl.arange(0, BLOCK_M)
    last = tl.minimum(m0 + BLOCK_M, n_q) - 1
    lo, full_hi = _key_bounds(m0, n_k, key_stride, key_offset, window)
    full_lo, hi = _key_bounds(last, n_k, key_stride, key_offset, window)
    n_first, n_edge, mid_lo, mid_hi = _tile_ranges(lo, hi, full_lo, full_hi, BLOCK_N)
    row_lo, row_hi = _key_bounds(rows, n_k, key_stride, key_offset, window)
    return lo, n_first, n_edge, mid_lo, mid_hi, row_lo, tl.maximum(row_hi - row_lo, 0).to(tl.uint32)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fwd_step(acc, m_i, l_i, q, K, V, k_start, j0, stride_kt, stride_vt, offs_k, offs_v, row_lo, row_count, n_k,
              scale_log2, d_ok, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over key tile [j0, j0 + BLOCK_N); row t sees keys [row_lo[t], row_lo[t] + row_count[t])."""
    cols = j0 + tl.arange(0, BLOCK_N)
    kv_mask = d_ok[None, :]
    if MASKED:
        kv_mask = kv_mask & (cols < n_k)[:, None]
    row = (k_start + j0).to(tl.int64)
    k = tl.load(K + row * stride_kt + offs_k, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if MASKED:
        # One unsigned compare: cols < row_lo wraps around to a huge offset.
        s = tl.where((cols[None, :] - row_lo[:, None]).to(tl.uint32) < row_count[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + row * stride_vt + offs_v, mask=kv_mask, other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@_autotune(_FWD_CONFIGS)
@triton.jit(do_not_specialize=_DYNAMIC + ["n_heads"])
def _fwd_kernel(Q, K, V, O, LSE, CU_Q, CU_K,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, n_heads,
                batch, n_search, group, scale_log2, key_stride, key_offset, window, size_class,
                D: tl.constexpr, D_PAD: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Reversed order: the last (longest-running) causal tiles start first.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq, q_start, n_q, m0 = _tile_of(pid, CU_Q, batch, n_search, BLOCK_M)
    if m0 >= n_q:
        return
    k_start = tl.load(CU_K + seq)
    n_k = tl.load(CU_K + seq + 1) - k_start
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    dcol = tl.arange(0, D_PAD)
    d_ok = dcol < D
    row_ok = m0 + offs_m < n_q
    q_row0 = (q_start + m0).to(tl.int64)
    q = tl.load(Q + q_row0 * stride_qt + head * stride_qh + offs_m[:, None] * stride_qt + dcol[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    kv_head = head // group
    K += kv_head * stride_kh
    V += kv_head * stride_vh
    offs_k = offs_n[:, None] * stride_kt + dcol[None, :]
    offs_v = offs_n[:, None] * stride_vt + dcol[None, :]
    lo, n_first, n_edge, mid_lo, mid_hi, row_lo, row_count = _key_tiles(
        m0, n_q, n_k, key_stride, key_offset, window, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for t in range(n_edge):
        j0 = _edge_start(t, lo, n_first, mid_hi, BLOCK_N)
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, K, V, k_start, j0, stride_kt, stride_vt, offs_k, offs_v,
                                  row_lo, row_count, n_k, scale_log2, d_ok, BLOCK_N, True, PRECISION)
    for j0 in range(mid_lo, mid_hi, BLOCK_N):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, K, V, k_start, j0, stride_kt, stride_vt, offs_k, offs_v,
                                  row_lo, row_count, n_k, scale_log2, d_ok, BLOCK_N, False, PRECISION)

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2_C, float("-inf"))
    tl.store(O + q_row0 * stride_ot + head * stride_oh + offs_m[:, None] * stride_ot + dcol[None, :],
             o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + q_row0 * n_heads + head + offs_m * n_heads, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["total", "n_heads"])
def _stats_kernel(O, DO, LSE, DLSE, LSE_S, DELTA, total, stride_ot, stride_oh, stride_dt, stride_dh, n_heads, inv_scale,
                  HAS_DLSE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Per-row statistics of the backward, head-major [h, total] for contiguous tile loads:
    lse_s = lse / scale, the lse in units of raw scores q.k (+inf where lse = -inf, so that
    p = exp2((s - lse_s) * scale * log2(e)) = 0), and delta = sum_d o * do - dlse (dlse: the
    gradient flowing into lse). Both seed the accumulators of the s and dp products."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    dcol = tl.arange(0, D_PAD)
    ok = rows < total
    mask = ok[:, None] & (dcol < D)[None, :]
    r64 = rows.to(tl.int64)
    o = tl.load(O + r64[:, None] * stride_ot + head * stride_oh + dcol[None, :], mask=mask, other=0.0)
    do = tl.load(DO + r64[:, None] * stride_dt + head * stride_dh + dcol[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + r64 * n_heads + head, mask=ok, other=0.0)
    lse = tl.load(LSE + r64 * n_heads + head, mask=ok, other=0.0)
    out = head.to(tl.int64) * total + rows
    tl.store(LSE_S + out, tl.where(lse == float("-inf"), float("inf"), lse * inv_scale), mask=ok)
    tl.store(DELTA + out, delta, mask=ok)


@triton.jit
def _dq_step(dq, q, do, lse_s, delta, K, V, k_start, j0, stride_kt, stride_vt, offs_k, offs_v, row_lo, row_count, n_k,
             scale_log2, d_ok, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
             PRECISION: tl.constexpr):
    """dq += dS K over key tile [j0, j0 + BLOCK_N) (dq unscaled; see _stats_kernel for lse_s, delta)."""
    cols = j0 + tl.arange(0, BLOCK_N)
    kv_mask = d_ok[None, :]
    if MASKED:
        kv_mask = kv_mask & (cols < n_k)[:, None]
    row = (k_start + j0).to(tl.int64)
    k = tl.load(K + row * stride_kt + offs_k, mask=kv_mask, other=0.0)
    v = tl.load(V + row * stride_vt + offs_v, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), tl.broadcast_to(-lse_s[:, None], (BLOCK_M, BLOCK_N)), input_precision=PRECISION)
    if MASKED:
        s = tl.where((cols[None, :] - row_lo[:, None]).to(tl.uint32) < row_count[:, None], s, float("-inf"))
    p = tl.exp2(s * scale_log2)
    ds = p * tl.dot(do, tl.trans(v), tl.broadcast_to(-delta[:, None], (BLOCK_M, BLOCK_N)), input_precision=PRECISION)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)


@_autotune(_DQ_CONFIGS, restore=("DQ",))
@triton.jit(do_not_specialize=_DYNAMIC + ["total"])
def _dq_kernel(Q, K, V, DO, LSE_S, DELTA, DQ, CU_Q, CU_K,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
               stride_dqt, stride_dqh, total,
               batch, n_search, group, scale, scale_log2, key_stride, key_offset, window, size_class,
               D: tl.constexpr, D_PAD: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq of one (query tile, head); ACCUMULATE adds it to what DQ holds (another branch's dq)."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq, q_start, n_q, m0 = _tile_of(pid, CU_Q, batch, n_search, BLOCK_M)
    if m0 >= n_q:
        return
    k_start = tl.load(CU_K + seq)
    n_k = tl.load(CU_K + seq + 1) - k_start
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    dcol = tl.arange(0, D_PAD)
    d_ok = dcol < D
    row_ok = m0 + offs_m < n_q
    q_mask = row_ok[:, None] & d_ok[None, :]
    q_row0 = (q_start + m0).to(tl.int64)
    q = tl.load(Q + q_row0 * stride_qt + head * stride_qh + offs_m[:, None] * stride_qt + dcol[None, :],
                mask=q_mask, other=0.0)
    do = tl.load(DO + q_row0 * stride_dot + head * stride_doh + offs_m[:, None] * stride_dot + dcol[None, :],
                 mask=q_mask, other=0.0)
    stat = head.to(tl.int64) * total + q_row0 + offs_m
    lse_s = tl.load(LSE_S + stat, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + stat, mask=row_ok, other=0.0)
    kv_head = head // group
    K += kv_head * stride_kh
    V += kv_head * stride_vh
    offs_k = offs_n[:, None] * stride_kt + dcol[None, :]
    offs_v = offs_n[:, None] * stride_vt + dcol[None, :]
    lo, n_first, n_edge, mid_lo, mid_hi, row_lo, row_count = _key_tiles(
        m0, n_q, n_k, key_stride, key_offset, window, BLOCK_M, BLOCK_N)
    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    for t in range(n_edge):
        j0 = _edge_start(t, lo, n_first, mid_hi, BLOCK_N)
        dq = _dq_step(dq, q, do, lse_s, delta, K, V, k_start, j0, stride_kt, stride_vt, offs_k, offs_v,
                      row_lo, row_count, n_k, scale_log2, d_ok, BLOCK_M, BLOCK_N, True, PRECISION)
    for j0 in range(mid_lo, mid_hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse_s, delta, K, V, k_start, j0, stride_kt, stride_vt, offs_k, offs_v,
                      row_lo, row_count, n_k, scale_log2, d_ok, BLOCK_M, BLOCK_N, False, PRECISION)
    dq_ptrs = DQ + q_row0 * stride_dqt + head * stride_dqh + offs_m[:, None] * stride_dqt + dcol[None, :]
    dq = dq * scale
    if ACCUMULATE:
        dq += tl.load(dq_ptrs, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=q_mask)


@triton.jit
def _dkdv_step(dk, dv, k, v, Q, DO, LSE_S, DELTA, q_row, stat, m0, hi, stride_qt, stride_dot,
               offs_q, offs_do, pos_lo, count, scale_log2, d_ok,
               BLOCK_M: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """dk += dS^T Q, dv += P^T dO over query rows [m0, m0 + BLOCK_M) of one head (rows >= hi masked).

    Transposed [keys, queries] tiles: P^T and dS^T feed the next products from registers. Key j
    is seen by query rows [pos_lo[j], pos_lo[j] + count[j]) (unsigned counts, already clipped to hi).
    """
    offs_m = tl.arange(0, BLOCK_M)
    if MASKED:
        tile_ok = (m0 + offs_m < hi)[:, None] & d_ok[None, :]
        q = tl.load(Q + q_row * stride_qt + offs_q, mask=tile_ok, other=0.0)
        do = tl.load(DO + q_row * stride_dot + offs_do, mask=tile_ok, other=0.0)
        lse_s = tl.load(LSE_S + stat + offs_m, mask=m0 + offs_m < hi, other=0.0)
        delta = tl.load(DELTA + stat + offs_m, mask=m0 + offs_m < hi, other=0.0)
    else:
        q = tl.load(Q + q_row * stride_qt + offs_q, mask=d_ok[None, :], other=0.0)
        do = tl.load(DO + q_row * stride_dot + offs_do, mask=d_ok[None, :], other=0.0)
        lse_s = tl.load(LSE_S + stat + offs_m)
        delta = tl.load(DELTA + stat + offs_m)
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)
    if MASKED:
        s_t = tl.where(((m0 + offs_m)[None, :] - pos_lo[:, None]).to(tl.uint32) < count[:, None], s_t, float("-inf"))
    p_t = tl.exp2(s_t * scale_log2 - (lse_s * scale_log2)[None, :])
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@_autotune(_DKDV_CONFIGS, restore=("DK", "DV"))
@triton.jit(do_not_specialize=_DYNAMIC + ["total", "q_chunk"])
def _dkdv_kernel(Q, K, V, DO, LSE_S, DELTA, DK, DV, CU_Q, CU_K,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                 stride_dks, stride_dkt, stride_dkh, stride_dvs, stride_dvt, stride_dvh, total,
                 batch, n_search, group, q_chunk, scale, scale_log2, key_stride, key_offset, window, size_class,
                 D: tl.constexpr, D_PAD: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (key tile, KV head, query chunk): sums over the group's query heads.
    ACCUMULATE (one query chunk only) adds dk, dv to what DK, DV hold (another branch's).

    Natural order: the first key tiles of a causal or compressed mask see the most queries and
    start first. The g heads x query tiles run as two flat loops (masked edge tiles of every head,
    then unmasked interior tiles of every head): long loops keep the software pipeline full.
    """
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, k_start, n_k, n0 = _tile_of(tl.program_id(0), CU_K, batch, n_search, BLOCK_N)
    if n0 >= n_k:
        return
    q_start = tl.load(CU_Q + seq)
    n_q = tl.load(CU_Q + seq + 1) - q_start
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    dcol = tl.arange(0, D_PAD)
    d_ok = dcol < D
    cols = n0 + offs_n
    kv_mask = (cols < n_k)[:, None] & d_ok[None, :]
    k_row0 = (k_start + n0).to(tl.int64)
    k = tl.load(K + k_row0 * stride_kt + kv_head * stride_kh + offs_n[:, None] * stride_kt + dcol[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + k_row0 * stride_vt + kv_head * stride_vh + offs_n[:, None] * stride_vt + dcol[None, :],
                mask=kv_mask, other=0.0)

    # Query rows that see some key of the tile, clipped to this program's chunk; all rows of
    # [p_last, p_first + window) see every key of the tile.
    p_first = n0 * key_stride + key_offset
    p_last = (tl.minimum(n0 + BLOCK_N, n_k) - 1) * key_stride + key_offset
    lo = tl.maximum(p_first, split * q_chunk)
    hi = tl.minimum(tl.minimum(n_q, p_last + window), (split + 1) * q_chunk)
    n_first, n_edge, mid_lo, mid_hi = _tile_ranges(lo, hi, p_last, tl.minimum(n_q, p_first + window), BLOCK_M)
    n_mid = (mid_hi - mid_lo) // BLOCK_M
    pos_lo = cols * key_stride + key_offset
    count = tl.maximum(tl.minimum(pos_lo + window, hi) - pos_lo, 0).to(tl.uint32)

    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    offs_q = offs_m[:, None] * stride_qt + dcol[None, :]
    offs_do = offs_m[:, None] * stride_dot + dcol[None, :]
    head0 = kv_head * group
    for it in range(group * n_edge):
        i = it // tl.maximum(n_edge, 1)
        m0 = _edge_start(it - i * n_edge, lo, n_first, mid_hi, BLOCK_M)
        head = head0 + i
        dk, dv = _dkdv_step(dk, dv, k, v, Q + head * stride_qh, DO + head * stride_doh,
                            LSE_S, DELTA, (q_start + m0).to(tl.int64), head.to(tl.int64) * total + q_start + m0, m0,
                            hi, stride_qt, stride_dot, offs_q, offs_do, pos_lo, count,
                            scale_log2, d_ok, BLOCK_M, True, PRECISION)
    for it in range(group * n_mid):
        i = it // tl.maximum(n_mid, 1)
        m0 = mid_lo + (it - i * n_mid) * BLOCK_M
        head = head0 + i
        dk, dv = _dkdv_step(dk, dv, k, v, Q + head * stride_qh, DO + head * stride_doh,
                            LSE_S, DELTA, (q_start + m0).to(tl.int64), head.to(tl.int64) * total + q_start + m0, m0,
                            hi, stride_qt, stride_dot, offs_q, offs_do, pos_lo, count,
                            scale_log2, d_ok, BLOCK_M, False, PRECISION)
    s64 = split.to(tl.int64)
    dk_ptrs = DK + s64 * stride_dks + k_row0 * stride_dkt + kv_head * stride_dkh + offs_n[:, None] * stride_dkt + dcol[None, :]
    dv_ptrs = DV + s64 * stride_dvs + k_row0 * stride_dvt + kv_head * stride_dvh + offs_n[:, None] * stride_dvt + dcol[None, :]
    dk = dk * scale
    if ACCUMULATE:
        dk += tl.load(dk_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
        dv += tl.load(dv_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def _common_meta(q: torch.Tensor) -> dict:
    d = q.shape[2]
    return {"D": d, "D_PAD": max(16, next_pow2(d)), "PRECISION": dot_precision(q.dtype)}


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Buffers whose every element a kernel writes (tests swap in NaN-filled ones to prove it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _size_class(total: int, h: int) -> int:
    """Autotune key (unused by the kernels): total * h in powers of 4 from 2^15 up to 2^23, so a
    tiny batch does not pick the tiles of a 64K-token one (parallelism differs by 100x)."""
    return min(4, max(0, ((total * h).bit_length() - 15) // 2))


def _num_query_chunks(total_q: int, total_k: int, batch: int, h_kv: int, group: int, window: int,
                      device: torch.device) -> int:
    """Query chunks for dk/dv (fp32 partials, summed in a fixed order), from shapes only.

    Few key tiles that each see a long query range (compressed keys, causal masks of short
    batches) leave SMs idle: cut the query axis so that there are ~4 programs per SM (key tiles
    counted at the largest BLOCK_N, 128), while a chunk keeps >= 4096 (row, head) pairs of work
    (the fp32 partials cost 2 * d * 4 bytes per key row and chunk, written and read once).
    """
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = (batch + total_k // 128) * h_kv
    span = min(window, total_q)  # query rows one key tile can see
    return max(1, min(16, -(-4 * sms // programs), span * group // 4096))


def _forward(q, k, v, cu_q, cu_k, key_stride, key_offset, window, scale):
    total, h, d = q.shape
    batch = cu_q.numel() - 1
    o = _empty((total, h, d), q.dtype, q.device)
    lse = _empty((total, h), torch.float32, q.device)
    if total == 0:
        return o, lse
    if k.shape[0] == 0:  # no key at all (no sequence reaches kernel_size): nothing to launch on
        return o.zero_(), lse.fill_(float("-inf"))
    grid = lambda meta: (batch + total // meta["BLOCK_M"], h)
    _fwd_kernel[grid](
        q, k, v, o, lse, cu_q, cu_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1), h,
        batch, search_steps(batch), h // k.shape[1], scale * LOG2E, key_stride, key_offset, window,
        _size_class(total, h), **_common_meta(q), **_meta(32, 16),
    )
    return o, lse


def _backward(do, dlse, q, k, v, o, lse, cu_q, cu_k, key_stride, key_offset, window, scale, key_padding,
              into=None):
    """dq, dk, dv. key_padding: k/v may hold rows outside every sequence (their gradient is 0).

    ``into``: (dq, dk, dv) buffers to add these gradients to, or (dq, None, None) to add dq
    only (dk, dv then new): another branch's gradients of the same inputs, summed in the kernels'
    stores instead of by separate additions. Returns the buffers written.
    """
    total, h, d = q.shape
    total_k, h_kv, _ = k.shape
    batch = cu_q.numel() - 1
    group = h // h_kv
    meta = _common_meta(q)
    dq_in, dk_in, dv_in = into if into is not None else (None, None, None)
    alloc = torch.zeros if key_padding or total == 0 else _empty  # padding rows get no program
    dq = dq_in if dq_in is not None else _empty((total, h, d), q.dtype, q.device)
    dk = dk_in if dk_in is not None else alloc((total_k, h_kv, d), dtype=k.dtype, device=q.device)
    dv = dv_in if dv_in is not None else alloc((total_k, h_kv, d), dtype=v.dtype, device=q.device)
    if total == 0 or total_k == 0:
        return (dq if dq_in is not None else dq.zero_()), dk, dv
    # The row statistics and the query chunks' partials are the call's scratch (ops.scratch).
    key = ("flash.backward", *scratch.shapes(q, k, cu_q, cu_k), key_stride, key_offset, window, key_padding)
    with scratch.planned(key, q.device):
        lse_s, delta = scratch.empty((2, h, total), torch.float32, q.device)  # head-major row statistics
        _stats_kernel[(cdiv(total, 64), h)](
            o, do, lse, dlse if dlse is not None else lse, lse_s, delta, total,
            o.stride(0), o.stride(1), do.stride(0), do.stride(1), h, 1.0 / scale,
            HAS_DLSE=dlse is not None, D=d, D_PAD=meta["D_PAD"], BLOCK_T=64,
        )
        common = (batch, search_steps(batch), group)
        grid_q = lambda m: (batch + total // m["BLOCK_M"], h)
        _dq_kernel[grid_q](
            q, k, v, do, lse_s, delta, dq, cu_q, cu_k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
            dq.stride(0), dq.stride(1), total, *common, scale, scale * LOG2E, key_stride, key_offset, window,
            _size_class(total, h), **meta, ACCUMULATE=dq_in is not None, **_meta(32, 16),
        )
        chunks = _num_query_chunks(total, total_k, batch, h_kv, group, window, q.device)
        # fp32 partials per query chunk, summed in a fixed order below (deterministic).
        # (Zeros where key padding leaves rows that no program writes.)
        partials = functools.partial(torch.zeros if key_padding else scratch.empty, (chunks, total_k, h_kv, d),
                                     dtype=torch.float32, device=q.device)
        dk_out = dk[None] if chunks == 1 else partials()
        dv_out = dv[None] if chunks == 1 else partials()
        grid_k = lambda m: (batch + total_k // m["BLOCK_N"], h_kv, chunks)
        _dkdv_kernel[grid_k](
            q, k, v, do, lse_s, delta, dk_out, dv_out, cu_q, cu_k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
            *dk_out.stride()[:3], *dv_out.stride()[:3], total,
            *common, cdiv(total, chunks), scale, scale * LOG2E, key_stride, key_offset, window,
            _size_class(total, h), **meta, ACCUMULATE=chunks == 1 and dk_in is not None, **_meta(16, 32),
        )
        if chunks > 1:
            for grad, parts in ((dk, dk_out), (dv, dv_out)):
                if dk_in is not None:
                    grad.add_(parts.sum(0))
                else:
                    grad.copy_(parts.sum(0))
    return dq, dk, dv


class FlashAttention(torch.autograd.Function):
    """(q, k, v, cu_q, cu_k, key_stride, key_offset, window, scale, key_padding) -> (o, lse).

    See the module doc; key_padding: k/v rows past cu_k[-1] exist (compressed buffers). Its
    ``setup`` and ``backward`` are also the autograd of the op ``fsalab::flash_attention`` below,
    which torch.compile sees in its place.
    """

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward(*inputs[:-1])
        FlashAttention.setup(ctx, inputs, output)
        return output

    @staticmethod
    def setup(ctx, inputs, output):
        q, k, v, cu_q, cu_k, *params = inputs
        ctx.save_for_backward(q, k, v, *output, cu_q, cu_k)
        ctx.params = params

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        do = do.contiguous() if do.stride(-1) != 1 else do
        dlse = dlse.contiguous() if dlse is not None else None
        dq, dk, dv = op_or("flash_attention_backward", _backward, do)(do, dlse, q, k, v, o, lse, cu_q, cu_k, *ctx.params)
        return dq, dk, dv, None, None, None, None, None, None, None


# torch.compile's view of the kernels (ops/library.py): opaque ops with fake kernels.
@torch.library.custom_op("fsalab::flash_attention", mutates_args=())
def _flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                        key_stride: int, key_offset: int, window: int, scale: float,
                        key_padding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, cu_q, cu_k, key_stride, key_offset, window, scale)


@_flash_attention_op.register_fake
def _(q, k, v, cu_q, cu_k, key_stride, key_offset, window, scale, key_padding):
    return q.new_empty(q.shape), lse_like(q)


@torch.library.custom_op("fsalab::flash_attention_backward", mutates_args=())
def _flash_attention_backward_op(
    do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, key_stride: int, key_offset: int, window: int,
    scale: float, key_padding: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, dlse, q, k, v, o, lse, cu_q, cu_k, key_stride, key_offset, window, scale, key_padding)


@_flash_attention_backward_op.register_fake
def _(do, dlse, q, k, v, o, lse, cu_q, cu_k, key_stride, key_offset, window, scale, key_padding):
    return grads_like(q, k, v)


_flash_attention_op.register_autograd(FlashAttention.backward, setup_context=FlashAttention.setup)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    *,
    mask: str = "window",
    window_size: int | None = None,
    kernel_size: int | None = None,
    kernel_stride: int | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen GQA attention with a window or compressed-key mask (module doc), differentiable.

    mask="window": k/v share the queries' rows and cu_seqlens (cu_seqlens_k must be None);
    query t sees keys (t - window_size, t].
    mask="compressed": k/v [rows, h_kv, d] hold each sequence's compressed tokens at offsets
    cu_seqlens_k (rows past cu_seqlens_k[-1] are never read; their gradient is 0); query t sees
    compressed j iff t >= j * kernel_stride + kernel_size - 1.
    Returns o [total_q, h, d] (q.dtype) and lse [total_q, h] fp32, natural log (-inf: no key seen).
    """
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}, got {mask!r}")
    check_attention_inputs(q, k, v, cu_seqlens_q, KERNEL_DTYPES)
    if q.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1); q is on {q.device}")
    total = q.shape[0]
    if mask == "window":
        if cu_seqlens_k is not None:
            raise ValueError("mask='window' shares cu_seqlens between queries and keys; pass cu_seqlens_k=None")
        if k.shape[0] != total:
            raise ValueError(f"mask='window' needs one k/v row per query row ({total}), got {k.shape[0]}")
        if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 1:
            raise ValueError(f"window_size must be a positive int, got {window_size!r}")
        cu_seqlens_k = cu_seqlens_q
        key_stride, key_offset, window = 1, 0, min(window_size, NO_WINDOW)
    else:
        for name, value in (("kernel_size", kernel_size), ("kernel_stride", kernel_stride)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mask='compressed' needs a positive int {name}, got {value!r}")
        check_tensor("cu_seqlens_k", cu_seqlens_k, 1, (torch.int32,), q.device)
        if cu_seqlens_k.shape != cu_seqlens_q.shape:
            raise ValueError(
                f"cu_seqlens_k must have the shape of cu_seqlens_q {tuple(cu_seqlens_q.shape)}, got {tuple(cu_seqlens_k.shape)}"
            )
        key_stride, key_offset, window = kernel_stride, kernel_size - 1, NO_WINDOW
    if total >= NO_WINDOW or k.shape[0] >= NO_WINDOW:
        raise ValueError(f"at most {NO_WINDOW - 1} tokens per call (int32 positions), got {max(total, k.shape[0])}")
    check_scale(scale)  # the backward works with lse / scale and -inf masks
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[2])
    q, k, v = (unit_last_stride(x) for x in (q, k, v))
    return op_or("flash_attention", FlashAttention.apply)(
        q, k, v, cu_seqlens_q, cu_seqlens_k, key_stride, key_offset, window, float(scale), mask == "compressed",
    )
