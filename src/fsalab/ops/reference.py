"""fp32 PyTorch reference of every NSA step (DESIGN §4); the source of truth for every kernel.

Packed varlen layout: q [total, h, d], k/v [total, h_kv, d], cu_seqlens int32 [batch + 1].
Compressed keys/values live in a buffer of ``total // kernel_stride`` rows with per-sequence
offsets ``cu_seqlens_cmp``; rows past ``cu_seqlens_cmp[-1]`` are zero padding.

Everything is computed in float32 (float64 when the inputs are float64, for gradcheck) and
returned in that precision. Work is split into chunks of query tokens, each a few dense tensor
ops, so memory stays bounded at long sequence lengths without a Python loop over tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import torch
from torch.utils.checkpoint import checkpoint

from ..config import NSAConfig
from ..varlen import (
    compressed_capacity,
    compressed_cu_seqlens,
    compressed_index,
    local_positions,
    sequence_ids,
)

# Elements of the largest intermediate a chunk may build (2**26 fp32 = 256 MiB).
_CHUNK_BUDGET = 1 << 26


_NATIVE_PRECISION = contextvars.ContextVar("fsalab_reference_native_precision", default=False)


@contextlib.contextmanager
def native_precision():
    """Compute in the inputs' own dtype instead of fp32: what plain PyTorch would do in fp16/bf16.

    Tests use it to measure PyTorch's own error in a dtype and bound kernels' error by a multiple of it.
    """
    token = _NATIVE_PRECISION.set(True)
    try:
        yield
    finally:
        _NATIVE_PRECISION.reset(token)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    if _NATIVE_PRECISION.get() or t.dtype == torch.float64:
        return t.dtype
    return torch.float32


def _chunks(total: int, per_token: int):
    """Query-token ranges whose intermediates stay under the chunk budget."""
    step = max(1, _CHUNK_BUDGET // max(1, per_token))
    for start in range(0, total, step):
        yield start, min(total, start + step)


def _finite_values(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(v with non-finite entries zeroed, bool [..., m] True where a key's value is not finite);
    v [..., m, d]. Computed once on the keys, before any per-query gather."""
    finite = torch.isfinite(v)
    return torch.where(finite, v, torch.zeros_like(v)), ~finite.all(-1)


def _softmax_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bad: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of grouped queries.

    q [c, h_kv, g, d]; k and v (finite: ``_finite_values``) either shared [h_kv, m, d] or per
    query [c, h_kv, m, d]; ``bad`` [h_kv, m] or [c, h_kv, m] marks keys whose value was not
    finite; mask broadcastable to [c, h_kv, 1, m]. Returns o [c, h_kv, g, d] and lse [c, h_kv, g]
    (natural log); rows that see no key give o = 0 and lse = -inf with finite gradients.

    Masked keys are left out by selection, never by multiplying with 0: a NaN/Inf in a key or
    value a query cannot see (a later token, another sequence, padding) does not reach it; a
    query that sees a non-finite value gets NaN.
    """
    kv = "hmd" if k.dim() == 3 else "chmd"
    s = torch.einsum(f"chgd,{kv}->chgm", q, k) * scale
    if s.shape[-1] == 0:  # no keys at all (no sequence long enough to compress): o = 0, still in the graph
        return torch.einsum(f"chgm,{kv}->chgd", s, v), s.new_full(s.shape[:3], float("-inf"))
    s = s.masked_fill(~mask, float("-inf"))
    # Shift by the row max for stability; the shift is a constant of the softmax, so detaching it is exact.
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    o = torch.einsum(f"chgm,{kv}->chgd", e, v)
    o = o / torch.where(denom > 0, denom, torch.ones_like(denom))
    sees_bad = (mask & bad.unsqueeze(-2)).any(-1, keepdim=True)  # [c, h_kv, 1, 1]
    o = o.masked_fill(sees_bad, float("nan"))
    lse = (torch.log(denom) + m).squeeze(-1)
    return o, lse


def compress_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    pe: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cfg: NSAConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Linear compression with intra-block position embedding on keys (NSA Eq. 7).

    k, v [total, h_kv, d] (keys before RoPE); w_k, w_v [h_kv, l * d, d]; pe [h_kv, l, d].
    Compressed token j of a sequence covers its raw tokens [j * s, j * s + l):
    k_cmp[j] = flatten(k[window] + pe) @ w_k, v_cmp[j] = flatten(v[window]) @ w_v.
    Returns k_cmp, v_cmp [total // s, h_kv, d] and cu_seqlens_cmp int32 [batch + 1].
    """
    dt = _compute_dtype(k)
    total, h_kv, d = k.shape
    l, s = cfg.kernel_size, cfg.kernel_stride
    cu_cmp = compressed_cu_seqlens(cu_seqlens, l, s)
    rows = compressed_capacity(total, s)
    r = torch.arange(rows, device=k.device)
    valid = r < cu_cmp[-1]
    seq = sequence_ids(cu_cmp, rows).clamp(max=cu_seqlens.numel() - 2)
    start = cu_seqlens.long()[seq] + compressed_index(cu_cmp, rows) * s
    idx = (start[:, None] + torch.arange(l, device=k.device)).clamp(0, max(total - 1, 0))
    idx = torch.where(valid[:, None], idx, torch.zeros_like(idx))
    k_win = (k.to(dt)[idx] + pe.to(dt).transpose(0, 1)).transpose(1, 2).reshape(rows, h_kv, l * d)
    v_win = v.to(dt)[idx].transpose(1, 2).reshape(rows, h_kv, l * d)
    # Padding rows gather token 0: select zeros there (0 * NaN would still be NaN).
    pad = ~valid[:, None, None]
    k_cmp = torch.einsum("rhx,hxd->rhd", k_win, w_k.to(dt)).masked_fill(pad, 0.0)
    v_cmp = torch.einsum("rhx,hxd->rhd", v_win, w_v.to(dt)).masked_fill(pad, 0.0)
    return k_cmp, v_cmp, cu_cmp


