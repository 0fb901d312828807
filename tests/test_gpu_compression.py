"""The compression branch's kernels (ops/compression/compress_kv.py, ops/topk/block_select.py) at 8K-128K tokens
on the GPU, against their fp32 references (``<op>/reference.py``).

compress_kv: the forward and all five gradients within 2x PyTorch's own error in the dtype, and
a second backward bitwise equal to the first. select_blocks (its Triton and its Gluon kernel): a
valid top-T under the fp32 reference scores on every row, and equal to reference.select_blocks on every row without a
near-tie at the top-T boundary (``fsalab.testing.check_selection``); at 128K the rows are
checked a slice at a time.
"""

from __future__ import annotations

import pytest
import torch

from fsalab.config import NSAConfig
from fsalab.ops.compression import compress_kv
from fsalab.ops.compression import reference as compression_ref
from fsalab.ops.reference_common import native_precision
from fsalab.ops.topk import reference as topk_ref
from fsalab.ops.topk import select_blocks
from fsalab.testing import assert_close, check_selection, cu_seqlens_of
from fsalab.varlen import compressed_cu_seqlens

# Fresh allocations poisoned (NaN, integer minimum): back-to-back cases of one shape would
# otherwise be handed the previous case's correct, freed output by the caching allocator.
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_every_allocation")]

H_KV, D = 4, 128
VARLEN_8K = [5000, 31, 1, 2900, 260]  # a one-token sequence and one shorter than kernel_size


def _compress_params(lengths, dtype, gen, device, grad):
    """k, v [total, h_kv, d], w_k, w_v [h_kv, l * d, d], pe [h_kv, l, d]; and cu_seqlens."""
    l = NSAConfig().kernel_size
    total = sum(lengths)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype).requires_grad_(grad)

    w_scale = (l * D) ** -0.5
    params = [rnd(total, H_KV, D), rnd(total, H_KV, D), rnd(H_KV, l * D, D, scale=w_scale),
              rnd(H_KV, l * D, D, scale=w_scale), rnd(H_KV, l, D, scale=0.5)]
    return params, cu_seqlens_of(lengths, device)


@pytest.mark.parametrize("lengths, dtype", [(VARLEN_8K, torch.bfloat16), (VARLEN_8K, torch.float16),
                                            ([32768], torch.bfloat16)], ids=["8Kvarlen-bf16", "8Kvarlen-fp16", "32K-bf16"])
def test_compress_kv_forward_backward(lengths, dtype, seed, device):
    cfg = NSAConfig()
    gen = torch.Generator(device=device).manual_seed(seed)
    params, cu = _compress_params(lengths, dtype, gen, device, grad=True)
    outs = compress_kv(*params, cu, cfg)[:2]
    ref = compression_ref.compress_kv(*params, cu, cfg)[:2]
    with native_precision():
        nat = compression_ref.compress_kv(*params, cu, cfg)[:2]
    for name, a, b, c in zip(("k_cmp", "v_cmp"), outs, ref, nat):
        assert_close(a, b, c, dtype=dtype, name=name)
    upstream = [torch.randn(o.shape, generator=gen, device=device) for o in outs]

    def grads(o):
        return torch.autograd.grad(o, params, [u.to(x.dtype) for x, u in zip(o, upstream)])

    got, want, native = grads(outs), grads(ref), grads(nat)
    for name, a, b, c in zip(("dk", "dv", "dw_k", "dw_v", "dpe"), got, want, native):
        assert_close(a, b, c, dtype=dtype, name=name)
    again = grads(compress_kv(*params, cu, cfg)[:2])
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "backward is not bitwise deterministic"


