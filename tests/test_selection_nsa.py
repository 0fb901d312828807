"""NSA query-outer selected attention (ops/selected/nsa.py) against the fp32 reference.

Forward o and lse and gradients dq/dk/dv, bounded by 2x PyTorch's own error in the input dtype
(reference run under native_precision). Kernel allocations are NaN-poisoned, so an element a
kernel forgets to write fails the comparison. Shapes stay tiny: on CPU every program runs
through the Triton interpreter.
"""

from __future__ import annotations

import functools

import pytest
import torch
from fsalab.config import NSAConfig
from fsalab.ops.selected import nsa, selected_attention
from fsalab.ops.selected.index import build_selection_index
from fsalab.testing import (
    attention_and_grads,
    check_selected_attention,
    make_batch,
    random_block_idx,
    selected_blocks,
)

# The impl under test, through the public entry point (input checks included).
NSA = functools.partial(selected_attention, impl="nsa")


@pytest.mark.parametrize(
    "dtype,d,g,block_size,topk",
    [
        (torch.float32, 64, 1, 16, 3),
        (torch.float16, 64, 2, 16, 4),
        (torch.float16, 96, 3, 32, 3),
        (torch.float32, 128, 4, 16, 4),
        (torch.float16, 192, 5, 16, 3),
        (torch.float16, 64, 6, 16, 3),  # a group of 6 and of 7 heads pads its tile to 8 rows
        (torch.float32, 64, 7, 32, 2),
        (torch.float16, 256, 8, 32, 2),
        (torch.float16, 128, 16, 64, 2),
        (torch.float32, 256, 16, 16, 3),
    ],
)
def test_nsa_random_selection(dtype, d, g, block_size, topk, seed, gen, device):
    h_kv = 2 if g in (1, 3) else 1  # h_kv > 1 exercises the head offsets; each program is costly here
    lengths = [1, 37, 70]
    batch = make_batch(lengths, g * h_kv, h_kv, d, dtype=dtype, device=device, seed=seed)
    block_idx = random_block_idx(batch.cu_seqlens, h_kv, topk, block_size, gen, p_drop=0.3)
    check_selected_attention(NSA, batch, block_idx, block_size)


def test_nsa_real_selection(seed, gen, device):
    """block_idx from NSA's compression + top-k path (init and local blocks forced)."""
    cfg = NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=4, init_blocks=1, local_blocks=2)
    batch = make_batch([9, 120], 4, 1, 64, dtype=torch.float16, device=device, seed=seed)
    block_idx = selected_blocks(batch, cfg, gen)
    check_selected_attention(NSA, batch, block_idx, cfg.block_size)


def test_nsa_block64_long_sequence(seed, gen, device):
    cfg = NSAConfig(block_size=64, topk=3, init_blocks=1, local_blocks=1)
    batch = make_batch([150], 4, 1, 64, dtype=torch.float16, device=device, seed=seed)
    block_idx = selected_blocks(batch, cfg, gen)
    check_selected_attention(NSA, batch, block_idx, cfg.block_size)


@pytest.mark.parametrize(
    "lengths,topk",
    [
        ([1], 2),  # a single token
        ([2, 1, 3, 5, 1, 4, 2, 90], 3),  # many short sequences packed with a long one
        ([20, 45], 8),  # topk above the causal block count: rows padded with -1
    ],
)
def test_nsa_edge_lengths(lengths, topk, seed, gen, device):
    batch = make_batch(lengths, 4, 1, 64, dtype=torch.float16, device=device, seed=seed)
    block_idx = random_block_idx(batch.cu_seqlens, 1, topk, 16, gen, p_drop=0.0)
    check_selected_attention(NSA, batch, block_idx, 16)


def test_nsa_empty_selections(seed, gen, device):
    """Tokens and heads that select nothing: o = 0, lse = -inf, zero gradients."""
    batch = make_batch([20, 40], 6, 2, 64, dtype=torch.float16, device=device, seed=seed)
    block_idx = random_block_idx(batch.cu_seqlens, 2, 3, 16, gen, p_drop=0.5)
    block_idx[::3] = -1  # every third token selects nothing on either head
    block_idx[1::3, 0] = -1  # some tokens select nothing on head 0 only
    check_selected_attention(NSA, batch, block_idx, 16)
    nothing = torch.full_like(block_idx, -1)
    o, lse = selected_attention(batch.q, batch.k, batch.v, nothing, batch.cu_seqlens, 16, impl="nsa")
    assert bool((o == 0).all()) and bool((lse == float("-inf")).all())


def test_nsa_large_logits(seed, gen, device):
    batch = make_batch([30, 45], 8, 2, 64, dtype=torch.float16, device=device, seed=seed, q_scale=16.0)
    block_idx = random_block_idx(batch.cu_seqlens, 2, 3, 16, gen, p_drop=0.2)
    check_selected_attention(NSA, batch, block_idx, 16)


