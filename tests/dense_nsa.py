"""An independent formulation of NSA used only to check the ops' fp32 references
(``fsalab.ops.<op>.reference``).

Per sequence it builds each branch's boolean [tokens x keys] mask explicitly and runs a plain
masked softmax; compression uses Tensor.unfold, block weights and top-k use Python loops over
blocks and candidates. Slow on purpose: it shares no code with the reference.
"""

from __future__ import annotations

import math

import torch

from fsalab.config import NSAConfig


def _masked_softmax_attention(q, k, v, mask, scale):
    """q [n, h, d], k/v [m, h_kv, d], mask [h_kv or 1, n, m] -> o [n, h, d] (0 where nothing is visible)."""
    h, h_kv = q.shape[1], k.shape[1]
    g = h // h_kv
    kk = k.repeat_interleave(g, 1).transpose(0, 1)  # [h, m, d]
    vv = v.repeat_interleave(g, 1).transpose(0, 1)
    m = mask.repeat_interleave(g, 0) if mask.shape[0] == h_kv else mask.expand(h, -1, -1)
    s = (q.transpose(0, 1) @ kk.transpose(1, 2)) * scale
    s = s.masked_fill(~m, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vv).transpose(0, 1), s


def dense_compress(k, v, w_k, w_v, pe, cfg: NSAConfig):
    """One sequence: k/v [n, h_kv, d] -> k_cmp, v_cmp [n_cmp, h_kv, d]."""
    n, h_kv, d = k.shape
    l, s = cfg.kernel_size, cfg.kernel_stride
    if n < l:
        return k.new_zeros(0, h_kv, d), v.new_zeros(0, h_kv, d)
    kw = k.unfold(0, l, s).permute(0, 1, 3, 2)  # [n_cmp, h_kv, l, d]
    vw = v.unfold(0, l, s).permute(0, 1, 3, 2)
    kw = kw + pe[None]
    k_cmp = torch.stack([kw[:, hh].flatten(1) @ w_k[hh] for hh in range(h_kv)], 1)
    v_cmp = torch.stack([vw[:, hh].flatten(1) @ w_v[hh] for hh in range(h_kv)], 1)
    return k_cmp, v_cmp


def dense_block_weights(n_cmp: int, n_blocks: int, cfg: NSAConfig) -> torch.Tensor:
    """W[j, b] = tokens shared by compressed token j and block b, in units of the stride."""
    w = torch.zeros(n_cmp, n_blocks, dtype=torch.float64)
    for j in range(n_cmp):
        for b in range(n_blocks):
            start, end = j * cfg.kernel_stride, j * cfg.kernel_stride + cfg.kernel_size
            overlap = max(0, min(end, (b + 1) * cfg.block_size) - max(start, b * cfg.block_size))
            w[j, b] = overlap // cfg.kernel_stride
    return w


def dense_topk(scores: torch.Tensor, cfg: NSAConfig) -> torch.Tensor:
    """scores [h_kv, n, n_blocks] (float64) -> block ids [n, h_kv, topk] with the NSA rules, -1 padded."""
    h_kv, n, _ = scores.shape
    out = torch.full((n, h_kv, cfg.topk), -1, dtype=torch.int32)
    for t in range(n):
        own = t // cfg.block_size
        for hh in range(h_kv):
            forced = {b for b in range(min(cfg.init_blocks, own + 1))}
            forced |= {b for b in range(max(0, own - cfg.local_blocks + 1), own + 1)}
            ranked = sorted(range(own + 1), key=lambda b: (b not in forced, -float(scores[hh, t, b]), b))
            chosen = sorted(ranked[: cfg.topk])
            out[t, hh, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


def dense_nsa_sequence(q, k, v, w_k, w_v, pe, gate_logits, cfg: NSAConfig, scale=None):
    """One sequence, all branches: returns dict of o_cmp, o_slc, o_win, o, block_idx, k_cmp, v_cmp."""
    n, h, d = q.shape
    h_kv = k.shape[1]
    g = h // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    t = torch.arange(n)[:, None]
    k_cmp, v_cmp = dense_compress(k, v, w_k, w_v, pe, cfg)
    n_cmp = k_cmp.shape[0]
    j = torch.arange(n_cmp)[None, :]
    cmp_mask = (t >= j * cfg.kernel_stride + cfg.kernel_size - 1)[None]
    o_cmp, s_cmp = _masked_softmax_attention(q, k_cmp, v_cmp, cmp_mask, scale)
    p_cmp = torch.softmax(s_cmp.double(), -1).nan_to_num(0.0)  # [h, n, n_cmp]
    n_blocks = -(-n // cfg.block_size)
    group_p = p_cmp.view(h_kv, g, n, n_cmp).sum(1)
    scores = group_p @ dense_block_weights(n_cmp, n_blocks, cfg)
    block_idx = dense_topk(scores, cfg)
    selected = torch.zeros(h_kv, n, n_blocks, dtype=torch.bool)
    for hh in range(h_kv):
        for slot in range(cfg.topk):
            ids = block_idx[:, hh, slot]
            rows = (ids >= 0).nonzero().flatten()
            selected[hh, rows, ids[rows].long()] = True
    key = torch.arange(n)[None, :]
    slc_mask = selected[:, :, key[0] // cfg.block_size] & (key <= t)[None]
    o_slc, _ = _masked_softmax_attention(q, k, v, slc_mask, scale)
    win_mask = ((key <= t) & (key > t - cfg.window_size))[None]
    o_win, _ = _masked_softmax_attention(q, k, v, win_mask, scale)
    gates = torch.sigmoid(gate_logits)
    o = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win
    return {"o_cmp": o_cmp, "o_slc": o_slc, "o_win": o_win, "o": o, "block_idx": block_idx, "k_cmp": k_cmp, "v_cmp": v_cmp}
