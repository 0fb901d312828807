"""PyTorch reference of NSA's gated sum of the three branches (DESIGN §4 step 6), the source of
truth for ``fused.py``."""

from __future__ import annotations

import torch


def gated_sum(
    o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor, gate_logits: torch.Tensor
) -> torch.Tensor:
    """o = σ(g_cmp)·o_cmp + σ(g_slc)·o_slc + σ(g_win)·o_win; gate_logits [total, h, 3], o_* [total, h, d]."""
    gates = torch.sigmoid(gate_logits.to(o_cmp.dtype)).unsqueeze(-1)
    return gates[:, :, 0] * o_cmp + gates[:, :, 1] * o_slc + gates[:, :, 2] * o_win