def test_nsa_lse_gradient(seed, gen, device):
    """A loss on lse too: the dq/dk/dv kernels fold dlse into delta."""
    batch = make_batch([25, 60], 6, 2, 64, dtype=torch.float32, device=device, seed=seed)
    block_idx = random_block_idx(batch.cu_seqlens, 2, 3, 16, gen, p_drop=0.0)  # no empty rows: lse finite
    check_selected_attention(NSA, batch, block_idx, 16, with_dlse=True)


def sink_block_idx(cu, h_kv, topk, block_size, gen):
    """Random selections where block 0 is selected by every non-empty row (the attention sink)."""
    block_idx = random_block_idx(cu, h_kv, topk, block_size, gen, p_drop=0.2)
    block_idx[:, :, 0] = torch.where(block_idx[:, :, 0] >= 0, 0, -1)
    return block_idx


def test_nsa_split_segments(monkeypatch, seed, gen, device):
    """Long CSR lists split into segments whose fp32 partials are merged (the attention-sink path);
    the segment slots are an upper bound, so some dk/dv and merge programs find no work."""
    monkeypatch.setattr(nsa, "_segment_entries", lambda g: 5)
    batch = make_batch([50, 61], 6, 2, 64, dtype=torch.float16, device=device, seed=seed)
    block_idx = sink_block_idx(batch.cu_seqlens, 2, 3, 16, gen)
    check_selected_attention(NSA, batch, block_idx, 16)


def test_nsa_prefetch_ablation(monkeypatch, seed, gen, device):
    """prefetch=False, the ablation of the index prefetch (docs/performance.md), gives bit-identical results."""
    monkeypatch.setattr(nsa, "_segment_entries", lambda g: 7)
    g, h_kv, block_size, scale = 3, 2, 16, 0.125
    batch = make_batch([40, 37], g * h_kv, h_kv, 64, dtype=torch.float16, device=device, seed=seed)
    q, k, v, cu = batch.q, batch.k, batch.v, batch.cu_seqlens
    block_idx = sink_block_idx(cu, h_kv, 3, block_size, gen)
    do = torch.randn(q.shape, generator=gen).to(device, q.dtype)
    index = build_selection_index(block_idx, cu, block_size)
    plan = nsa._dkdv_plan(index, g)
    assert int(plan["extra_ptr"][-1]) > 0
    results = []
    for prefetch in (True, False):
        o, lse, tok_start = nsa._forward(q, k, v, block_idx, cu, block_size, scale, prefetch=prefetch)
        dq, delta = nsa._bwd_dq(q, k, v, o, lse, do, None, block_idx, tok_start, block_size, scale, prefetch=prefetch)
        dk, dv = nsa._bwd_dkdv(q, k, v, do, lse, delta, index.token_ids, index.row_ptr, plan, block_size, scale,
                               prefetch=prefetch)  # fmt: skip
        results.append((o, lse, dq, delta, dk, dv))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_nsa_deterministic(seed, gen, device):
    batch = make_batch([33, 20], 4, 1, 64, dtype=torch.float16, device=device, seed=seed)
    block_idx = random_block_idx(batch.cu_seqlens, 1, 3, 16, gen, p_drop=0.2)
    do = torch.randn_like(batch.q)
    first = attention_and_grads(NSA, batch.q, batch.k, batch.v, block_idx, batch.cu_seqlens, 16, do)
    second = attention_and_grads(NSA, batch.q, batch.k, batch.v, block_idx, batch.cu_seqlens, 16, do)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_nsa_rejects_bad_block_size(device):
    batch = make_batch([8], 2, 1, 64, device=device, seed=0)
    block_idx = torch.zeros(8, 1, 1, dtype=torch.int32, device=device)
    for bad in (24, 8):
        with pytest.raises(ValueError, match="block_size"):
            nsa.selected_attention_nsa(batch.q, batch.k, batch.v, block_idx, batch.cu_seqlens, bad)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "d,g,lengths",
    [
        (64, 1, [1, 300, 700, 64]),
        (128, 4, [1, 300, 700, 64]),
        (96, 5, [1, 300, 700, 64]),
        (192, 16, [1, 300, 700, 64]),
        (256, 2, [1, 300, 700, 64]),
        (128, 16, [3000, 40]),  # the sink's list (3000 entries) splits into segments
    ],
)
def test_nsa_bf16(d, g, lengths, seed, gen, device):
    cfg = NSAConfig(block_size=64, topk=4)
    h_kv = 2
    batch = make_batch(lengths, g * h_kv, h_kv, d, dtype=torch.bfloat16, device=device, seed=seed)
    check_selected_attention(NSA, batch, selected_blocks(batch, cfg, gen), cfg.block_size)
    block_idx = random_block_idx(batch.cu_seqlens, h_kv, 8, 32, gen, p_drop=0.3)
    check_selected_attention(NSA, batch, block_idx, 32)
