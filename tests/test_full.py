"""Full causal attention baselines (ops/full.py): every impl equals the reference (causal = window
wider than every sequence), through SDPA's equal-length view and its padded path."""

from __future__ import annotations

import pytest
import torch

from fsalab.ops import full
from fsalab.ops.window import flash_attn_varlen
from fsalab.ops.window import reference as window_ref
from fsalab.testing import check_attention, make_batch

pytestmark = pytest.mark.usefixtures("poison_flash_buffers")


def _check(lengths, h, h_kv, d, impl, dtype, seed, device, max_seqlen=None, q_scale=1.0):
    b = make_batch(lengths, h, h_kv, d, seed=seed, device=device, q_scale=q_scale)
    cu, total = b.cu_seqlens, b.total
    check_attention(
        lambda q, k, v: full.full_attention(q, k, v, cu, max_seqlen, impl=impl),
        lambda q, k, v: window_ref.window_attention(q, k, v, cu, total),
        (b.q, b.k, b.v), dtype, seed,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton(dtype, seed, device):
    _check([50, 1, 17], 4, 2, 32, "triton", dtype, seed, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_many_short_sequences_large_logits(dtype, seed, device):
    """Nine packed sequences of 1-9 tokens and one of 80 (tiles straddle sequence starts), seven
    query heads on one KV head, d = 64, and logits 16x the unit scale."""
    _check([3, 1, 5, 2, 9, 4, 1, 6, 2, 80], 7, 1, 64, "triton", dtype, seed, device, q_scale=16.0)


@pytest.mark.parametrize(
    "lengths,max_seqlen",
    [([64], None), ([40, 40, 40], 40), ([50, 1, 17], None), ([50, 1, 17], 60)],
    ids=["single", "equal-lengths", "padded", "padded-loose-bound"],
)
@pytest.mark.parametrize("h,h_kv", [(4, 4), (6, 2)])
def test_sdpa_math(lengths, max_seqlen, h, h_kv, seed):
    _check(lengths, h, h_kv, 16, "sdpa_math", torch.float32, seed, "cpu", max_seqlen)


def test_errors():
    b = make_batch([8, 8], 2, 1, 16)
    with pytest.raises(ValueError, match="impl"):
        full.full_attention(b.q, b.k, b.v, b.cu_seqlens, impl="sdpa")
    with pytest.raises(ValueError, match="max_seqlen"):
        full.full_attention(b.q, b.k, b.v, b.cu_seqlens, max_seqlen=4, impl="sdpa_math")
    if not torch.cuda.is_available():
        for impl in ("sdpa_flash", "sdpa_cudnn", "flash_attn"):
            with pytest.raises(ValueError, match="CUDA"):
                full.full_attention(b.q, b.k, b.v, b.cu_seqlens, impl=impl)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["sdpa_flash", "sdpa_cudnn", "flash_attn", "triton"])
@pytest.mark.parametrize("h,h_kv", [(8, 8), (8, 2)])
def test_gpu_impls(impl, h, h_kv, seed, device):
    if impl == "flash_attn" and flash_attn_varlen() is None:
        pytest.skip("flash-attn is not installed")
    _check([1024, 1, 333], h, h_kv, 128, impl, torch.bfloat16, seed, device, max_seqlen=1024)
    _check([512, 512], h, h_kv, 128, impl, torch.bfloat16, seed, device, max_seqlen=512)
