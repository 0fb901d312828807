"""fp32 PyTorch reference of the sliding-window branch (DESIGN §4 step 5), the source of truth for
the flash kernel's "window" mask. Layout and precision: ``ops/reference_common.py``."""

from __future__ import annotations

import math

import torch

from ...varlen import sequence_ids
from ..reference_common import CHUNK_BUDGET, cat_chunks, compute_dtype, finite_values, softmax_attend


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
    dt = compute_dtype(q)
    total, h, d = q.shape
    h_kv = k.shape[1]
    g = h // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qg = q.to(dt).view(total, h_kv, g, d)
    k_t = k.to(dt).transpose(0, 1)
    v_t, bad = finite_values(v.to(dt).transpose(0, 1))
    seq = sequence_ids(cu_seqlens, total)
    step = max(1, min(total, CHUNK_BUDGET // max(1, (window_size + total) * h)))
    outs, lses = [], []
    for lo in range(0, total, step):
        hi = min(total, lo + step)
        k_lo = max(0, lo - window_size + 1)
        t = torch.arange(lo, hi, device=q.device)[:, None]
        key = torch.arange(k_lo, hi, device=q.device)[None, :]
        mask = (seq[lo:hi, None] == seq[None, k_lo:hi]) & (key <= t) & (key > t - window_size)
        keys = slice(k_lo, hi)
        o, lse = softmax_attend(qg[lo:hi], k_t[:, keys], v_t[:, keys], bad[:, keys], mask[:, None, None, :], scale)
        outs.append(o)
        lses.append(lse)
    return cat_chunks(outs, (0, h_kv, g, d), q, dt).reshape(total, h, d), cat_chunks(lses, (0, h_kv, g), q, dt).reshape(total, h)
