"""build_selection_index against a plain Python transpose of block_idx.

block_idx comes from ``fsalab.testing``: the real NSA selection path (``selected_blocks``) and
random valid selections (``random_block_idx``). Every allocation is poisoned
(``poison_every_allocation``: integer buffers hold the dtype's minimum, floating ones NaN), so an
index element the kernels never write fails the comparison even where its expected value is 0.
"""

from __future__ import annotations

import pytest
import torch

from fsalab.config import NSAConfig
from fsalab.ops.selected.index import build_selection_index
from fsalab.testing import cu_seqlens_of, make_batch, random_block_idx, random_lengths, selected_blocks

pytestmark = pytest.mark.usefixtures("poison_every_allocation")


def reference_index(block_idx: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int):
    """Python-loop transpose: (block_offsets, row_ptr, token_ids, entry_slot, slot_pos, capacity)."""
    total, h_kv, topk = block_idx.shape
    cu = cu_seqlens.tolist()
    batch = len(cu) - 1
    offsets = [0]
    for b in range(batch):
        offsets.append(offsets[-1] + -(-(cu[b + 1] - cu[b]) // block_size))
    capacity = total // block_size + batch
    rows: list[list[tuple[int, int, int]]] = [[] for _ in range(h_kv * capacity)]
    for b in range(batch):
        for t in range(cu[b], cu[b + 1]):
            for hh in range(h_kv):
                for s in range(topk):
                    blk = int(block_idx[t, hh, s])
                    if blk >= 0:
                        rows[hh * capacity + offsets[b] + blk].append((t, hh, s))
    row_ptr, token_ids, entry_slot = [0], [], []
    slot_pos = torch.full((total, h_kv, topk), -1, dtype=torch.int32)
    for row in rows:
        for t, hh, s in row:
            slot_pos[t, hh, s] = len(token_ids)
            token_ids.append(t)
            entry_slot.append(s)
        row_ptr.append(len(token_ids))
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    return as_i32(offsets), as_i32(row_ptr), as_i32(token_ids), as_i32(entry_slot), slot_pos, capacity


def check_index(block_idx: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int) -> None:
    idx = build_selection_index(block_idx, cu_seqlens, block_size)
    offsets, row_ptr, token_ids, entry_slot, slot_pos, capacity = reference_index(
        block_idx.cpu(), cu_seqlens.cpu(), block_size
    )
    total, h_kv, topk = block_idx.shape
    assert idx.block_capacity == capacity
    for name, t in (("block_offsets", idx.block_offsets), ("row_ptr", idx.row_ptr), ("slot_pos", idx.slot_pos)):
        assert t.dtype == torch.int32, name
    assert idx.token_ids.shape == idx.entry_slot.shape == (total * h_kv * topk,)
    assert torch.equal(idx.block_offsets.cpu(), offsets)
    assert torch.equal(idx.row_ptr.cpu(), row_ptr)
    n = len(token_ids)
    assert torch.equal(idx.token_ids[:n].cpu(), token_ids)
    assert torch.equal(idx.entry_slot[:n].cpu(), entry_slot)
    assert torch.equal(idx.slot_pos.cpu(), slot_pos)
    # Deterministic: a second build is bitwise identical, padding tail included.
    again = build_selection_index(block_idx, cu_seqlens, block_size)
    assert torch.equal(again.token_ids, idx.token_ids) and torch.equal(again.entry_slot, idx.entry_slot)


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_index_random_selection(block_size, gen, device):
    lengths = random_lengths(gen, 5, 300) + [0, 1]
    cu = cu_seqlens_of(lengths, device)
    block_idx = random_block_idx(cu, 3, 5, block_size, gen)
    check_index(block_idx, cu, block_size)


def test_index_nsa_selection(seed, gen, device):
    cfg = NSAConfig(kernel_size=16, kernel_stride=8, block_size=32, topk=4, init_blocks=1, local_blocks=2)
    lengths = [7, 200, 1, 33, 96]
    batch = make_batch(lengths, 4, 2, 32, seed=seed, device=device)
    block_idx = selected_blocks(batch, cfg, gen)
    check_index(block_idx, batch.cu_seqlens, cfg.block_size)


@pytest.mark.parametrize(
    "lengths,topk",
    [
        ([1], 1),  # a single token
        ([5, 0, 3], 4),  # an empty sequence and topk beyond every causal block
        ([2] * 20 + [150], 3),  # many short sequences and a long one
    ],
)
def test_index_edge_cases(lengths, topk, gen, device):
    cu = cu_seqlens_of(lengths, device)
    block_idx = random_block_idx(cu, 2, topk, 16, gen, p_drop=0.0)
    check_index(block_idx, cu, 16)


def test_index_empty_selection(device):
    cu = cu_seqlens_of([40, 9], device)
    block_idx = torch.full((49, 2, 3), -1, dtype=torch.int32, device=device)
    idx = build_selection_index(block_idx, cu, 16)
    assert int(idx.row_ptr[-1]) == 0 and bool((idx.slot_pos == -1).all())
    check_index(block_idx, cu, 16)


def test_index_empty_batch(device):
    cu = cu_seqlens_of([0], device)
    check_index(torch.zeros((0, 2, 3), dtype=torch.int32, device=device), cu, 16)


def test_block_table(gen, device):
    lengths = [5, 0, 40, 16, 0]
    cu = cu_seqlens_of(lengths, device)
    block_idx = random_block_idx(cu, 1, 2, 16, gen)
    idx = build_selection_index(block_idx, cu, 16)
    start, length, local = idx.block_start, idx.block_len, idx.block_local
    expected = [(0, 5, 0), (5, 16, 0), (21, 16, 1), (37, 8, 2), (45, 16, 0)]  # then unused ids
    assert start.dtype == length.dtype == local.dtype == torch.int32 and start.shape == (61 // 16 + 5,)
    got = list(zip(start.tolist(), length.tolist(), local.tolist()))
    assert got[:5] == expected and all(n == 0 for _, n, _ in got[5:])
