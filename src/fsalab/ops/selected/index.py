"""Block -> token index lists for KV-block-outer work (FSA forward/backward, NSA dK/dV).

``block_idx`` lists, per token and KV head, the blocks the token attends. KV-block-outer
kernels need the transpose: per (KV head, block), the tokens that selected it. This module
builds that transpose as CSR lists on device, for the whole packed batch and every KV head
in one pass, without host syncs and in O(total * h_kv * topk) memory (no dense N x blocks
table). The construction is a stable sort of the flattened ``block_idx`` entries keyed by
their CSR row, so the output is deterministic and tokens come out ascending within a row
(entries are enumerated token-major). Around the sort, two small Triton kernels
(``index_kernels``) compute the keys and unpack the sorted order: three launches in all, since
the host time to enqueue many small ops, not the GPU, bounds short calls.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import scratch
from .._triton import cdiv, next_pow2, search_steps
from .index_kernels import _csr_kernel, _entry_keys_kernel, _token_start_kernel

# Elements per program of the planning kernels (the interpreter pays per program, the GPU
# needs no more: these kernels are a few microseconds each).
_BLOCK = 1024
# CSR rows per program of _csr_kernel: each runs two binary searches (~log2 entries loads).
_BLOCK_ROWS = 128


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
    block_start    int32 [block_capacity]: packed index of each global block's first key.
    block_len      int32 [block_capacity]: its number of keys (0 past the batch's real blocks).
    block_local    int32 [block_capacity]: its block index inside its own sequence.
    block_capacity host int: upper bound on the batch's block count, total // block_size + batch.
    """

    block_offsets: torch.Tensor
    row_ptr: torch.Tensor
    token_ids: torch.Tensor
    entry_slot: torch.Tensor
    slot_pos: torch.Tensor
    block_start: torch.Tensor
    block_len: torch.Tensor
    block_local: torch.Tensor
    block_capacity: int

    def tensors(self) -> list[torch.Tensor]:
        """The eight tensors in field order: how an index crosses a torch.library op's schema."""
        return [self.block_offsets, self.row_ptr, self.token_ids, self.entry_slot, self.slot_pos, self.block_start,
                self.block_len, self.block_local]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor]) -> SelectionIndex:
        """The index whose ``tensors()`` these are (block_capacity is block_start's length)."""
        return cls(*tensors, tensors[5].shape[0])


def block_capacity(total_tokens: int, batch: int, block_size: int) -> int:
    """Blocks of any batch of ``batch`` sequences and ``total_tokens`` tokens, at most.

    sum_b ceil(n_b / B) <= sum_b floor(n_b / B) + batch <= total // B + batch, so buffers of
    this size need no host sync to be allocated.
    """
    return total_tokens // block_size + batch


def empty_index(block_idx: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int,
                in_scratch: bool = False) -> SelectionIndex:
    """An index of unwritten tensors with the shapes ``build_selection_index`` gives these inputs
    (it fills one; the ops' fake kernels return one); ``in_scratch``: the caller's scratch
    (``ops.scratch``), for lists that do not outlive its call."""
    total, h_kv, topk = block_idx.shape
    capacity = block_capacity(total, cu_seqlens.shape[0] - 1, block_size)
    n = total * h_kv * topk
    empty = functools.partial(scratch.empty if in_scratch else torch.empty, dtype=torch.int32, device=block_idx.device)
    return SelectionIndex(empty(cu_seqlens.shape[0]), empty(h_kv * capacity + 1), empty(n), empty(n),
                          empty(n).view(total, h_kv, topk), empty(capacity), empty(capacity), empty(capacity), capacity)


@torch.no_grad()
def build_selection_index(block_idx: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int,
                          in_scratch: bool = False) -> SelectionIndex:
    """Transpose block_idx int32 [total, h_kv, topk] (local block ids, -1 padding) into CSR lists.

    Entries with block_idx < 0 are left out (their slot_pos is -1). Runs on block_idx's device
    with no host synchronisation; every output is sized from shapes only. Launches: the key
    kernel, torch.sort, the unpacking kernel. ``in_scratch``: the lists are the caller's scratch
    (``ops.scratch``: a backward's own lists, not kept after its call).
    """
    total, h_kv, topk = block_idx.shape
    n = total * h_kv * topk
    if n >= 2**31:
        raise ValueError(f"the selection index addresses entries with int32: total * h_kv * topk = {n} >= 2**31")
    out = empty_index(block_idx, cu_seqlens, block_size, in_scratch)
    batch, capacity = cu_seqlens.numel() - 1, out.block_capacity
    num_rows = h_kv * capacity
    block_idx = block_idx.contiguous()
    cu = cu_seqlens.contiguous()
    pad_key = h_kv * total  # sorts after every valid key (see index_kernels)
    batch_steps = search_steps(batch)

    keys = scratch.empty(n, torch.int32, block_idx.device)
    per_token = h_kv * topk
    ht_pad = next_pow2(per_token)
    tok = max(1, _BLOCK // ht_pad)
    _entry_keys_kernel[(max(1, cdiv(total, tok)),)](
        block_idx, cu, keys, out.block_offsets, total, batch, batch_steps, topk, block_size, pad_key,
        HT=per_token, HT_PAD=ht_pad, TOK=tok, BLOCK_B=_BLOCK, num_warps=4,
    )
    # Token-major enumeration + stable sort = tokens ascending inside each row, deterministically.
    sorted_key, order = scratch.empty(n, torch.int32, keys.device), scratch.empty(n, torch.int64, keys.device)
    torch.sort(keys, stable=True, out=(sorted_key, order))

    grid = max(cdiv(n, _BLOCK), cdiv(num_rows + 1, _BLOCK_ROWS))
    _csr_kernel[(grid,)](
        sorted_key, order, out.token_ids, out.entry_slot, out.slot_pos, out.row_ptr, out.block_start, out.block_len,
        out.block_local, out.block_offsets, cu, n, search_steps(n), per_token, topk, total, capacity, num_rows, batch,
        batch_steps, block_size, pad_key, BLOCK_E=_BLOCK, BLOCK_R=_BLOCK_ROWS, num_warps=4,
    )
    return out


def token_starts(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int32 [total]: packed index of the first token of each token's sequence (one launch)."""
    cu = cu_seqlens.contiguous()
    batch = cu.numel() - 1
    out = torch.empty(total, dtype=torch.int32, device=cu.device)
    if total > 0:
        _token_start_kernel[(cdiv(total, _BLOCK),)](cu, out, total, batch, search_steps(batch), BLOCK=_BLOCK)
    return out
