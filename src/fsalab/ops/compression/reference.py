"""fp32 PyTorch reference of the compression branch (DESIGN §4 steps 1–2): ``compress_kv`` and
``compressed_attention``, the source of truth for ``compress_kv.py`` and the flash kernel's
"compressed" mask. Layout and precision: ``ops/reference_common.py``."""

from __future__ import annotations

import math

import torch

from ...config import NSAConfig
from ...varlen import compressed_capacity, compressed_cu_seqlens, compressed_index, local_positions, sequence_ids
from ..reference_common import cat_chunks, compute_dtype, finite_values, query_chunks, softmax_attend


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
    dt = compute_dtype(k)
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


def compressed_visibility(
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
    dt = compute_dtype(q)
    total, h, d = q.shape
    rows, h_kv, _ = k_cmp.shape
    g = h // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qg = q.to(dt).view(total, h_kv, g, d)
    k_t = k_cmp.to(dt).transpose(0, 1)
    v_t, bad = finite_values(v_cmp.to(dt).transpose(0, 1))
    outs, lses = [], []
    for lo, hi in query_chunks(total, rows * h):
        mask = compressed_visibility(cu_seqlens, cu_seqlens_cmp, total, rows, lo, hi, cfg)[:, None, None, :]
        o, lse = softmax_attend(qg[lo:hi], k_t, v_t, bad, mask, scale)
        outs.append(o)
        lses.append(lse)
    return cat_chunks(outs, (0, h_kv, g, d), q, dt).reshape(total, h, d), cat_chunks(lses, (0, h_kv, g), q, dt).reshape(total, h)
