"""Triton kernels of ``index.build_selection_index``: the prologue and epilogue around one sort.

The CSR transpose of block_idx is a stable sort of the flattened entries by a row key; these two
kernels replace the ~40 small torch ops that computed the keys and then unpacked the sort:

- ``_entry_keys_kernel`` (before the sort): each entry's key, and the per-sequence block offsets
  (program 0 alone: a scan over the batch, so no other launch is needed for it).
- ``_csr_kernel`` (after the sort): token ids, slots and the inverse permutation of the entries;
  row_ptr by a binary search per row in the sorted keys; the global block table.

Key of a valid entry (token t of sequence s, KV head hk, block b): ``hk * total + cu[s] + b * B``,
the packed index of the block's first key offset by the head. Global block ids are numbered in
the same order (heads, then sequences, then blocks), so the sort orders rows exactly as the
row ids ``hk * capacity + global_block`` would, and the key needs no block offsets, which
would take a scan of their own. Padding entries get ``h_kv * total``, past every valid key.
All positions are int32: callers keep ``total * h_kv * topk < 2**31``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._search import count_below


@triton.jit
def _entry_keys_kernel(
    block_idx, cu_seqlens, keys, block_offsets,
    total, batch, batch_steps, topk, block_size, pad_key,
    HT: tl.constexpr, HT_PAD: tl.constexpr, TOK: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """Keys of TOK tokens x HT = h_kv * topk entries per program; program 0 also writes
    block_offsets [batch + 1] (exclusive scan of ceil(n_b / B))."""
    pid = tl.program_id(0)
    t = pid * TOK + tl.arange(0, TOK)
    tmask = t < total
    # Sequence of each token: the count of sequence ends cu[1:] <= t (searchsorted right).
    seq = count_below(cu_seqlens + 1, batch, t, batch_steps, True)
    start = tl.load(cu_seqlens + seq, mask=tmask, other=0)
    e = tl.arange(0, HT_PAD)
    emask = tmask[:, None] & (e < HT)[None, :]
    offs = t[:, None] * HT + e[None, :]
    blk = tl.load(block_idx + offs, mask=emask, other=-1)
    head_base = (e // topk) * total
    key = tl.where(blk >= 0, head_base[None, :] + start[:, None] + blk * block_size, pad_key)
    tl.store(keys + offs, key, mask=emask)

    if pid == 0:
        carry = tl.zeros([], tl.int32)
        for b0 in range(0, batch, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            bmask = b < batch
            n = tl.load(cu_seqlens + b + 1, mask=bmask, other=0) - tl.load(cu_seqlens + b, mask=bmask, other=0)
            nb = (n + block_size - 1) // block_size
            # Exclusive scan: offsets[b] = blocks of the sequences before b.
            tl.store(block_offsets + b, carry + tl.cumsum(nb, 0) - nb, mask=bmask)
            carry += tl.sum(nb, 0)
        tl.store(block_offsets + batch, carry)


@triton.jit
def _csr_kernel(
    sorted_key, order, token_ids, entry_slot, slot_pos, row_ptr, blk_start, blk_len, blk_local,
    block_offsets, cu_seqlens,
    n_entries, entry_steps, per_token, topk, total, cap, rows, batch, batch_steps, block_size, pad_key,
    BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Program p unpacks sorted entries [p * BLOCK_E, +BLOCK_E) and CSR rows [p * BLOCK_R, +BLOCK_R)
    (rows 0..rows, the last one being row_ptr's end); the rows of head 0 also write the table."""
    pid = tl.program_id(0)
    p = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    pmask = p < n_entries
    src = tl.load(order + p, mask=pmask, other=0)  # flat (token, head, slot) index of entry p
    key = tl.load(sorted_key + p, mask=pmask, other=0)
    tl.store(token_ids + p, (src // per_token).to(tl.int32), mask=pmask)
    tl.store(entry_slot + p, (src % topk).to(tl.int32), mask=pmask)
    # The sort is a permutation, so every slot_pos element is written exactly once.
    tl.store(slot_pos + src, tl.where(key < pad_key, p, -1), mask=pmask)

    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r <= rows
    cap1 = tl.maximum(cap, 1)  # cap = 0 only for an empty batch (rows = 0)
    hk = r // cap1
    gb = r - hk * cap1
    # Sequence owning global block gb (empty sequences repeat an offset: count those <= gb).
    seq = count_below(block_offsets + 1, batch, gb, batch_steps, True)
    seq = tl.maximum(tl.minimum(seq, batch - 1), 0)
    n_blocks = tl.load(block_offsets + batch)
    real = gb < n_blocks
    local = gb - tl.load(block_offsets + seq, mask=rmask, other=0)
    start = tl.load(cu_seqlens + seq, mask=rmask, other=0) + local * block_size
    length = tl.load(cu_seqlens + seq + 1, mask=rmask, other=0) - start
    length = tl.where(real, tl.minimum(tl.maximum(length, 0), block_size), 0)
    # row_ptr[r] = entries whose key sorts before row r's: its block's key, the next head's first
    # key for rows past the batch's blocks (empty rows), and past every valid key for the end.
    target = tl.where(r == rows, pad_key, hk * total + tl.where(real, start, total))
    tl.store(row_ptr + r, count_below(sorted_key, n_entries, target, entry_steps, False), mask=rmask)
    tmask = r < cap
    tl.store(blk_start + r, start, mask=tmask)
    tl.store(blk_len + r, length, mask=tmask)
    tl.store(blk_local + r, local, mask=tmask)


@triton.jit
def _token_start_kernel(cu_seqlens, tok_start, total, batch, batch_steps, BLOCK: tl.constexpr):
    """tok_start[t] = cu_seqlens[sequence of t] for BLOCK tokens per program."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = t < total
    seq = count_below(cu_seqlens + 1, batch, t, batch_steps, True)
    tl.store(tok_start + t, tl.load(cu_seqlens + seq, mask=mask, other=0), mask=mask)
