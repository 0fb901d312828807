"""The compression kernels (ops/compression, compress_kv) and the top-T selection (ops/topk,
select_blocks) against their fp32 references (``<op>/reference.py``).

select_blocks sums fp32 probabilities in another order than the reference, so two blocks whose
scores differ by a rounding step may swap. Every selection is therefore checked to be a valid
top-T under float64 reference scores (up to a small tolerance), and compared exactly with
reference.select_blocks on the rows whose T-th and (T+1)-th scores are not within that tolerance;
ties built on purpose (exactly equal scores) must go to the lower block everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from fsalab.config import NSAConfig
from fsalab.ops.compression import compress_kv, compressed_offsets
from fsalab.ops.compression import reference as compression_ref
from fsalab.ops.reference_common import native_precision
from fsalab.ops.topk import reference as topk_ref
from fsalab.ops.topk import select_blocks
from fsalab.ops.topk.select_common import block_key, key_bits, key_block
from fsalab.testing import (
    assert_close,
    check_selection,
    cu_seqlens_of,
    poisoned_allocations,
)
from fsalab.varlen import compressed_cu_seqlens

DEFAULT = NSAConfig()


# ----------------------------------------------------------------------------------------------
# compress_kv
# ----------------------------------------------------------------------------------------------


def compress_inputs(lengths, h_kv, d, cfg, dtype, gen, w_dtype=None):
    total, l = sum(lengths), cfg.kernel_size
    w_dtype = w_dtype or dtype

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(dt).requires_grad_(True)

    return (rnd(total, h_kv, d), rnd(total, h_kv, d), rnd(h_kv, l * d, d, scale=l**-0.5 * d**-0.5, dt=w_dtype),
            rnd(h_kv, l * d, d, scale=l**-0.5 * d**-0.5, dt=w_dtype), rnd(h_kv, l, d, scale=0.5, dt=w_dtype),
            cu_seqlens_of(lengths))


def grads(outs, inputs, upstream):
    return torch.autograd.grad(outs, inputs, [u.to(o.dtype) for o, u in zip(outs, upstream)])


def packed_lengths(cfg, long):
    l, s = cfg.kernel_size, cfg.kernel_stride
    return [1, l - 1, l, l + s - 1, 3, 2 * l + 3, 7, l + 1, long]


@pytest.mark.parametrize(
    "dtype,d,ls,w_dtype",
    [
        # fp16 on small head dims only: the interpreter's fp16 matmul is slow.
        (torch.float16, 64, (32, 16), None),
        (torch.float16, 96, (16, 8), torch.float32),
        (torch.float32, 128, (32, 16), None),
        (torch.float32, 192, (32, 32), None),
        (torch.float32, 256, (16, 8), None),
    ],
)
@pytest.mark.usefixtures("poison_every_allocation")
def test_compress_kv_matches_reference(dtype, d, ls, w_dtype, gen, seed):
    cfg = NSAConfig(kernel_size=ls[0], kernel_stride=ls[1], block_size=64, topk=4)
    h_kv = 1 if d > 128 else 2  # head indexing is covered by the smaller d; keeps the interpreter quick
    *params, cu = compress_inputs(packed_lengths(cfg, 150), h_kv, d, cfg, dtype, gen, w_dtype)
    k_cmp, v_cmp, cu_cmp = compress_kv(*params, cu, cfg)
    ref_k, ref_v, ref_cu = compression_ref.compress_kv(*params, cu, cfg)
    with native_precision():
        nat_k, nat_v, _ = compression_ref.compress_kv(*params, cu, cfg)
    assert torch.equal(cu_cmp, ref_cu)
    assert k_cmp.dtype == dtype and k_cmp.shape == ref_k.shape
    n_cmp = int(cu_cmp[-1])
    assert n_cmp < k_cmp.shape[0], "test batch should leave padding rows"
    assert (k_cmp[n_cmp:] == 0).all() and (v_cmp[n_cmp:] == 0).all(), "padding rows must be zero"
    assert_close(k_cmp, ref_k, nat_k, name="k_cmp")
    assert_close(v_cmp, ref_v, nat_v, name="v_cmp")

    upstream = [torch.randn(ref_k.shape, generator=gen), torch.randn(ref_v.shape, generator=gen)]
    got = grads((k_cmp, v_cmp), params, upstream)
    ref = grads((ref_k, ref_v), params, upstream)
    with native_precision():
        nat = grads(compression_ref.compress_kv(*params, cu, cfg)[:2], params, upstream)
    for name, a, b, c, p in zip(("dk", "dv", "dw_k", "dw_v", "dpe"), got, ref, nat, params):
        assert a.dtype == p.dtype
        assert_close(a, b, c, dtype=dtype, name=name)


@pytest.mark.parametrize("ls", [(32, 16), (16, 8), (32, 32)])
def test_compressed_offsets_match_varlen(ls, gen):
    """The one-launch offsets kernel against varlen's torch formulation: sequences shorter than,
    equal to and just over kernel_size, empty ones, a single token, and more sequences than
    one step of the kernel's scan."""
    many = torch.randint(0, 3 * ls[0], (600,), generator=gen).tolist()
    for lengths in ([1], [0, 0, 5], [ls[0] - 1, ls[0], ls[0] + 1, ls[0] + ls[1], 3 * ls[0] + 7], many):
        cu = cu_seqlens_of(lengths)
        assert torch.equal(compressed_offsets(cu, *ls), compressed_cu_seqlens(cu, *ls)), lengths[:8]


