"""Compression branch of NSA (DESIGN §4 steps 1–2): the Triton ops the module calls.

``compress_kv`` (linear compression of each window of l keys/values, ``compress_kv.py``) and
``compressed_attention`` (the shared FlashAttention kernels of ``ops/flash.py`` with the
"compressed" mask): the counterparts of ``reference.py``'s functions of the same names, with the
same signatures. The top-T selection that ranks blocks from the compressed attention is
``ops/topk``.
"""

from __future__ import annotations

import torch

from ...config import NSAConfig
from .compress_kv import compress_kv, compressed_offsets

__all__ = ["compress_kv", "compressed_attention", "compressed_offsets"]


def compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cmp: torch.Tensor,
    cfg: NSAConfig,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over the compressed tokens it may see; differentiable in q, k_cmp, v_cmp.

    q [total, h, d]; k_cmp, v_cmp [rows, h_kv, d] in the layout of ``compress_kv`` (rows =
    total // kernel_stride; sequence b's compressed tokens at cu_seqlens_cmp[b]..[b+1], rows past
    cu_seqlens_cmp[-1] are padding: never read, zero gradient). Query t (local position) sees
    compressed j iff t >= j * kernel_stride + kernel_size - 1. Returns o [total, h, d] in q.dtype
    and lse [total, h] fp32 (natural log); queries that see nothing give o = 0, lse = -inf.
    """
    from ..flash import flash_attention

    if not isinstance(cfg, NSAConfig):
        raise TypeError(f"cfg must be an NSAConfig, got {type(cfg).__name__}")
    return flash_attention(
        q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, mask="compressed",
        kernel_size=cfg.kernel_size, kernel_stride=cfg.kernel_stride, scale=scale,
    )
