"""Block selection rules of NSA (DESIGN §4.3) on the cases where they are easiest to get wrong."""

import pytest
import torch

from fsalab.config import NSAConfig
from fsalab.ops.compression import reference as compression_ref
from fsalab.ops.selected import reference as selected_ref
from fsalab.ops.topk import reference as topk_ref
from fsalab.testing import cu_seqlens_of, make_batch
from fsalab.varlen import compressed_cu_seqlens

CFG = NSAConfig(kernel_size=32, kernel_stride=16, block_size=64, topk=4, init_blocks=1, local_blocks=2, window_size=64)


def select(q, k_cmp, cu, cfg=CFG):
    cu_cmp = compressed_cu_seqlens(cu, cfg.kernel_size, cfg.kernel_stride)
    _, lse = compression_ref.compressed_attention(q, k_cmp, k_cmp, cu, cu_cmp, cfg)
    return topk_ref.select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)


def random_selection(lengths, seed, cfg=CFG, h_kv=2, g=2, d=32):
    batch = make_batch(lengths, h_kv * g, h_kv, d, seed=seed)
    rows = batch.total // cfg.kernel_stride
    k_cmp = torch.randn(rows, h_kv, d, generator=torch.Generator().manual_seed(seed))
    return select(batch.q, k_cmp, batch.cu_seqlens, cfg), batch


@pytest.mark.parametrize("n", [1, 5, CFG.kernel_size - 1, CFG.kernel_size, CFG.block_size - 1, CFG.block_size])
def test_short_sequences_select_only_what_exists(n, seed):
    block_idx, _ = random_selection([n], seed)
    # One block exists: every token selects block 0 and nothing else.
    assert (block_idx[..., 0] == 0).all()
    assert (block_idx[..., 1:] == -1).all()


def test_topk_larger_than_causal_blocks_selects_all_of_them(seed):
    n = 3 * CFG.block_size
    block_idx, _ = random_selection([n], seed)
    own = torch.arange(n) // CFG.block_size
    for t in range(0, n, 7):
        expected = list(range(own[t] + 1)) + [-1] * (CFG.topk - own[t] - 1)
        assert block_idx[t, 0].tolist() == expected


def test_forced_blocks_always_selected_and_rows_sorted(seed):
    n = 12 * CFG.block_size
    block_idx, _ = random_selection([n], seed)
    own = torch.arange(n) // CFG.block_size
    for t in range(0, n, 5):
        row = block_idx[t, 1].tolist()
        valid = [b for b in row if b >= 0]
        assert valid == sorted(set(valid)), "valid entries must be distinct and ascending"
        assert row[: len(valid)] == valid, "valid entries come before the -1 padding"
        assert max(valid) == own[t], "never a block after the own block"
        assert {0, int(own[t]), max(0, int(own[t]) - 1)} <= set(valid)
        assert len(valid) == min(CFG.topk, int(own[t]) + 1)


def test_ties_go_to_the_lower_block_index():
    # Identical compressed keys: every visible compressed token gets the same probability, so all
    # fully visible non-forced blocks tie and the lowest indices must win.
    n = 10 * CFG.block_size
    q = torch.randn(n, 2, 16)
    k_cmp = torch.ones(n // CFG.kernel_stride, 1, 16)
    block_idx = select(q, k_cmp, cu_seqlens_of([n]))
    t = n - 1  # own block 9: forced {0, 8, 9}; one free slot among tied blocks 1..7 -> block 1
    assert block_idx[t, 0].tolist() == [0, 1, 8, 9]


def test_packing_does_not_change_a_sequence_selection(seed):
    lengths = [700, 3, 40, 1, 65, 130]
    block_idx, batch = random_selection(lengths, seed)
    cu = batch.cu_seqlens.tolist()
    rows = batch.total // CFG.kernel_stride
    k_cmp = torch.randn(rows, 2, 32, generator=torch.Generator().manual_seed(seed))
    cu_cmp = compressed_cu_seqlens(batch.cu_seqlens, CFG.kernel_size, CFG.kernel_stride).tolist()
    for i, n in enumerate(lengths):
        alone = select(batch.q[cu[i] : cu[i + 1]], k_cmp[cu_cmp[i] : cu_cmp[i] + n // CFG.kernel_stride], cu_seqlens_of([n]))
        assert torch.equal(alone, block_idx[cu[i] : cu[i + 1]]), f"sequence {i} (n={n})"


def test_single_token_attends_to_itself():
    batch = make_batch([1], 2, 1, 16, seed=0)
    block_idx = torch.tensor([[[0, -1]]], dtype=torch.int32)
    o, lse = selected_ref.selected_attention(batch.q, batch.k, batch.v, block_idx, batch.cu_seqlens, 16)
    torch.testing.assert_close(o, batch.v.expand(1, 2, 16))
    torch.testing.assert_close(lse, (batch.q[0] @ batch.k[0, 0]) / 4.0 * torch.ones(1, 2))


def test_empty_selection_gives_zero_output_and_minus_inf_lse():
    batch = make_batch([8], 2, 1, 16, seed=0, requires_grad=True)
    block_idx = torch.full((8, 1, 2), -1, dtype=torch.int32)
    o, lse = selected_ref.selected_attention(batch.q, batch.k, batch.v, block_idx, batch.cu_seqlens, 16)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    o.sum().backward()
    assert torch.isfinite(batch.q.grad).all() and torch.isfinite(batch.k.grad).all()
