"""Block -> token index lists for KV-block-outer work (FSA forward/backward, NSA dK/dV).

``block_idx`` lists, per token and KV head, the blocks the token attends. KV-block-outer
kernels need the transpose: per (KV head, block), the tokens that selected it. This module
builds that transpose as CSR lists on device, for the whole packed batch and every KV head
in one pass, without host syncs and in O(total * h_kv * topk) memory (no dense N x blocks
table). The construction is a stable sort of the flattened ``block_idx`` entries keyed by
their CSR row, so the output is deterministic and tokens come out ascending within a row
(entries are enumerated token-major).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...varlen import sequence_ids


@dataclass(frozen=True)
class SelectionIndex:
    """CSR lists of the (token, slot) entries that selected each (KV head, block).

    Rows are ``kv_head * block_capacity + global_block``; a sequence's blocks are numbered
    globally from ``block_offsets[seq]``. Rows past the batch's real block count are empty.

    block_offsets  int32 [batch + 1]: global id of each sequence's first block
                   (exclusive cumsum of ceil(n_b / block_size)).
    row_ptr        int32 [h_kv * block_capacity + 1]: CSR offsets into token_ids/entry_slot.
    token_ids      int32 [total * h_kv * topk]: packed token index of each entry, grouped by row,
                   ascending within a row; only the first row_ptr[-1] entries are meaningful.
    entry_slot     int32 [total * h_kv * topk]: the slot k (0..topk-1) of block_idx behind each entry.
    slot_pos       int32 [total, h_kv, topk]: position in token_ids of each (token, head, slot);
                   -1 for padding slots.
    block_capacity host int: upper bound on the batch's block count, total // block_size + batch.
    """

    block_offsets: torch.Tensor
    row_ptr: torch.Tensor
    token_ids: torch.Tensor
    entry_slot: torch.Tensor
    slot_pos: torch.Tensor
    block_capacity: int


def block_capacity(total_tokens: int, batch: int, block_size: int) -> int:
    """Blocks of any batch of ``batch`` sequences and ``total_tokens`` tokens, at most.

    sum_b ceil(n_b / B) <= sum_b floor(n_b / B) + batch <= total // B + batch, so buffers of
    this size need no host sync to be allocated.
    """
    return total_tokens // block_size + batch


def sequence_block_offsets(cu_seqlens: torch.Tensor, block_size: int) -> torch.Tensor:
    """int32 [batch + 1]: global id of each sequence's first block, then the total block count."""
    n = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    offsets = torch.zeros_like(cu_seqlens)
    offsets[1:] = torch.cumsum((n + block_size - 1) // block_size, 0).to(torch.int32)
    return offsets


@torch.no_grad()
def build_selection_index(block_idx: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int) -> SelectionIndex:
    """Transpose block_idx int32 [total, h_kv, topk] (local block ids, -1 padding) into CSR lists.

    Entries with block_idx < 0 are left out (their slot_pos is -1). Runs on block_idx's device
    with no host synchronisation; every output is sized from shapes only.
    """
    total, h_kv, topk = block_idx.shape
    device = block_idx.device
    batch = cu_seqlens.numel() - 1
    capacity = block_capacity(total, batch, block_size)
    num_rows = h_kv * capacity
    offsets = sequence_block_offsets(cu_seqlens, block_size)

    seq = sequence_ids(cu_seqlens, total).clamp(max=max(batch - 1, 0))
    first_block = offsets.long()[seq][:, None, None]  # [total, 1, 1]
    heads = torch.arange(h_kv, device=device)[None, :, None] * capacity
    blk = block_idx.long()
    valid = blk >= 0
    # Padding slots sort after every real row (key num_rows), so they never enter row_ptr.
    rows = torch.where(valid, heads + first_block + blk, torch.full_like(blk, num_rows)).flatten()

    # Token-major enumeration + stable sort = tokens ascending inside each row, deterministically.
    key = rows.to(torch.int32) if num_rows < 2**31 - 1 else rows
    sorted_key, order = torch.sort(key, stable=True)
    # row_ptr[r] = number of entries in rows < r: a search in the sorted keys, no atomics.
    row_ptr = torch.searchsorted(sorted_key, torch.arange(num_rows + 1, dtype=key.dtype, device=device))
    row_ptr = row_ptr.to(torch.int32)

    per_token = h_kv * topk
    token_ids = (order // per_token).to(torch.int32)
    entry_slot = (order % topk).to(torch.int32)
    slot_pos = torch.empty(total * per_token, dtype=torch.int32, device=device)
    slot_pos[order] = torch.arange(order.numel(), dtype=torch.int32, device=device)
    slot_pos = torch.where(valid.flatten(), slot_pos, torch.full_like(slot_pos, -1)).view(total, h_kv, topk)
    return SelectionIndex(offsets, row_ptr, token_ids, entry_slot, slot_pos, capacity)


def block_spans(
    index: SelectionIndex, cu_seqlens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per global block, int32 [block_capacity] each: packed index of its first key, its number of
    keys (0 for ids past the batch's last block), and its block index inside its own sequence."""
    offsets = index.block_offsets
    batch = offsets.numel() - 1
    blk = torch.arange(index.block_capacity, dtype=torch.int32, device=offsets.device)
    # Empty sequences repeat an offset; right=True lands on the sequence that owns the block.
    seq = torch.searchsorted(offsets[1:].contiguous(), blk, right=True).clamp_(max=batch - 1)
    local = blk - offsets[seq]
    start = cu_seqlens[seq] + local * block_size
    length = torch.where(blk < offsets[-1], (cu_seqlens[seq + 1] - start).clamp(0, block_size), 0)
    return start.to(torch.int32), length.to(torch.int32), local.to(torch.int32)