def _check_select(lengths, g, cfg, dtype, seed, device, rows_per_slice=None, d=D, kernel="auto", q_scale=1.0):
    gen = torch.Generator(device=device).manual_seed(seed)
    cu = cu_seqlens_of(lengths, device)
    total = sum(lengths)
    q = (torch.randn(total, H_KV * g, d, generator=gen, device=device) * q_scale).to(dtype)
    k_cmp = torch.randn(total // cfg.kernel_stride, H_KV, d, generator=gen, device=device).to(dtype)
    cu_cmp = compressed_cu_seqlens(cu, cfg.kernel_size, cfg.kernel_stride)
    _, lse = compression_ref.compressed_attention(q, k_cmp, k_cmp, cu, cu_cmp, cfg)
    got = select_blocks(q, k_cmp, lse.float(), cu, cu_cmp, cfg, kernel=kernel)
    expected = topk_ref.select_blocks(q, k_cmp, lse, cu, cu_cmp, cfg)
    scores = topk_ref.block_scores(q, k_cmp, lse, cu, cu_cmp, cfg)
    if rows_per_slice is None:
        check_selection(got, expected, scores, cu, cfg)
        return
    (n,) = lengths  # one sequence: a row's position is its index
    for lo in range(0, n, rows_per_slice):
        hi = min(n, lo + rows_per_slice)
        check_selection(got[lo:hi], expected[lo:hi], scores[lo:hi], cu, cfg, positions=torch.arange(lo, hi, device=device))


SELECT_CASES = [
    # lengths, g, (block_size, topk), dtype
    *((VARLEN_8K, g, (64, 16), torch.bfloat16) for g in (1, 5, 16)),
    *(([32768], g, (64, 16), torch.bfloat16) for g in (1, 5, 16)),
    (VARLEN_8K, 4, (128, 8), torch.bfloat16),
    (VARLEN_8K, 4, (64, 16), torch.float16),
]


@pytest.mark.parametrize("lengths, g, pair, dtype", SELECT_CASES,
                         ids=[f"{sum(c[0]) // 1024}K{'varlen' if len(c[0]) > 1 else ''}-g{c[1]}-B{c[2][0]}T{c[2][1]}-"
                              f"{str(c[3])[6:]}" for c in SELECT_CASES])
def test_select_blocks(lengths, g, pair, dtype, seed, device):
    _check_select(lengths, g, NSAConfig(block_size=pair[0], topk=pair[1]), dtype, seed, device)


KERNEL_CASES = [
    # g, (block_size, topk), d, dtype: both selection kernels on the same inputs
    *((g, (64, 16), D, torch.bfloat16) for g in (1, 2, 3, 4, 5, 6, 7, 8)),  # Gluon: 64 tokens a program at g = 8
    (1, (128, 8), D, torch.bfloat16), (4, (128, 8), D, torch.float16),
    (1, (64, 16), 64, torch.bfloat16), (2, (64, 16), 256, torch.bfloat16), (3, (64, 16), 256, torch.bfloat16),
]


@pytest.mark.parametrize("kernel", ["triton", "gluon"])
@pytest.mark.parametrize("g, pair, d, dtype", KERNEL_CASES,
                         ids=[f"g{c[0]}-B{c[1][0]}T{c[1][1]}-d{c[2]}-{str(c[3])[6:]}" for c in KERNEL_CASES])
def test_select_blocks_kernels(kernel, g, pair, d, dtype, seed, device):
    """The Triton and the Gluon selection kernel (``select_blocks(kernel=...)``) each against the
    reference on a packed batch with a one-token sequence and one shorter than kernel_size."""
    _check_select(VARLEN_8K, g, NSAConfig(block_size=pair[0], topk=pair[1]), dtype, seed, device, d=d, kernel=kernel)


@pytest.mark.parametrize("kernel", ["triton", "gluon"])
def test_select_blocks_kernels_large_logits(kernel, seed, device):
    """Both selection kernels with logits 16x the unit scale (block scores peaked on a few blocks,
    most near zero), g = 5."""
    _check_select(VARLEN_8K, 5, NSAConfig(), torch.bfloat16, seed, device, kernel=kernel, q_scale=16.0)


@pytest.mark.parametrize("g, pair", [(1, (64, 16)), (16, (64, 16)), (4, (128, 8))], ids=["g1-B64T16", "g16-B64T16", "g4-B128T8"])
def test_select_blocks_at_128k(g, pair, seed, device):
    """One sequence of 128K tokens: the dense reference score table is built once, its rows
    checked 8K at a time (sorting it whole would not fit)."""
    _check_select([131072], g, NSAConfig(block_size=pair[0], topk=pair[1]), torch.bfloat16, seed, device, 8192)


def test_compress_kv_forward_at_128k(seed, device):
    cfg = NSAConfig()
    params, cu = _compress_params([131072], torch.bfloat16, torch.Generator(device=device).manual_seed(seed), device,
                                  grad=False)
    outs = compress_kv(*params, cu, cfg)[:2]
    ref = compression_ref.compress_kv(*params, cu, cfg)[:2]
    with native_precision():
        nat = compression_ref.compress_kv(*params, cu, cfg)[:2]
    for name, a, b, c in zip(("k_cmp", "v_cmp"), outs, ref, nat):
        assert_close(a, b, c, dtype=torch.bfloat16, name=name)