def test_compress_kv_without_any_window(gen):
    cfg = DEFAULT
    *params, cu = compress_inputs([1, 5, cfg.kernel_size - 1], 2, 64, cfg, torch.float32, gen)
    k_cmp, v_cmp, cu_cmp = compress_kv(*params, cu, cfg)
    assert k_cmp.shape == (sum([1, 5, cfg.kernel_size - 1]) // cfg.kernel_stride, 2, 64)
    assert (k_cmp == 0).all() and (v_cmp == 0).all() and (cu_cmp == 0).all()
    for grad in grads((k_cmp, v_cmp), params, [torch.ones_like(k_cmp), torch.ones_like(v_cmp)]):
        assert (grad == 0).all()


def test_compress_kv_single_token(gen):
    *params, cu = compress_inputs([1], 1, 64, DEFAULT, torch.float32, gen)
    k_cmp, v_cmp, cu_cmp = compress_kv(*params, cu, DEFAULT)
    assert k_cmp.shape == (0, 1, 64) and cu_cmp.tolist() == [0, 0]
    dk, _, dw_k, _, dpe = grads((k_cmp, v_cmp), params, [torch.ones_like(k_cmp), torch.ones_like(v_cmp)])
    assert (dk == 0).all() and (dw_k == 0).all() and (dpe == 0).all()


def test_compress_kv_backward_writes_every_element(gen):
    """Gradient buffers allocated uninitialised are written in full: the gradients are unchanged
    when every fresh floating-point allocation is NaN-poisoned."""
    *params, cu = compress_inputs([100, 5, 77], 2, 64, DEFAULT, torch.float32, gen)
    outs = compress_kv(*params, cu, DEFAULT)[:2]
    upstream = [torch.randn(outs[0].shape, generator=gen), torch.randn(outs[1].shape, generator=gen)]
    clean = grads(outs, params, upstream)
    with poisoned_allocations():
        outs = compress_kv(*params, cu, DEFAULT)[:2]
        poisoned = grads(outs, params, upstream)
    for a, b in zip(clean, poisoned):
        assert torch.equal(a, b)


def test_compress_kv_backward_is_deterministic(gen):
    *params, cu = compress_inputs([100, 77], 1, 64, DEFAULT, torch.float16, gen)
    outs = compress_kv(*params, cu, DEFAULT)[:2]
    upstream = [torch.randn(outs[0].shape, generator=gen), torch.randn(outs[1].shape, generator=gen)]
    first = grads(outs, params, upstream)
    outs = compress_kv(*params, cu, DEFAULT)[:2]
    for a, b in zip(first, grads(outs, params, upstream)):
        assert torch.equal(a, b)


def test_compress_kv_rejects_bad_inputs(gen):
    k, v, w_k, w_v, pe, cu = compress_inputs([40], 2, 64, DEFAULT, torch.float32, gen)
    with pytest.raises(ValueError, match="w_k"):
        compress_kv(k, v, w_k[:, :-1], w_v, pe, cu, DEFAULT)
    with pytest.raises(ValueError, match="pe"):
        compress_kv(k, v, w_k, w_v, pe[:1], cu, DEFAULT)
    with pytest.raises(ValueError, match="same shape"):
        compress_kv(k, v[:-1], w_k, w_v, pe, cu, DEFAULT)
    with pytest.raises(TypeError, match="cfg"):
        compress_kv(k, v, w_k, w_v, pe, cu, None)


# ----------------------------------------------------------------------------------------------
# select_blocks
# ----------------------------------------------------------------------------------------------


def selection_inputs(lengths, h_kv, g, d, cfg, dtype, gen, q_scale=1.0):
    """q, k_cmp in dtype; lse_cmp from the reference compressed attention (fp32)."""
    cu = cu_seqlens_of(lengths)
    total = sum(lengths)
    rows = total // cfg.kernel_stride
    q = (torch.randn(total, h_kv * g, d, generator=gen) * q_scale).to(dtype)
    k_cmp = torch.randn(rows, h_kv, d, generator=gen).to(dtype)
    cu_cmp = compressed_cu_seqlens(cu, cfg.kernel_size, cfg.kernel_stride)
    _, lse = compression_ref.compressed_attention(q, k_cmp, k_cmp, cu, cu_cmp, cfg)
    return q, k_cmp, lse.float(), cu, cu_cmp


@pytest.mark.slow(25)
@pytest.mark.parametrize(
    "g,d,dtype,cfg,q_scale",
    [
        (1, 64, torch.float32, NSAConfig(topk=4), 1.0),  # chunks of 4 blocks: the spill crosses chunks
        (2, 192, torch.float16, NSAConfig(kernel_size=32, kernel_stride=32, block_size=64, topk=4), 1.0),
        (3, 96, torch.float16, NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=4), 1.0),
        (5, 128, torch.float32, NSAConfig(block_size=128, topk=4), 16.0),
        (8, 64, torch.float32, NSAConfig(kernel_size=16, kernel_stride=16, block_size=16, topk=7, init_blocks=0), 1.0),
        (16, 64, torch.float16, NSAConfig(kernel_size=16, kernel_stride=8, block_size=64, topk=5, local_blocks=1), 1.0),
        (4, 256, torch.float32, NSAConfig(), 1.0),  # topk = 16 > causal blocks: -1 padding
        # g = 6 runs as 4 + 2 heads; g = 7 as one part of 8 rows, one of them padding
        (6, 32, torch.float16, NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=3), 1.0),
        (7, 32, torch.float32, NSAConfig(kernel_size=16, kernel_stride=8, block_size=32, topk=3), 8.0),
    ],
)
@pytest.mark.usefixtures("poison_every_allocation")
def test_select_blocks_matches_reference(g, d, dtype, cfg, q_scale, gen):
    h_kv = 1 if d >= 128 else 2  # head offsets are covered by the smaller d; keeps the interpreter quick
    lengths = [6 * cfg.block_size + 37, 3, cfg.kernel_size - 1, cfg.block_size + 5, 40, 1]
    q, k_cmp, lse, cu, cu_cmp = selection_inputs(lengths, h_kv, g, d, cfg, dtype, gen, q_scale)
    got = select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)
    expected = topk_ref.select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)
    assert got.dtype == torch.int32 and got.shape == expected.shape
    scores = topk_ref.block_scores(q.double(), k_cmp.double(), lse.double(), cu, cu_cmp, cfg)
    near_ties = check_selection(got, expected, scores, cu, cfg)
    assert near_ties < got.shape[0] * h_kv // 10, "too many near-ties for a meaningful exact comparison"