def _compressed_visibility(
    cu_seqlens: torch.Tensor, cu_seqlens_cmp: torch.Tensor, total: int, rows: int, lo: int, hi: int, cfg: NSAConfig
) -> torch.Tensor:
    """mask [hi - lo, rows]: query t sees compressed j of its own sequence iff t >= j*s + l - 1."""
    seq_q = sequence_ids(cu_seqlens, total)[lo:hi]
    pos_q = local_positions(cu_seqlens, total)[lo:hi]
    r = torch.arange(rows, device=cu_seqlens.device)
    seq_c = sequence_ids(cu_seqlens_cmp, rows)
    j = compressed_index(cu_seqlens_cmp, rows)
    valid_c = r < cu_seqlens_cmp[-1]
    last_raw = j * cfg.kernel_stride + cfg.kernel_size - 1
    return (seq_q[:, None] == seq_c[None, :]) & valid_c[None, :] & (pos_q[:, None] >= last_raw[None, :])


def compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cmp: torch.Tensor,
    cfg: NSAConfig,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over the compressed tokens it may see.

    q [total, h, d]; k_cmp, v_cmp [rows, h_kv, d]. Query t (local position) sees compressed
    token j iff t >= j * s + l - 1. Returns o [total, h, d] and lse [total, h] (natural log);
    queries that see nothing give o = 0, lse = -inf.
    """
    dt = _compute_dtype(q)
    total, h, d = q.shape
    rows, h_kv, _ = k_cmp.shape
    g = h // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qg = q.to(dt).view(total, h_kv, g, d)
    k_t = k_cmp.to(dt).transpose(0, 1)
    v_t, bad = _finite_values(v_cmp.to(dt).transpose(0, 1))
    outs, lses = [], []
    for lo, hi in _chunks(total, rows * h):
        mask = _compressed_visibility(cu_seqlens, cu_seqlens_cmp, total, rows, lo, hi, cfg)[:, None, None, :]
        o, lse = _softmax_attend(qg[lo:hi], k_t, v_t, bad, mask, scale)
        outs.append(o)
        lses.append(lse)
    return _cat(outs, (0, h_kv, g, d), q, dt).reshape(total, h, d), _cat(lses, (0, h_kv, g), q, dt).reshape(total, h)


def _cat(parts: list[torch.Tensor], empty_shape: tuple[int, ...], like: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_zeros(empty_shape, dtype=dt)


def block_overlap_weights(cu_seqlens_cmp: torch.Tensor, rows: int, num_blocks: int, cfg: NSAConfig) -> torch.Tensor:
    """W [rows, num_blocks]: overlap of compressed token j with selection block b, in strides.

    |[j*s, j*s + l) ∩ [b*B, (b+1)*B)| / s — for l=32, s=16, B=64 the tokens 4b-1 .. 4b+3 with
    weights 1, 2, 2, 2, 1 (NSA Eq. 9, with the FSA code's offset). Padding rows are zero.
    """
    s, l, bs = cfg.kernel_stride, cfg.kernel_size, cfg.block_size
    r = torch.arange(rows, device=cu_seqlens_cmp.device)
    j = compressed_index(cu_seqlens_cmp, rows)
    b = torch.arange(num_blocks, device=r.device)
    lo = torch.maximum((j * s)[:, None], (b * bs)[None, :])
    hi = torch.minimum((j * s + l)[:, None], ((b + 1) * bs)[None, :])
    w = (hi - lo).clamp(min=0) // s
    return w * (r < cu_seqlens_cmp[-1])[:, None]


def _num_score_blocks(cu_seqlens: torch.Tensor, total: int, cfg: NSAConfig) -> int:
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if total else 0
    return max(cfg.num_blocks(max_len), cfg.topk)


def _block_score_chunks(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, cfg, scale, num_blocks):
    """Yield (lo, hi, scores [hi - lo, h_kv, num_blocks]) with NSA's ranking rules applied:
    forced blocks +inf, blocks after the own block -inf, the rest the group-summed probabilities
    mapped to blocks by the overlap weights."""
    dt = _compute_dtype(q)
    total, h, d = q.shape
    rows, h_kv, _ = k_cmp.shape
    g = h // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    weights = block_overlap_weights(cu_seqlens_cmp, rows, num_blocks, cfg).to(dt)
    own_all = local_positions(cu_seqlens, total) // cfg.block_size
    blocks = torch.arange(num_blocks, device=q.device)
    qg = q.to(dt).view(total, h_kv, g, d)
    k_t = k_cmp.to(dt).transpose(0, 1)
    lse_g = lse_cmp.to(dt).view(total, h_kv, g)
    for lo, hi in _chunks(total, rows * h + num_blocks * h_kv):
        mask = _compressed_visibility(cu_seqlens, cu_seqlens_cmp, total, rows, lo, hi, cfg)[:, None, None, :]
        logits = torch.einsum("chgd,hmd->chgm", qg[lo:hi], k_t) * scale
        lse = lse_g[lo:hi].unsqueeze(-1)
        p = torch.where(mask & torch.isfinite(lse), torch.exp(logits - lse), torch.zeros_like(logits))
        score = p.sum(2) @ weights  # [c, h_kv, num_blocks]
        yield lo, hi, ranked_scores(score, blocks, own_all[lo:hi, None, None], cfg.init_blocks, cfg.local_blocks)


def forced_blocks(blocks: torch.Tensor, own: torch.Tensor, init_blocks: int, local_blocks: int) -> torch.Tensor:
    """bool (blocks and own broadcast): NSA's forced blocks of a token whose own block is ``own``,
    the init_blocks first blocks and the local_blocks blocks ending at the own block (causal
    ones only). The torch twin of ``select_common.forced_score``."""
    return (blocks < init_blocks) | ((blocks > own - local_blocks) & (blocks <= own))


def ranked_scores(score: torch.Tensor, blocks: torch.Tensor, own: torch.Tensor, init_blocks: int,
                  local_blocks: int) -> torch.Tensor:
    """What the top-T ranks: ``score`` with the forced blocks at +inf and the blocks after the
    own block at -inf (prefill's and decode's references alike)."""
    score = torch.where(forced_blocks(blocks, own, init_blocks, local_blocks), float("inf"), score)
    return torch.where(blocks > own, float("-inf"), score)


@torch.no_grad()
def block_scores(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, cfg: NSAConfig, scale: float | None = None) -> torch.Tensor:
    """The scores select_blocks ranks, [total, h_kv, num_blocks] (forced +inf, future -inf).

    Dense over blocks: meant for tests and checks at moderate sizes.
    """
    total = q.shape[0]
    nb = _num_score_blocks(cu_seqlens, total, cfg)
    parts = [s for _, _, s in _block_score_chunks(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, cfg, scale, nb)]
    return torch.cat(parts) if parts else q.new_zeros((0, k_cmp.shape[1], nb), dtype=_compute_dtype(q))


@torch.no_grad()
def select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    lse_cmp: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cmp: torch.Tensor,
    cfg: NSAConfig,
    scale: float | None = None,
) -> torch.Tensor:
    """Top-T selection blocks per token and KV head (NSA Eq. 8–12), int32 [total, h_kv, topk].

    Scores: softmax over the visible compressed tokens (p = exp(q·k_cmp·scale - lse_cmp)), summed
    over the g query heads of a group in fp32, mapped to blocks with the overlap weights. Blocks
    < init_blocks and the local_blocks blocks ending at the own block are forced; blocks after the
    own block are never selected. Ties go to the lower block index. Output rows are ascending,
    valid entries first, -1 padding when fewer than topk blocks are causal.
    """
    total, h_kv = q.shape[0], k_cmp.shape[1]
    nb = _num_score_blocks(cu_seqlens, total, cfg)
    out = []
    for _, _, score in _block_score_chunks(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, cfg, scale, nb):
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., : cfg.topk]
        chosen = torch.where(torch.gather(score, -1, order) > float("-inf"), order, torch.full_like(order, nb))
        chosen = torch.sort(chosen, dim=-1).values
        out.append(torch.where(chosen == nb, torch.full_like(chosen, -1), chosen).to(torch.int32))
    return torch.cat(out) if out else q.new_zeros((0, h_kv, cfg.topk), dtype=torch.int32)


def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over the union of each token's selected blocks, causal in the own block.

    q [total, h, d], k/v [total, h_kv, d], block_idx int32 [total, h_kv, topk] (local block ids,
    -1 = none). Returns o [total, h, d] and lse [total, h]; empty selections give 0 and -inf.
    """
    dt = _compute_dtype(q)
    total, h, d = q.shape
    h_kv, topk = k.shape[1], block_idx.shape[2]
    g = h // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qg = q.to(dt).view(total, h_kv, g, d)
    k32 = k.to(dt)
    v32, bad = _finite_values(v.to(dt))
    start = cu_seqlens.long()[sequence_ids(cu_seqlens, total)]
    pos = local_positions(cu_seqlens, total)
    within = torch.arange(block_size, device=q.device)
    heads = torch.arange(h_kv, device=q.device)[None, :, None]

    def attend(qc, k32, v32, blk, pos_c, start_c):
        key_pos = (blk[..., None] * block_size + within).flatten(2)  # [c, h_kv, T*B] local positions
        valid = (blk >= 0).repeat_interleave(block_size, -1) & (key_pos <= pos_c[:, None, None])
        key = torch.where(valid, key_pos + start_c[:, None, None], torch.zeros_like(key_pos))
        return _softmax_attend(qc, k32[key, heads], v32[key, heads], bad[key, heads], valid[:, :, None, :], scale)

    # With gradients, each chunk's gathered K/V ([c, h_kv, T*B, d] fp32) would stay alive until
    # the backward: 2 * 2048 * 64 * 1024 * 128 * 4 B = 128 GiB for a 2048-token check at h_kv = 64,
    # T*B = 1024 (the longctx OOM). Recompute it there instead.
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs, lses = [], []
    for lo, hi in _chunks(total, h_kv * topk * block_size * (2 * d + g)):
        args = (qg[lo:hi], k32, v32, block_idx[lo:hi].long(), pos[lo:hi], start[lo:hi])
        o, lse = checkpoint(attend, *args, use_reentrant=False) if grad else attend(*args)
        outs.append(o)
        lses.append(lse)
    return _cat(outs, (0, h_kv, g, d), q, dt).reshape(total, h, d), _cat(lses, (0, h_kv, g), q, dt).reshape(total, h)


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    window_size: int,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window causal attention: query t attends keys (t - w, t] of its own sequence.

    q [total, h, d], k/v [total, h_kv, d]. Returns o [total, h, d] and lse [total, h].
    """
    dt = _compute_dtype(q)
    total, h, d = q.shape
    h_kv = k.shape[1]
    g = h // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qg = q.to(dt).view(total, h_kv, g, d)
    k_t = k.to(dt).transpose(0, 1)
    v_t, bad = _finite_values(v.to(dt).transpose(0, 1))
    seq = sequence_ids(cu_seqlens, total)
    step = max(1, min(total, _CHUNK_BUDGET // max(1, (window_size + total) * h)))
    outs, lses = [], []
    for lo in range(0, total, step):
        hi = min(total, lo + step)
        k_lo = max(0, lo - window_size + 1)
        t = torch.arange(lo, hi, device=q.device)[:, None]
        key = torch.arange(k_lo, hi, device=q.device)[None, :]
        mask = (seq[lo:hi, None] == seq[None, k_lo:hi]) & (key <= t) & (key > t - window_size)
        keys = slice(k_lo, hi)
        o, lse = _softmax_attend(qg[lo:hi], k_t[:, keys], v_t[:, keys], bad[:, keys], mask[:, None, None, :], scale)
        outs.append(o)
        lses.append(lse)
    return _cat(outs, (0, h_kv, g, d), q, dt).reshape(total, h, d), _cat(lses, (0, h_kv, g), q, dt).reshape(total, h)


def gated_sum(
    o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor, gate_logits: torch.Tensor
) -> torch.Tensor:
    """o = σ(g_cmp)·o_cmp + σ(g_slc)·o_slc + σ(g_win)·o_win; gate_logits [total, h, 3], o_* [total, h, d]."""
    gates = torch.sigmoid(gate_logits.to(o_cmp.dtype)).unsqueeze(-1)
    return gates[:, :, 0] * o_cmp + gates[:, :, 1] * o_slc + gates[:, :, 2] * o_win


def nsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    gate_logits: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cmp: torch.Tensor,
    cfg: NSAConfig,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All three branches on already-projected (and rotated) tensors; returns (o [total, h, d], block_idx)."""
    o_cmp, lse_cmp = compressed_attention(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, cfg, scale)
    block_idx = select_blocks(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, cfg, scale)
    o_slc, _ = selected_attention(q, k, v, block_idx, cu_seqlens, cfg.block_size, scale)
    o_win, _ = window_attention(q, k, v, cu_seqlens, cfg.window_size, scale)
    return gated_sum(o_cmp, o_slc, o_win, gate_logits), block_idx
