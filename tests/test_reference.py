"""The ops' fp32 references (``fsalab.ops.<op>.reference``), composed into whole NSA attention,
against the independent dense-mask formulation (tests/dense_nsa.py)."""

import math

import pytest
import torch
from dense_nsa import dense_nsa_sequence

from fsalab.config import NSAConfig
from fsalab.ops import reference_common
from fsalab.ops.compression import reference as compression_ref
from fsalab.ops.gate import reference as gate_ref
from fsalab.ops.selected import reference as selected_ref
from fsalab.ops.topk import reference as topk_ref
from fsalab.ops.window import reference as window_ref
from fsalab.testing import make_batch, random_lengths

CONFIGS = [
    NSAConfig(kernel_size=32, kernel_stride=16, block_size=64, topk=4, window_size=96),
    NSAConfig(kernel_size=16, kernel_stride=8, block_size=32, topk=5, init_blocks=1, local_blocks=2, window_size=40),
    NSAConfig(kernel_size=32, kernel_stride=32, block_size=32, topk=3, init_blocks=0, local_blocks=1, window_size=512),
]


def run_reference(batch, params, gate_logits, cfg):
    """All three branches and the gates of the references on already-projected tensors:
    (o [total, h, d], block_idx, k_cmp, cu_seqlens_cmp)."""
    q, k, v, cu = batch.q, batch.k, batch.v, batch.cu_seqlens
    k_cmp, v_cmp, cu_cmp = compression_ref.compress_kv(k, v, *params, cu, cfg)
    o_cmp, lse_cmp = compression_ref.compressed_attention(q, k_cmp, v_cmp, cu, cu_cmp, cfg)
    block_idx = topk_ref.select_blocks(q, k_cmp, lse_cmp, cu, cu_cmp, cfg)
    o_slc, _ = selected_ref.selected_attention(q, k, v, block_idx, cu, cfg.block_size)
    o_win, _ = window_ref.window_attention(q, k, v, cu, cfg.window_size)
    return gate_ref.gated_sum(o_cmp, o_slc, o_win, gate_logits), block_idx, k_cmp, cu_cmp


def random_params(gen, h_kv, d, cfg):
    l = cfg.kernel_size
    w_k = torch.randn(h_kv, l * d, d, generator=gen) / math.sqrt(l * d)
    w_v = torch.randn(h_kv, l * d, d, generator=gen) / math.sqrt(l * d)
    pe = torch.randn(h_kv, l, d, generator=gen) * 0.1
    return w_k, w_v, pe


@pytest.mark.parametrize(
    "g,d,cfg",
    [(1, 64, CONFIGS[0]), (2, 96, CONFIGS[1]), (4, 128, CONFIGS[2]), (8, 64, CONFIGS[1]), (16, 96, CONFIGS[0]), (4, 64, CONFIGS[0])],
)
def test_reference_matches_dense_masks(g, d, cfg, gen, seed):
    h_kv = 2
    lengths = random_lengths(gen, 3, 300) + [1, cfg.kernel_size - 1, cfg.block_size + 1]
    batch = make_batch(lengths, h_kv * g, h_kv, d, seed=seed)
    params = random_params(gen, h_kv, d, cfg)
    gate_logits = torch.randn(batch.total, h_kv * g, 3, generator=gen)
    o, block_idx, k_cmp, cu_cmp = run_reference(batch, params, gate_logits, cfg)

    cu = batch.cu_seqlens.tolist()
    cu_c = cu_cmp.tolist()
    for i in range(len(lengths)):
        a, b = cu[i], cu[i + 1]
        dense = dense_nsa_sequence(batch.q[a:b], batch.k[a:b], batch.v[a:b], *params, gate_logits[a:b], cfg)
        # Each compressed key is an l*d-term fp32 dot (4096 terms at l=32, d=128): two summation
        # orders differ by ~sqrt(l*d) * 2^-24 * |k_cmp| ≈ 4e-6 relative there; allow ~2x that on
        # top of the absolute floor (the old rtol=0 failed at |k_cmp| ≈ 2, seed 110995971).
        rtol = 2 * math.sqrt(cfg.kernel_size * d) * 2.0**-24
        torch.testing.assert_close(k_cmp[cu_c[i] : cu_c[i + 1]], dense["k_cmp"], atol=1e-5, rtol=rtol)
        assert torch.equal(block_idx[a:b], dense["block_idx"]), f"sequence {i}: block selection differs"
        # The compressed keys' summation-order error reaches o through the compressed scores
        # (rtol=0 failed at |o| ≈ 2.5 by 4e-6 relative, seed 98790411, g 16, d 96).
        torch.testing.assert_close(o[a:b], dense["o"], atol=1e-5, rtol=rtol)