def test_select_blocks_with_longer_chunks(gen, monkeypatch):
    """Chunks of 4x the default blocks (BB = 4 T_P: each chunk's sorted candidates are cut to
    their top T_P before the merge) choose what the reference chooses, across chunk boundaries."""
    from fsalab.ops.topk import block_select

    default = block_select._chunk_blocks
    monkeypatch.setattr(block_select, "_chunk_blocks", lambda t_pad, r: 4 * default(t_pad, r))
    # r = B/s = 8 and T_P = 2: default BB = 2 blocks, here 8 (512 tokens); 18 blocks = 3 chunks
    cfg = NSAConfig(kernel_size=16, kernel_stride=8, block_size=64, topk=2, init_blocks=0, local_blocks=1)
    lengths = [17 * cfg.block_size + 13, 70, 2]
    q, k_cmp, lse, cu, cu_cmp = selection_inputs(lengths, 1, 1, 32, cfg, torch.float32, gen)
    got = select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)
    scores = topk_ref.block_scores(q.double(), k_cmp.double(), lse.double(), cu, cu_cmp, cfg)
    check_selection(got, topk_ref.select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg), scores, cu, cfg)


@pytest.mark.parametrize("g,dtype", [(1, torch.float32), (2, torch.float32), (3, torch.float16)])
def test_select_blocks_unmasked_chunks(g, dtype, gen):
    """Chunks that a whole tile sees, with no forced or future block, run without masks; heads
    that see nothing (lse = -inf; here one head of every 97th token) must still add nothing
    there. r = 2, T_P = 4: chunks of 8 blocks (128 tokens); the 64-token tiles from token 320 on
    have such chunks (1 of the tile's 3 there, 7 of 10 in the 1200-token sequence's last tile)."""
    cfg = NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=4)
    lengths = [1200, 301, 5]
    q, k_cmp, lse, cu, cu_cmp = selection_inputs(lengths, 1, g, 32, cfg, dtype, gen)
    lse[500::97, 0] = float("-inf")
    got = select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)
    scores = topk_ref.block_scores(q.double(), k_cmp.double(), lse.double(), cu, cu_cmp, cfg)
    check_selection(got, topk_ref.select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg), scores, cu, cfg)


