"""The reference behind ``impl="reference"``: fp32 math, results cast back to q's dtype."""

from __future__ import annotations

import torch

from .. import reference


def selected_attention_reference(q, k, v, block_idx, cu_seqlens, block_size, scale=None):
    o, lse = reference.selected_attention(q, k, v, block_idx, cu_seqlens, block_size, scale)
    return o.to(q.dtype), lse.float() if q.dtype != torch.float64 else lse