def test_branches_match_dense_masks(gen, seed):
    cfg = CONFIGS[0]
    h_kv, g, d = 2, 3, 64
    lengths = [257, 40, 130]
    batch = make_batch(lengths, h_kv * g, h_kv, d, seed=seed)
    params = random_params(gen, h_kv, d, cfg)
    k_cmp, v_cmp, cu_cmp = compression_ref.compress_kv(batch.k, batch.v, *params, batch.cu_seqlens, cfg)
    o_cmp, lse = compression_ref.compressed_attention(batch.q, k_cmp, v_cmp, batch.cu_seqlens, cu_cmp, cfg)
    block_idx = topk_ref.select_blocks(batch.q, k_cmp, lse, batch.cu_seqlens, cu_cmp, cfg)
    o_slc, _ = selected_ref.selected_attention(batch.q, batch.k, batch.v, block_idx, batch.cu_seqlens, cfg.block_size)
    o_win, _ = window_ref.window_attention(batch.q, batch.k, batch.v, batch.cu_seqlens, cfg.window_size)
    cu = batch.cu_seqlens.tolist()
    gate = torch.zeros(batch.total, h_kv * g, 3)
    for i in range(len(lengths)):
        a, b = cu[i], cu[i + 1]
        dense = dense_nsa_sequence(batch.q[a:b], batch.k[a:b], batch.v[a:b], *params, gate[a:b], cfg)
        for name, ours in (("o_cmp", o_cmp), ("o_slc", o_slc), ("o_win", o_win)):
            torch.testing.assert_close(ours[a:b], dense[name], atol=1e-5, rtol=0, msg=f"{name} of sequence {i}")


def test_reference_work_is_batched_over_tokens():
    """The reference stays usable as a test oracle at thousands of tokens on CPU: its work is
    batched, so a call over 4000 tokens runs fewer torch ops than half its tokens (a Python loop
    per token, or per token and head, would run thousands; ~970 today). Counted, not timed: a
    wall-clock bound failed on a loaded machine."""
    from fsalab.testing import LaunchCounter

    cfg = NSAConfig()
    batch = make_batch([3000, 1000], 8, 2, 64, seed=0)
    gen = torch.Generator().manual_seed(0)
    params = random_params(gen, 2, 64, cfg)
    with LaunchCounter() as ops:
        o, *_ = run_reference(batch, params, torch.zeros(batch.total, 8, 3), cfg)
    assert torch.isfinite(o).all()
    assert ops.total < batch.total // 2, ops.counts.most_common(10)


def test_selected_reference_keeps_no_gathered_kv_for_the_backward(monkeypatch, gen):
    """With gradients, the per-token gathered K/V of each chunk are recomputed in the backward
    instead of kept (at 2048 tokens, h_kv = 64 and 1024 selected keys they would be 128 GiB):
    what autograd stores stays near the inputs' size, and the gradients equal an unchunked run."""
    h_kv, g, d, block_size, topk = 4, 2, 32, 16, 4
    batch = make_batch([200, 57], h_kv * g, h_kv, d, seed=3)
    pos = torch.cat([torch.arange(n) for n in (200, 57)])
    own = (pos // block_size)[:, None, None]
    block_idx = (own - torch.arange(topk)).clamp(min=-1).expand(-1, h_kv, -1).to(torch.int32).contiguous()
    do = torch.randn(batch.q.shape, generator=gen)

    def grads():
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (batch.q, batch.k, batch.v))
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o, _ = selected_ref.selected_attention(q, k, v, block_idx, batch.cu_seqlens, block_size)
        return torch.autograd.grad(o, (q, k, v), do), sum(saved.values())

    whole, _ = grads()
    monkeypatch.setattr(reference_common, "CHUNK_BUDGET", 1 << 14)  # many chunks, as at benchmark sizes
    chunked, kept = grads()
    inputs = sum(t.numel() * 4 for t in (batch.q, batch.k, batch.v))
    gathered = batch.total * h_kv * topk * block_size * d * 4 * 2
    assert kept < 4 * inputs < gathered
    for a, b in zip(whole, chunked):  # dK/dV sum the chunks in another order: fp32 rounding only
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)



@pytest.mark.usefixtures("poison_every_allocation")
def test_poisoned_allocations_fill_leaves_that_require_grad():
    """The GPU tests compare kernels with this reference under ``poison_every_allocation``; its
    backward recomputes chunks under torch.utils.checkpoint, which (torch 2.11) allocates
    ``torch.empty((0,), requires_grad=True)``: the fixture fills such a leaf without an in-place
    error, and it stays a leaf that requires grad."""
    leaf = torch.empty(3, requires_grad=True)
    assert leaf.is_leaf and leaf.requires_grad and torch.isnan(leaf).all()
    assert torch.empty((0,), requires_grad=True).requires_grad