@pytest.mark.parametrize("g,cfg", [(1, NSAConfig(topk=5)), (3, NSAConfig(kernel_size=16, kernel_stride=8, block_size=32, topk=6, init_blocks=2))])
def test_select_blocks_ties_go_to_the_lower_block(g, cfg, gen):
    """q = 0 and lse = 0 make every visible p exactly 1: all full interior blocks tie exactly."""
    h_kv, d = 2, 64
    lengths = [7 * cfg.block_size - 3, 130, 9]
    q, k_cmp, _, cu, cu_cmp = selection_inputs(lengths, h_kv, g, d, cfg, torch.float32, gen)
    q = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:2])
    lse[::7] = float("-inf")  # heads that see nothing add nothing
    got = select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)
    assert torch.equal(got, topk_ref.select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg))
    # The last token of the long sequence: forced blocks, then the lowest-index tied blocks.
    own = (lengths[0] - 1) // cfg.block_size
    forced = set(range(cfg.init_blocks)) | set(range(own - cfg.local_blocks + 1, own + 1))
    free = [b for b in range(own + 1) if b not in forced][: cfg.topk - len(forced)]
    assert got[lengths[0] - 1, 0].tolist() == sorted(forced | set(free))


@triton.jit
def _keys_of(score_ptr, blk_ptr, own_ptr, key_ptr, back_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    kb = key_bits(tl.load(own_ptr + i))
    key = block_key(tl.load(score_ptr + i), tl.load(blk_ptr + i), kb)
    tl.store(key_ptr + i, key)
    tl.store(back_ptr + i, key_block(key, kb))


def block_keys(score, blk, own):
    """(keys, block read back from the key) of select_blocks' int32 ranking keys, one per entry."""
    key, back = torch.empty_like(blk), torch.empty_like(blk)
    _keys_of[(1,)](score.contiguous(), blk.contiguous(), own.contiguous(), key, back, N=score.numel())
    return key, back


@pytest.mark.parametrize("own", [0, 5, 1023, 4095])
def test_select_key_orders_by_score_then_lower_block(own, gen):
    """Keys of random scores: distinct per block, >= 0, block read back exactly; a score larger by
    more than twice the key's rounding step (2^-(26 - KB) relative, KB = max(3, bit_length(own))) ranks
    above, equal rounded scores go to the lower block, +inf above every finite score."""
    n = 256
    kb = max(3, own.bit_length())
    blk = torch.randint(0, own + 1, (n,), generator=gen, dtype=torch.int32)
    score = torch.exp(torch.empty(n).uniform_(-14, 3.4, generator=gen))  # 1e-6 .. 30
    score[:4] = float("inf")
    score[4:8] = 0.0
    score[8:16] = score[16:24]  # exact ties with other blocks
    key, back = block_keys(score, blk, torch.full((n,), own, dtype=torch.int32))
    assert (key >= 0).all() and torch.equal(back, blk)
    si, sj, ki, kj, bi, bj = score[:, None], score[None, :], key[:, None], key[None, :], blk[:, None], blk[None, :]
    step = 2.0 ** -(25 - kb)
    assert ((ki > kj) | ~(si > sj * (1 + step))).all(), "a clearly larger score ranked below"
    assert ((ki > kj) | ~((si == sj) & (bi < bj))).all(), "equal scores: the lower block must rank above"
    assert ((ki != kj) | (bi == bj)).all(), "two blocks share a key"
    assert (key[:4].min() > key[4:][score[4:].isfinite()].max()), "+inf (forced blocks) must rank first"
    if kb > 3:  # a key keeps 26 - KB mantissa bits: below 23, scores half a step apart tie
        near = torch.tensor([1.0, 1.0 + 2.0 ** -(27 - kb)], dtype=torch.float32)
        k2, _ = block_keys(near, torch.tensor([0, 1], dtype=torch.int32), torch.full((2,), own, dtype=torch.int32))
        assert k2[0] > k2[1], "within the rounding the lower block must rank above"


def test_select_blocks_without_compressed_tokens(gen):
    """Single token (no compressed row at all) and short sequences: only forced blocks."""
    cfg = NSAConfig(topk=4)
    for lengths in ([1], [5, cfg.kernel_size - 1, 2]):
        q, k_cmp, lse, cu, cu_cmp = selection_inputs(lengths, 1, 2, 64, cfg, torch.float32, gen)
        got = select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)
        assert got[..., 0].eq(0).all() and got[..., 1:].eq(-1).all()


