"""fp32 PyTorch reference of an NSA decode step (DESIGN §9); the source of truth for ``step.py``.

One new token per sequence of an ``NSADecodeCache``: ``append_token`` rotates and appends it (and
the compressed token it completes) op by op; ``nsa_decode`` attends with it (already appended:
its key and value are the last cached token, ``lengths`` counts it), dense over the cache
capacity with masks, so it is written independently of the prefill path that the tests compare
it with; meant for tests and small shapes.
"""

from __future__ import annotations

import math

import torch

from ...config import NSAConfig
from ..gate.reference import gated_sum
from ..reference_common import compute_dtype, finite_values, softmax_attend
from ..topk.reference import ranked_scores
from .cache import NSADecodeCache, compression_window


def compress_step(
    cache: NSADecodeCache, w_k: torch.Tensor, w_v: torch.Tensor, pe: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's compressed token over its last l raw tokens (NSA Eq. 7), before RoPE:
    (k_cmp, v_cmp) [batch, h_kv, d] in the cache dtype; meaningful where the cache's
    ``new_compressed`` says a token is completed. w_k, w_v [h_kv, l*d, d]; pe [h_kv, l, d]."""
    k_win, v_win = compression_window(cache)  # [batch, l, h_kv, d]
    dt = compute_dtype(k_win)
    batch, l, h_kv, d = k_win.shape
    # k + pe rounds once to the cache dtype, as prefill's compression does.
    k_win = (k_win.to(dt) + pe.to(dt).transpose(0, 1)).to(k_win.dtype).to(dt)
    k_cmp = torch.einsum("bhx,hxd->bhd", k_win.transpose(1, 2).reshape(batch, h_kv, l * d), w_k.to(dt))
    v_cmp = torch.einsum("bhx,hxd->bhd", v_win.to(dt).transpose(1, 2).reshape(batch, h_kv, l * d), w_v.to(dt))
    return k_cmp.to(cache.dtype), v_cmp.to(cache.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> torch.Tensor:
    """RoPE (rotate-half) of x [tokens, heads, d] at int positions [tokens], computed in fp32 (fp64
    for fp64 x) from the fp32 angles position · inv_freq and rounded once to x's dtype: the
    decode kernels' rounding (``modules.rope.apply_rope``, like HF, rounds cos/sin first)."""
    dt = compute_dtype(x)
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    cos = (torch.cos(angles.to(dt)) * attention_scaling)[:, None, :]
    sin = (torch.sin(angles.to(dt)) * attention_scaling)[:, None, :]
    x1, x2 = x.to(dt).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


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
    """A decode step's bookkeeping, op by op; returns q rotated [batch, h, d].

    q [batch, h, d] and k [batch, h_kv, d] (before RoPE) are rotated at position lengths[b]; k, k
    before RoPE and v appended (``NSADecodeCache.append``, lengths advanced); where the new length
    completes a compressed token, it is computed (``compress_step``), its key rotated at its
    window's first token and both stored (``write_compressed``). RoPE: ``rope``.
    """
    cache.check_token(q, k, v, w_k, w_v, pe, inv_freq)
    pos = cache.lengths.long()
    q_rot = rope(q, pos, inv_freq, attention_scaling)
    cache.append(rope(k, pos, inv_freq, attention_scaling), k, v)
    _, row = cache.new_compressed()
    k_cmp, v_cmp = compress_step(cache, w_k, w_v, pe)
    window_start = (cache.lengths.long() - cache.cfg.kernel_size).clamp(min=0)
    cache.write_compressed(rope(k_cmp, window_start, inv_freq, attention_scaling), v_cmp, row)
    return q_rot


def _overlap_weights(rows: int, num_blocks: int, cfg: NSAConfig, device: torch.device) -> torch.Tensor:
    """W [rows, num_blocks]: strides of compressed token j's window inside block b."""
    s, l, bs = cfg.kernel_stride, cfg.kernel_size, cfg.block_size
    j = torch.arange(rows, device=device)[:, None]
    b = torch.arange(num_blocks, device=device)[None, :]
    lo = torch.maximum(j * s, b * bs)
    hi = torch.minimum(j * s + l, (b + 1) * bs)
    return (hi - lo).clamp(min=0) // s


def nsa_decode(
    q: torch.Tensor, cache: NSADecodeCache, gate_logits: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's attention: (o [batch, h, d] fp32, block_idx int32 [batch, h_kv, topk]).

    q [batch, h, d] after RoPE; gate_logits [batch, h, 3]. Query of sequence b sits at position
    t = lengths[b] - 1 and sees: every cached compressed token (compressed branch); the top-T
    blocks scored from them as in prefill (forced init / local blocks, ties to the lower block,
    -1 padding), causal (selected branch); keys (t - w, t] (window branch). Gated sum of the three.
    """
    cfg = cache.cfg
    dt = compute_dtype(q)
    batch, h, d = q.shape
    h_kv = cache.num_kv_heads
    g = h // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    dev = q.device
    n = cache.lengths.long()  # [batch]
    qg = q.to(dt).view(batch, h_kv, g, d)
    l, s, bs = cfg.kernel_size, cfg.kernel_stride, cfg.block_size

    # Compressed branch: tokens j < n_cmp (the query at t = n - 1 sees j iff t >= j*s + l - 1).
    rows = cache.k_cmp.shape[1] - 1  # the scratch row is never read
    k_c = cache.k_cmp[:, :rows].to(dt).transpose(1, 2)  # [batch, h_kv, rows, d]
    v_c, bad_c = finite_values(cache.v_cmp[:, :rows].to(dt).transpose(1, 2))
    n_cmp = torch.where(n >= l, (n - l) // s + 1, torch.zeros_like(n))
    vis_c = torch.arange(rows, device=dev)[None, :] < n_cmp[:, None]  # [batch, rows]
    o_cmp, lse_cmp = softmax_attend(qg, k_c, v_c, bad_c, vis_c[:, None, None, :], scale)

    # Block scores and top-T.
    cap = cache.capacity
    nb = max(cfg.num_blocks(cap), cfg.topk)
    logits = torch.einsum("bhgd,bhmd->bhgm", qg, k_c) * scale
    lse = lse_cmp.unsqueeze(-1)
    p = torch.where(vis_c[:, None, None, :] & torch.isfinite(lse), torch.exp(logits - lse), torch.zeros_like(logits))
    score = p.sum(2) @ _overlap_weights(rows, nb, cfg, dev).to(dt)  # [batch, h_kv, nb]
    own = ((n - 1) // bs)[:, None, None]
    blocks = torch.arange(nb, device=dev)
    score = ranked_scores(score, blocks, own, cfg.init_blocks, cfg.local_blocks)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., : cfg.topk]
    chosen = torch.where(torch.gather(score, -1, order) > float("-inf"), order, torch.full_like(order, nb))
    chosen = torch.sort(chosen, dim=-1).values
    block_idx = torch.where(chosen == nb, torch.full_like(chosen, -1), chosen).to(torch.int32)

    # Selected and window branches over the raw cache (the scratch row is never read).
    k_r = cache.k[:, :cap].to(dt).transpose(1, 2)  # [batch, h_kv, cap, d]
    v_r, bad_r = finite_values(cache.v[:, :cap].to(dt).transpose(1, 2))
    key = torch.arange(cap, device=dev)
    causal = key[None, :] < n[:, None]  # [batch, cap]
    in_sel = torch.zeros(batch, h_kv, nb + 1, dtype=torch.bool, device=dev)
    in_sel.scatter_(-1, torch.where(block_idx >= 0, block_idx.long(), nb), True)
    sel = in_sel[..., key // bs] & causal[:, None, :]  # [batch, h_kv, cap]
    o_slc, _ = softmax_attend(qg, k_r, v_r, bad_r, sel[:, :, None, :], scale)
    win = causal & (key[None, :] >= n[:, None] - cfg.window_size)
    o_win, _ = softmax_attend(qg, k_r, v_r, bad_r, win[:, None, None, :], scale)

    shape = (batch, h, d)
    o = gated_sum(o_cmp.reshape(shape), o_slc.reshape(shape), o_win.reshape(shape), gate_logits.to(dt))
    return o, block_idx
