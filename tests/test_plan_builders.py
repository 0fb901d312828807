"""The Triton plan builders (index_kernels, worklist) against the torch formulation they replaced.

Until the launch-count work, the selection index, the block table, the FSA work lists and the NSA
segment plan were chains of small torch ops (sort + searchsorted + elementwise). Those chains
are kept here, verbatim in substance, as the reference: the fused kernels must reproduce every
output bit for bit (tails past row_ptr[-1] included), on random varlen batches with -1 padding,
empty and one-token sequences, many short sequences, h_kv up to 8 and topk up to 20. Every
allocation is poisoned (``poison_every_allocation``: integer buffers hold the dtype's minimum,
``new_empty`` ones included), so an element a kernel never writes differs from the reference even
where that reference is 0.
"""

from __future__ import annotations

import pytest
import torch
from fsalab.ops.selected import fsa_plan, nsa, worklist
from fsalab.ops.selected.index import (
    block_capacity,
    build_selection_index,
    token_starts,
)
from fsalab.testing import cu_seqlens_of, random_block_idx
from fsalab.varlen import sequence_ids

pytestmark = pytest.mark.usefixtures("poison_every_allocation")

# ---------------------------------------------------------------------------------------------
# The torch formulation (reference)


def ref_block_offsets(cu_seqlens, block_size):
    n = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    offsets = torch.zeros_like(cu_seqlens)
    offsets[1:] = torch.cumsum((n + block_size - 1) // block_size, 0).to(torch.int32)
    return offsets


def ref_index(block_idx, cu_seqlens, block_size):
    """(block_offsets, row_ptr, token_ids, entry_slot, slot_pos, start, length, local)."""
    total, h_kv, topk = block_idx.shape
    device = block_idx.device
    batch = cu_seqlens.numel() - 1
    capacity = block_capacity(total, batch, block_size)
    num_rows = h_kv * capacity
    offsets = ref_block_offsets(cu_seqlens, block_size)
    seq = sequence_ids(cu_seqlens, total).clamp(max=max(batch - 1, 0))
    first_block = offsets.long()[seq][:, None, None]
    heads = torch.arange(h_kv, device=device)[None, :, None] * capacity
    blk = block_idx.long()
    valid = blk >= 0
    rows = torch.where(valid, heads + first_block + blk, torch.full_like(blk, num_rows)).flatten()
    sorted_key, order = torch.sort(rows.to(torch.int32), stable=True)
    row_ptr = torch.searchsorted(sorted_key, torch.arange(num_rows + 1, dtype=torch.int32, device=device))
    per_token = h_kv * topk
    token_ids = (order // per_token).to(torch.int32)
    entry_slot = (order % topk).to(torch.int32)
    slot_pos = torch.empty(total * per_token, dtype=torch.int32, device=device)
    slot_pos[order] = torch.arange(order.numel(), dtype=torch.int32, device=device)
    slot_pos = torch.where(valid.flatten(), slot_pos, torch.full_like(slot_pos, -1)).view(total, h_kv, topk)
    # Block table.
    gb = torch.arange(capacity, dtype=torch.int32, device=device)
    seq = torch.searchsorted(offsets[1:].contiguous(), gb, right=True).clamp_(max=batch - 1)
    local = gb - offsets[seq]
    start = cu_seqlens[seq] + local * block_size
    length = (cu_seqlens[seq + 1] - start).clamp(0, block_size)
    length = torch.where(gb < offsets[-1], length, torch.zeros_like(length))
    i32 = torch.int32
    return offsets, row_ptr.to(i32), token_ids, entry_slot, slot_pos, start.to(i32), length.to(i32), local.to(i32)


def ref_work_list(row_ptr, total_entries, per_item, min_one):
    lens = row_ptr[1:] - row_ptr[:-1]
    n = (lens + (per_item - 1)) // per_item
    if min_one:
        n = n.clamp(min=1)
    cum = torch.cumsum(n, 0, dtype=torch.int32)
    first = torch.cat([cum.new_zeros(1), cum])
    rows = lens.numel()
    items = torch.arange(-(-total_entries // per_item) + rows, dtype=torch.int32, device=row_ptr.device)
    item_row = torch.searchsorted(cum, items, right=True, out_int32=True)
    item_sub = items - first[item_row.clamp(max=rows - 1)]
    return first, item_row, item_sub


def ref_split_slots(row_ptr, per_item):
    lens = row_ptr[1:] - row_ptr[:-1]
    n = (lens + (per_item - 1)) // per_item
    n = torch.where(n > 1, n, torch.zeros_like(n))
    cum = torch.cumsum(n, 0, dtype=torch.int32)
    return torch.cat([cum.new_zeros(1), cum])


def ref_max_rest_len(row_ptr, local, h_kv):
    lens = (row_ptr[1:] - row_ptr[:-1]).view(h_kv, -1)
    rest = torch.where(local[None, :] >= 1, lens, torch.zeros_like(lens))
    return rest.amax().to(torch.int32) if rest.numel() else lens.new_zeros(())


def ref_extra_segments(row_ptr, seg, n_entries):
    counts = row_ptr[1:] - row_ptr[:-1]
    extra_ptr = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=row_ptr.device)
    extra_ptr[1:] = torch.cumsum((counts - 1).clamp(min=0) // seg, 0)
    slots = torch.arange(max(n_entries // seg, 1), device=row_ptr.device, dtype=torch.int32)
    return extra_ptr, torch.searchsorted(extra_ptr[1:].contiguous(), slots, right=True).to(torch.int32)


# ---------------------------------------------------------------------------------------------


def batches(gen):
    """(lengths, h_kv, topk, block_size, p_drop) cases: edge lengths, many short sequences, wide heads."""
    rand = [int(n) for n in torch.randint(0, 90, (6,), generator=gen)]
    return [
        ([1], 1, 1, 16, 0.0),
        ([0], 2, 3, 16, 0.0),
        ([0, 0, 0], 3, 2, 16, 0.0),
        ([5, 0, 3, 1, 0], 2, 4, 16, 0.3),
        ([2] * 40 + [150] + [1] * 9, 3, 3, 16, 0.2),
        (rand + [0, 1], 8, 5, 16, 0.3),
        (rand, 4, 16, 16, 0.1),
        ([200, 37], 2, 20, 16, 0.5),
        ([130, 64, 65], 8, 2, 64, 0.0),
        ([300], 1, 8, 32, 0.0),
    ]


def assert_equal(name, actual, expected):
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(actual.cpu(), expected.cpu()), f"{name} differs"


@pytest.fixture
def cases(gen, device):
    out = []
    for lengths, h_kv, topk, block_size, p_drop in batches(gen):
        cu = cu_seqlens_of(lengths, device)
        block_idx = random_block_idx(cu, h_kv, topk, block_size, gen, p_drop=p_drop)
        if block_idx.numel():
            block_idx[::7] = -1  # tokens that select nothing on any head
        out.append((block_idx, cu, block_size))
    return out


def test_index_matches_torch_formulation(cases):
    for block_idx, cu, block_size in cases:
        idx = build_selection_index(block_idx, cu, block_size)
        ref = ref_index(block_idx, cu, block_size)
        names = ("block_offsets", "row_ptr", "token_ids", "entry_slot", "slot_pos", "block_start", "block_len",
                 "block_local")  # fmt: skip
        for name, expected in zip(names, ref):
            assert_equal(name, getattr(idx, name), expected)


@pytest.mark.parametrize("per_item", [1, 3, 64])
def test_work_lists_match_torch_formulation(per_item, cases):
    for block_idx, cu, block_size in cases:
        idx = build_selection_index(block_idx, cu, block_size)
        entries = idx.token_ids.numel()
        for min_one in (False, True):
            work = fsa_plan.work_list(idx.row_ptr, entries, per_item, min_one, split_slots=min_one)
            first, item_row, item_sub = ref_work_list(idx.row_ptr, entries, per_item, min_one)
            assert_equal("first", work.first, first)
            assert_equal("item_row", work.item_row, item_row)
            assert_equal("item_sub", work.item_sub, item_sub)
            if min_one:
                assert_equal("slots", work.slots, ref_split_slots(idx.row_ptr, per_item))
            else:
                assert work.slots is None
        h_kv = block_idx.shape[1]
        assert_equal("max_rest", fsa_plan.max_rest_len(idx), ref_max_rest_len(idx.row_ptr, idx.block_local, h_kv))


@pytest.mark.parametrize("seg", [1, 2, 5, 1024])
def test_nsa_segment_plan_matches_torch_formulation(seg, cases, monkeypatch):
    monkeypatch.setattr(nsa, "_segment_entries", lambda g: seg)
    for block_idx, cu, block_size in cases:
        idx = build_selection_index(block_idx, cu, block_size)
        plan = nsa._dkdv_plan(idx, 1)
        extra_ptr, extra_row = ref_extra_segments(idx.row_ptr, seg, idx.token_ids.numel())
        assert_equal("extra_ptr", plan["extra_ptr"], extra_ptr)
        assert_equal("extra_row", plan["extra_row"], extra_row)
        assert plan["max_extra"] == idx.token_ids.numel() // seg


def test_token_starts_match_torch_formulation(cases):
    for block_idx, cu, _ in cases:
        total = block_idx.shape[0]
        assert_equal("token_starts", token_starts(cu, total), cu[sequence_ids(cu, total)].contiguous())


def test_scan_rows_without_rows(device):
    """An empty batch has no CSR rows: the scans hold their single 0, the item lists nothing."""
    row_ptr = torch.zeros(1, dtype=torch.int32, device=device)
    first, second, best = worklist.scan_rows(row_ptr, 4, worklist.ITEMS, worklist.SPLIT,
                                             local=torch.zeros(0, dtype=torch.int32, device=device))  # fmt: skip
    assert first.tolist() == [0] and second.tolist() == [0] and int(best) == 0
    item_row, item_sub = worklist.row_items(first, 0)
    assert item_row.numel() == 0 and item_sub.numel() == 0


def dense_random_block_idx(cu_seqlens, h_kv, topk, block_size, gen):
    """Random valid block_idx built on the device at long-context sizes (no dense score table):
    topk draws from [0, own block] per (token, head), duplicates dropped, ascending, -1 padded."""
    total = int(cu_seqlens[-1])
    pos = torch.arange(total, device=cu_seqlens.device) - cu_seqlens.long()[sequence_ids(cu_seqlens, total)]
    own = (pos // block_size)[:, None, None]
    draws = torch.rand(total, h_kv, topk, generator=gen, device=cu_seqlens.device)
    blk = torch.sort((draws * (own + 1)).long(), dim=-1).values
    dup = torch.zeros_like(blk, dtype=torch.bool)
    dup[..., 1:] = blk[..., 1:] == blk[..., :-1]
    big = torch.iinfo(torch.int64).max
    blk = torch.sort(torch.where(dup, big, blk), dim=-1).values
    return torch.where(blk == big, -1, blk).to(torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths,h_kv,topk,block_size", [
    ([65536], 4, 16, 64),
    ([30000, 1, 20000, 15535], 4, 8, 128),
    ([262144], 8, 16, 64),
])  # fmt: skip
def test_plan_builders_match_torch_at_scale(lengths, h_kv, topk, block_size):
    """Long-context sizes on the GPU: many programs per launch, deep binary searches, millions of
    entries (the CPU cases above are a few hundred tokens)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    cu = cu_seqlens_of(lengths, "cuda")
    block_idx = dense_random_block_idx(cu, h_kv, topk, block_size, gen)
    idx = build_selection_index(block_idx, cu, block_size)
    names = ("block_offsets", "row_ptr", "token_ids", "entry_slot", "slot_pos", "block_start", "block_len",
             "block_local")  # fmt: skip
    for name, expected in zip(names, ref_index(block_idx, cu, block_size)):
        assert_equal(name, getattr(idx, name), expected)
    entries = idx.token_ids.numel()
    for per_item in (64, 1024):
        work = fsa_plan.work_list(idx.row_ptr, entries, per_item, True, split_slots=True)
        for name, actual, expected in zip(("first", "item_row", "item_sub"), (work.first, work.item_row, work.item_sub),
                                          ref_work_list(idx.row_ptr, entries, per_item, True)):  # fmt: skip
            assert_equal(name, actual, expected)
        assert_equal("slots", work.slots, ref_split_slots(idx.row_ptr, per_item))
    assert_equal("max_rest", fsa_plan.max_rest_len(idx), ref_max_rest_len(idx.row_ptr, idx.block_local, h_kv))
