"""Packed variable-length bookkeeping, computed on device without host syncs."""

from __future__ import annotations

import torch


def sequence_ids(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Index of the sequence each packed token belongs to, int64 [total_tokens]."""
    tokens = torch.arange(total_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True)


def local_positions(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Position of every packed token inside its own sequence, int64 [total_tokens]."""
    tokens = torch.arange(total_tokens, device=cu_seqlens.device)
    return tokens - cu_seqlens.long()[sequence_ids(cu_seqlens, total_tokens)]


def compressed_cu_seqlens(cu_seqlens: torch.Tensor, kernel_size: int, kernel_stride: int) -> torch.Tensor:
    """Offsets of each sequence's compressed tokens, int32 [batch + 1].

    A sequence of n tokens has floor((n - l) / s) + 1 compressed tokens (0 when n < l).
    """
    n = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n_cmp = torch.where(n >= kernel_size, (n - kernel_size) // kernel_stride + 1, torch.zeros_like(n))
    out = torch.zeros_like(cu_seqlens)
    out[1:] = torch.cumsum(n_cmp, 0).to(cu_seqlens.dtype)
    return out


def compressed_capacity(total_tokens: int, kernel_stride: int) -> int:
    """Rows of a compressed-token buffer that fits every batch of total_tokens tokens.

    Each sequence has at most floor(n / s) compressed tokens (l >= s), and the sum of floors is at
    most floor(total / s), so buffers of this size need no host sync to be allocated.
    """
    return total_tokens // kernel_stride


def compressed_index(cu_seqlens_cmp: torch.Tensor, rows: int) -> torch.Tensor:
    """Local index j of every row of a compressed buffer within its sequence, int64 [rows].

    Padding rows past cu_seqlens_cmp[-1] get indices continuing the last sequence; mask them
    with ``torch.arange(rows) < cu_seqlens_cmp[-1]``.
    """
    seq = sequence_ids(cu_seqlens_cmp, rows).clamp(max=cu_seqlens_cmp.numel() - 2)
    return torch.arange(rows, device=cu_seqlens_cmp.device) - cu_seqlens_cmp.long()[seq]
