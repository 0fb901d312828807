"""Top-T block selection of NSA (DESIGN §4 step 3) in one Triton kernel.

``select_blocks``: top-T selection blocks per token and KV head (NSA Eq. 8–12). One program per
(tile of one sequence's tokens, KV head): the tile's (token, head) rows are the MMA's M dimension
(a power-of-two part of the g heads, and for g = 3, 5, 6, 9, ... a second product for the rest,
so no row is padding where splitting saves rows), the loop walks the visible compressed tokens
in chunks of BB blocks, computes p = exp(q·k_cmp·scale - lse_cmp), sums the g heads in fp32,
maps the chunk to block scores with the fixed overlap stencil (own block: weights
min(l/s, B/s - i); the last l/s - 1 tokens of a block also spill into the next block) and merges
the chunk into a running top-T held in registers. Candidates are int32 keys (``block_key``: the
score rounded to 26 - KB mantissa bits, then ~block in KB bits, KB = the bit length of the
token's own block), unique, so "larger key" is "larger score, then lower block" (the reference's
stable tie rule, with scores closer than the rounding counted as tied); the merge is branch-free
(``merge_topk``). The chunks that every row of the tile sees whole and that hold no forced or
future block run the loop body without its masks (``_merge_chunk``). Nothing of size N x N/s or
N x N/B is ever stored: memory is the [total, h_kv, T] output. On an sm_90 GPU ``select_blocks``
runs the Gluon kernel of ``block_select_gluon`` instead where it is preferred (same keys, the
top-T with a token's row in one thread).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...checks import check_attention_inputs, check_tensor
from ...config import NSAConfig
from ...varlen import compressed_capacity
from .._triton import LOG2E as _LOG2E
from .._triton import LOG2E_C
from .._triton import autotune as _autotune
from .._triton import cdiv as _cdiv
from .._triton import dot_precision as _dot_precision
from .._triton import interpreter_meta as _meta
from .._triton import next_pow2 as _next_pow2
from .._triton import search_steps as _search_steps
from .._triton import tile_config as _tile_config
from .._triton import unit_last_stride as _unit_last_stride
from ..library import op_or
from .select_common import (
    KEY_NONE,
    block_key,
    chunk_ranges,
    empty_run,
    forced_score,
    key_bits,
    merge_topk,
    sequence_tile,
    store_ascending,
)

try:  # the Gluon kernel for Hopper (block_select_gluon); Triton builds without Gluon use the Triton one
    from . import block_select_gluon as _gluon_kernel
except ImportError:
    _gluon_kernel = None


_SELECT_CONFIGS = [_tile_config(4, 2, BLOCK_M=64), _tile_config(8, 2, BLOCK_M=128)]


@triton.jit
def _select_rows(q_ptr, lse_ptr, start, n, t0, head0, n_heads, s_qt, s_qh, s_lt, s_lh, dd, d_ok,
                 BLOCK_T: tl.constexpr, GP: tl.constexpr):
    """q [BLOCK_T * GP, D_PAD] and lse in log2 units of heads head0 .. head0 + n_heads of the tile's
    tokens, GP rows per token (rows past n_heads idle). Dead rows (idle, past the sequence, or
    seeing no compressed token) get lse = +inf, so their p = exp2(q·k - lse) is 0 without a mask
    (their q is 0 or finite)."""
    m = tl.arange(0, BLOCK_T * GP)
    row_tok = t0 + m // GP
    row_head = head0 + m % GP
    row_ok = (row_tok < n) & (m % GP < n_heads)
    tok = (start + row_tok).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * s_qt + row_head[:, None] * s_qh + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(lse_ptr + tok * s_lt + row_head * s_lh, mask=row_ok, other=float("-inf")).to(tl.float32)
    live = row_ok & (lse > float("-inf"))  # heads that see nothing contribute p = 0
    return q, tl.where(live, lse * LOG2E_C, float("inf"))


@triton.jit
def _merge_chunk(ch, run, carry, q, lse2, q_lo, lse2_lo, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh, dd, d_ok, qk_scale,
                 t_ok, n_vis, own, kb, w_own, w_spill, bb, prev,
                 G_HI: tl.constexpr, G_LO_P: tl.constexpr, BLOCK_T: tl.constexpr, BB: tl.constexpr, R: tl.constexpr,
                 INIT: tl.constexpr, LOCAL: tl.constexpr, T_P: tl.constexpr, DOT_PREC: tl.constexpr,
                 MASKED: tl.constexpr):
    """Chunk ch (blocks ch*BB .. ch*BB + BB - 1) of the score loop: p over its BB * R compressed
    tokens, summed over the group's heads, mapped to block scores by the overlap stencil (the spill
    of the previous chunk's last block comes in as ``carry``), keyed and merged into the rows'
    running top-T ``run``; returns (run, carry). MASKED=False drops the masks that only chunks at
    the sequence's start or the tile's diagonal need (visibility, forced and future blocks): the
    caller runs it where every row of the tile sees the whole chunk and no block in it is forced."""
    BLOCK_C: tl.constexpr = BB * R
    jj = ch * BLOCK_C + tl.arange(0, BLOCK_C)
    k_ptrs = kc_ptr + (c_start + jj).to(tl.int64)[None, :] * s_kt + kvh * s_kh + dd[:, None]
    if MASKED:
        kt = tl.load(k_ptrs, mask=(jj < n_cmp)[None, :] & d_ok[:, None], other=0.0)
    else:
        kt = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
    p = tl.exp2(tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale - lse2[:, None])  # dead rows: lse2 = +inf
    ps = tl.sum(tl.reshape(p, (BLOCK_T, G_HI, BLOCK_C)), axis=1)
    if G_LO_P > 0:
        p_lo = tl.exp2(tl.dot(q_lo, kt, input_precision=DOT_PREC) * qk_scale - lse2_lo[:, None])
        ps += tl.sum(tl.reshape(p_lo, (BLOCK_T, G_LO_P, BLOCK_C)), axis=1)
    if MASKED:
        ps = tl.where(t_ok[:, None] & (jj[None, :] < n_vis[:, None]), ps, 0.0)
    p3 = tl.reshape(ps, (BLOCK_T, BB, R))
    own_part = tl.sum(p3 * w_own[None, None, :], axis=2)
    spill = tl.sum(p3 * w_spill[None, None, :], axis=2)
    score = own_part + tl.where(bb[None, :] == 0, carry[:, None], tl.gather(spill, prev, axis=1))
    carry = tl.sum(tl.where(bb[None, :] == BB - 1, spill, 0.0), axis=1)
    blk = ch * BB + bb[None, :]
    if MASKED:
        score = forced_score(score, blk, own[:, None], INIT, LOCAL)
        key = tl.where(t_ok[:, None] & (blk <= own[:, None]), block_key(score, blk, kb), KEY_NONE)
    else:
        key = block_key(score, blk, kb)
    return merge_topk(run, key, T_P), carry


def _prune_select(configs, named_args, **kwargs):
    """Configs whose tile leaves the second head part at least 16 rows (the smallest MMA)."""
    g_hi, g_lo = kwargs["G_HI"], kwargs["G_LO_P"]
    keep = [c for c in configs if g_lo == 0 or c.kwargs["BLOCK_M"] // g_hi * g_lo >= 16]
    return keep or configs[-1:]


def _chunk_blocks(t_pad: int, r: int) -> int:
    """BB, the blocks one iteration of the score loop covers: at least T_P (a chunk's candidates
    are cut to their top T_P before the merge, ``merge_topk``) and 16 compressed tokens
    (BB * r >= 16, the MMA's smallest N); r = block_size / kernel_stride. Both powers of two.
    The smallest such width is the fastest: wider chunks rank fewer, longer rows and lose more
    in registers than the ranking saves (docs/performance.md, "Top-T selection")."""
    return max(t_pad, _cdiv(16, r))


def _head_parts(g: int) -> tuple[int, int]:
    """(G_HI, G_LO_P): a group's g query heads as a power-of-two part and, for g not a power of
    two, a second part of g - G_HI heads padded to a power of two (g = 5 -> 4 + 1, 6 -> 4 + 2).
    One padded part when splitting saves no rows (g = 7 -> 8 + 0)."""
    g_p = _next_pow2(g)
    if g == g_p:
        return g, 0
    g_hi = g_p // 2
    g_lo = _next_pow2(g - g_hi)
    return (g_hi, g_lo) if g_hi + g_lo < g_p else (g_p, 0)


@_autotune(_SELECT_CONFIGS, key=["G_HI", "G_LO_P", "HEAD_DIM", "BS", "TOPK"], prune=_prune_select)
@triton.jit
def _select_kernel(
    q_ptr, kc_ptr, lse_ptr, cu_ptr, cuc_ptr, out_ptr,
    batch, steps, qk_scale,
    s_qt, s_qh, s_kt, s_kh, s_lt, s_lh, s_ot, s_oh,
    G: tl.constexpr, G_HI: tl.constexpr, G_LO_P: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    L: tl.constexpr, S: tl.constexpr, BS: tl.constexpr, TOPK: tl.constexpr, T_P: tl.constexpr,
    BB: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    R: tl.constexpr = BS // S  # compressed tokens starting in one block
    MP: tl.constexpr = L // S  # blocks of s tokens in one window
    BLOCK_C: tl.constexpr = BB * R
    BLOCK_T: tl.constexpr = BLOCK_M // G_HI
    kvh = tl.program_id(1)
    start, n, t0, c_start, n_cmp = sequence_tile(tl.program_id(0), cu_ptr, cuc_ptr, batch, steps, BLOCK_T)

    pos = t0 + tl.arange(0, BLOCK_T)
    t_ok = pos < n
    own = pos // BS
    kb = key_bits(own)[:, None]
    n_vis = tl.where(pos >= L - 1, (pos - (L - 1)) // S + 1, 0)
    # (token, head) rows of the QK products: the first G_HI heads of a group as G_HI consecutive
    # rows per token (padded when G_HI > g), the other g - G_HI heads (if any) likewise in a
    # second, smaller product, so that g = 5 costs 5 rows per token instead of 8.
    dd = tl.arange(0, D_PAD)
    d_ok = dd < HEAD_DIM
    q, lse2 = _select_rows(q_ptr, lse_ptr, start, n, t0, kvh * G, G, s_qt, s_qh, s_lt, s_lh, dd, d_ok, BLOCK_T, G_HI)
    if G_LO_P > 0:
        q_lo, lse2_lo = _select_rows(q_ptr, lse_ptr, start, n, t0, kvh * G + G_HI, G - G_HI, s_qt, s_qh, s_lt, s_lh,
                                     dd, d_ok, BLOCK_T, G_LO_P)
    else:  # unused
        q_lo, lse2_lo = q, lse2

    i = tl.arange(0, R)
    w_own = tl.minimum(MP, R - i).to(tl.float32)  # cells of window bR+i inside block b
    w_spill = tl.maximum(i + MP - R, 0).to(tl.float32)  # ... inside block b+1
    bb = tl.arange(0, BB)
    prev = tl.maximum(bb - 1, 0)[None, :] + tl.zeros([BLOCK_T, BB], dtype=tl.int32)
    run = empty_run(BLOCK_T, T_P)  # ascending; its last TOPK columns are the top TOPK

    carry = tl.zeros([BLOCK_T], dtype=tl.float32)
    # Chunks that every row of the tile sees whole, holding neither a forced nor a future block,
    # run the body without its masks, a quarter fewer instructions (scripts/sass_loop_count.py
    # --kernel select --loops 2 counts both bodies).
    head_end, bulk_end, n_chunks = chunk_ranges(t0, n, BLOCK_T, BS, BB, BLOCK_C, L, S, INIT, LOCAL)
    for ch in range(0, head_end):
        run, carry = _merge_chunk(ch, run, carry, q, lse2, q_lo, lse2_lo, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh, dd,
                                  d_ok, qk_scale, t_ok, n_vis, own, kb, w_own, w_spill, bb, prev,
                                  G_HI, G_LO_P, BLOCK_T, BB, R, INIT, LOCAL, T_P, DOT_PREC, True)
    for ch in range(head_end, bulk_end):
        run, carry = _merge_chunk(ch, run, carry, q, lse2, q_lo, lse2_lo, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh, dd,
                                  d_ok, qk_scale, t_ok, n_vis, own, kb, w_own, w_spill, bb, prev,
                                  G_HI, G_LO_P, BLOCK_T, BB, R, INIT, LOCAL, T_P, DOT_PREC, False)
    for ch in range(bulk_end, n_chunks):
        run, carry = _merge_chunk(ch, run, carry, q, lse2, q_lo, lse2_lo, kc_ptr, c_start, n_cmp, kvh, s_kt, s_kh, dd,
                                  d_ok, qk_scale, t_ok, n_vis, own, kb, w_own, w_spill, bb, prev,
                                  G_HI, G_LO_P, BLOCK_T, BB, R, INIT, LOCAL, T_P, DOT_PREC, True)

    store_ascending(out_ptr + (start + pos).to(tl.int64)[:, None] * s_ot + kvh * s_oh, run, kb, t_ok[:, None],
                     TOPK, T_P)


def select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    lse_cmp: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cmp: torch.Tensor,
    cfg: NSAConfig,
    scale: float | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Top-T selection blocks per token and KV head (NSA Eq. 8–12), int32 [total, h_kv, topk].

    q [total, h, d] and k_cmp [total // s, h_kv, d] in one dtype (fp16/bf16/fp32); lse_cmp
    [total, h] (natural log, -inf for queries that see no compressed token) from compressed
    attention; cu_seqlens / cu_seqlens_cmp int32 [batch + 1]. Query t sees compressed j of its
    sequence iff t >= j*s + l - 1. Scores p = exp(q·k_cmp·scale - lse_cmp) are summed over the g
    heads of a group in fp32 and mapped to blocks with the overlap weights; blocks < init_blocks
    and the local_blocks blocks ending at the own block are forced, later blocks never chosen,
    ties go to the lower block. Rows ascending, valid first, -1 padding. Same as
    ``reference.select_blocks`` (beside it) up to fp32 summation order and the keys' rounding (scores within
    2^-(26 - KB) relative tie, ``block_key``; near-ties may order differently).

    kernel: ``"auto"`` (the Gluon kernel of ``block_select_gluon`` where it is preferred, else
    this module's Triton kernel), ``"triton"`` or ``"gluon"`` (a ValueError where it cannot run).
    """
    if kernel not in ("auto", "triton", "gluon"):
        raise ValueError(f"kernel must be 'auto', 'triton' or 'gluon', got {kernel!r}")
    if not isinstance(cfg, NSAConfig):
        raise TypeError(f"cfg must be an NSAConfig, got {type(cfg).__name__}")
    h, h_kv, g, d = check_attention_inputs(q, k_cmp, k_cmp, cu_seqlens)
    total, rows = q.shape[0], k_cmp.shape[0]
    if rows != compressed_capacity(total, cfg.kernel_stride):
        raise ValueError(f"k_cmp must have total // kernel_stride = {compressed_capacity(total, cfg.kernel_stride)} rows, got {rows}")
    check_tensor("lse_cmp", lse_cmp, 2, (torch.float32, torch.float16, torch.bfloat16), q.device)
    if tuple(lse_cmp.shape) != (total, h):
        raise ValueError(f"lse_cmp must have shape [total, h] = [{total}, {h}], got {tuple(lse_cmp.shape)}")
    check_tensor("cu_seqlens_cmp", cu_seqlens_cmp, 1, (torch.int32,), q.device)
    if cu_seqlens_cmp.shape != cu_seqlens.shape:
        raise ValueError(f"cu_seqlens_cmp must have shape {tuple(cu_seqlens.shape)}, got {tuple(cu_seqlens_cmp.shape)}")
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    return op_or("select_blocks", _select)(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, cfg.as_ints(), float(scale),
                                           kernel)


def _select(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, cfg_ints: list[int], scale: float,
            kernel: str) -> torch.Tensor:
    """``select_blocks`` on checked inputs (cfg as ``NSAConfig.as_ints``): the Gluon or the Triton
    kernel, one launch."""
    cfg = NSAConfig.from_ints(cfg_ints)
    total, h, d = q.shape
    rows, h_kv = k_cmp.shape[:2]
    g = h // h_kv
    out = torch.empty((total, h_kv, cfg.topk), dtype=torch.int32, device=q.device)
    if total == 0:
        return out
    q, k_cmp = _unit_last_stride(q), _unit_last_stride(k_cmp)
    if rows == 0:  # no compressed token at all: keep a valid pointer, every load is masked
        k_cmp = k_cmp.new_zeros((1, h_kv, d))
    r = cfg.block_size // cfg.kernel_stride
    t_pad = max(2, _next_pow2(cfg.topk))
    bb = _chunk_blocks(t_pad, r)
    if kernel == "gluon" and not (_gluon_kernel is not None and _gluon_kernel.runs(q, g, cfg, t_pad, bb)):
        raise ValueError("kernel='gluon' needs an sm_90 GPU, fp16/bf16, d in {64, 128, 256}, chunks of exactly T_P "
                         "blocks and the group's q tiles in shared memory (block_select_gluon.runs)")
    if kernel == "gluon" or (kernel == "auto" and _gluon_kernel is not None
                             and _gluon_kernel.preferred(q, g, cfg, t_pad, bb)):
        _gluon_kernel.launch(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, out, cfg, g, t_pad, bb, scale * _LOG2E)
        return out
    g_hi, g_lo = _head_parts(g)
    batch = cu_seqlens.numel() - 1
    grid = lambda meta: (batch + total // (meta["BLOCK_M"] // g_hi), h_kv)
    # Interpreter tile: 64 query tokens (the GPU tile at g = 1); the interpreter pays per program
    # and op, and the tests' long sequences still span several tiles.
    _select_kernel[grid](
        q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, out, batch, _search_steps(batch), scale * _LOG2E,
        q.stride(0), q.stride(1), k_cmp.stride(0), k_cmp.stride(1), lse_cmp.stride(0), lse_cmp.stride(1),
        out.stride(0), out.stride(1),
        G=g, G_HI=g_hi, G_LO_P=g_lo, HEAD_DIM=d, D_PAD=max(16, _next_pow2(d)), L=cfg.kernel_size, S=cfg.kernel_stride,
        BS=cfg.block_size, TOPK=cfg.topk, T_P=t_pad, BB=bb,
        INIT=cfg.init_blocks, LOCAL=cfg.local_blocks, DOT_PREC=_dot_precision(q.dtype),
        **_meta(BLOCK_M=64 * g_hi),
    )
    return out


# torch.compile's view of the kernel (ops/library.py): an opaque op with a fake kernel.
@torch.library.custom_op("fsalab::select_blocks", mutates_args=())
def _select_blocks_op(q: torch.Tensor, k_cmp: torch.Tensor, lse_cmp: torch.Tensor, cu_seqlens: torch.Tensor,
                      cu_seqlens_cmp: torch.Tensor, cfg_ints: list[int], scale: float, kernel: str) -> torch.Tensor:
    return _select(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, cfg_ints, scale, kernel)


@_select_blocks_op.register_fake
def _(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, cfg_ints, scale, kernel):
    return q.new_empty((q.shape[0], k_cmp.shape[1], NSAConfig.from_ints(cfg_ints).topk), dtype=torch.int32)