def test_select_blocks_rejects_bad_inputs(gen):
    cfg = DEFAULT
    q, k_cmp, lse, cu, cu_cmp = selection_inputs([64], 2, 2, 64, cfg, torch.float32, gen)
    with pytest.raises(ValueError, match="k_cmp"):
        select_blocks(q, k_cmp[:-1], lse, cu, cu_cmp, cfg)
    with pytest.raises(ValueError, match="lse_cmp"):
        select_blocks(q, k_cmp, lse[:, :1], cu, cu_cmp, cfg)
    with pytest.raises(ValueError, match="multiple"):
        select_blocks(q[:, :3], k_cmp, lse[:, :3], cu, cu_cmp, cfg)
    with pytest.raises(TypeError):
        select_blocks(q.half(), k_cmp, lse, cu, cu_cmp, cfg)
    with pytest.raises(ValueError, match="kernel must be"):
        select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg, kernel="cuda")
    with pytest.raises(ValueError, match="sm_90"):  # the Gluon kernel never runs in the interpreter
        select_blocks(q.half(), k_cmp.half(), lse, cu, cu_cmp, cfg, kernel="gluon")


def test_select_blocks_spill_crosses_a_chunk(gen):
    """One dominant compressed token at a chunk boundary must lift both blocks it overlaps.

    With the defaults (l=32, s=16, B=64) compressed token 31 covers raw [496, 528): block 7 and
    block 8. The kernel walks BB = max(next_pow2(topk), 16 / (B/s)) = 8 blocks per chunk for
    topk=5 (``block_select._chunk_blocks``), so block 8's share arrives as the spill carried from
    the previous chunk. Every other visible token has p = 1 exactly (q·k = 0, lse = 0): the rest
    of the blocks tie exactly.
    """
    cfg = NSAConfig(topk=5)
    n, d = 700, 16
    q = torch.zeros(n, 1, d)
    q[:, 0, 0] = 1.0
    k_cmp = torch.zeros(n // cfg.kernel_stride, 1, d)
    k_cmp[31, 0, 0] = 8.0 * math.sqrt(d)  # p = e^8 for the spike
    lse = torch.zeros(n, 1)
    cu = cu_seqlens_of([n])
    cu_cmp = compressed_cu_seqlens(cu, cfg.kernel_size, cfg.kernel_stride)
    got = select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)
    assert torch.equal(got, topk_ref.select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg))
    assert got[-1, 0].tolist() == [0, 7, 8, 9, 10]
