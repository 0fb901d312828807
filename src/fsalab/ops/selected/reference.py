"""fp32 PyTorch reference of selected attention (DESIGN §4 step 4): ``selected_attention`` in the
computing precision, the source of truth for every kernel of this package, and
``selected_attention_reference``, the same cast back to q's dtype, behind ``impl="reference"``.
Layout and precision: ``ops/reference_common.py``."""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from ...varlen import local_positions, sequence_ids
from ..reference_common import cat_chunks, compute_dtype, finite_values, query_chunks, softmax_attend


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
    dt = compute_dtype(q)
    total, h, d = q.shape
    h_kv, topk = k.shape[1], block_idx.shape[2]
    g = h // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qg = q.to(dt).view(total, h_kv, g, d)
    k32 = k.to(dt)
    v32, bad = finite_values(v.to(dt))
    start = cu_seqlens.long()[sequence_ids(cu_seqlens, total)]
    pos = local_positions(cu_seqlens, total)
    within = torch.arange(block_size, device=q.device)
    heads = torch.arange(h_kv, device=q.device)[None, :, None]

    def attend(qc, k32, v32, blk, pos_c, start_c):
        key_pos = (blk[..., None] * block_size + within).flatten(2)  # [c, h_kv, T*B] local positions
        valid = (blk >= 0).repeat_interleave(block_size, -1) & (key_pos <= pos_c[:, None, None])
        key = torch.where(valid, key_pos + start_c[:, None, None], torch.zeros_like(key_pos))
        return softmax_attend(qc, k32[key, heads], v32[key, heads], bad[key, heads], valid[:, :, None, :], scale)

    # With gradients, each chunk's gathered K/V ([c, h_kv, T*B, d] fp32) would stay alive until
    # the backward: 2 * 2048 * 64 * 1024 * 128 * 4 B = 128 GiB for a 2048-token check at h_kv = 64,
    # T*B = 1024 (the longctx OOM). Recompute it there instead.
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs, lses = [], []
    for lo, hi in query_chunks(total, h_kv * topk * block_size * (2 * d + g)):
        args = (qg[lo:hi], k32, v32, block_idx[lo:hi].long(), pos[lo:hi], start[lo:hi])
        o, lse = checkpoint(attend, *args, use_reentrant=False) if grad else attend(*args)
        outs.append(o)
        lses.append(lse)
    return cat_chunks(outs, (0, h_kv, g, d), q, dt).reshape(total, h, d), cat_chunks(lses, (0, h_kv, g), q, dt).reshape(total, h)


def selected_attention_reference(q, k, v, block_idx, cu_seqlens, block_size, scale=None):
    o, lse = selected_attention(q, k, v, block_idx, cu_seqlens, block_size, scale)
    return o.to(q.dtype), lse.float() if q.dtype != torch.float64 else lse
