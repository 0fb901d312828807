"""Sliding-window attention (ops/window): every backend equals window.reference.window_attention."""

from __future__ import annotations

import pytest
import torch

from fsalab.ops import window
from fsalab.ops.window import reference as window_ref
from fsalab.testing import assert_close, check_attention, make_batch

pytestmark = pytest.mark.usefixtures("poison_flash_buffers")


def _check(lengths, h, h_kv, d, w, dtype, seed, device, backend="triton", grads=True):
    b = make_batch(lengths, h, h_kv, d, seed=seed, device=device)
    cu = b.cu_seqlens
    check_attention(
        lambda q, k, v: window.window_attention(q, k, v, cu, w, backend=backend),
        lambda q, k, v: window_ref.window_attention(q, k, v, cu, w),
        (b.q, b.k, b.v), dtype, seed, grads=grads,
    )


@pytest.mark.parametrize(
    "lengths,w,dtype",
    [
        ([1, 40, 7], 1, torch.float32),  # each query sees only itself; a single-token sequence
        ([3, 1, 5, 2, 9, 4, 1, 6, 2, 80], 24, torch.float16),  # many short sequences and a long one
        ([60, 33], 64, torch.float32),  # window between the two lengths
        ([45, 17], 300, torch.float16),  # window longer than every sequence: causal attention
    ],
)
def test_triton_matches_reference(lengths, w, dtype, seed, device):
    _check(lengths, 4, 2, 32, w, dtype, seed, device)


def test_auto_off_cuda_is_triton(seed):
    b = make_batch([30, 12], 2, 1, 16, seed=seed)
    o_auto, lse_auto = window.window_attention(b.q, b.k, b.v, b.cu_seqlens, 8)
    o_tri, lse_tri = window.window_attention(b.q, b.k, b.v, b.cu_seqlens, 8, backend="triton")
    assert torch.equal(o_auto, o_tri) and torch.equal(lse_auto, lse_tri)


def test_errors():
    b = make_batch([8], 2, 1, 16)
    with pytest.raises(ValueError, match="backend"):
        window.window_attention(b.q, b.k, b.v, b.cu_seqlens, 4, backend="cuda")
    with pytest.raises(ValueError, match="flash"):
        window.window_attention(b.q, b.k, b.v, b.cu_seqlens, 4, backend="flash_attn")
    with pytest.raises(ValueError, match="window_size"):
        window.window_attention(b.q, b.k, b.v, b.cu_seqlens, 0, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_backends(backend, dtype, seed, device):
    if backend == "flash_attn" and window.flash_attn_varlen() is None:
        pytest.skip("flash-attn is not installed")
    # flash-attn's lse carries no gradient: compare o's gradients only through o.
    lengths, w = [700, 1, 300, 1500], 512
    if backend == "triton":
        _check(lengths, 8, 2, 128, w, dtype, seed, device)
        return
    b = make_batch(lengths, 8, 2, 128, seed=seed, device=device)
    check_attention(
        lambda q, k, v: window.window_attention(q, k, v, b.cu_seqlens, w, backend="flash_attn", max_seqlen=1500)[0],
        lambda q, k, v: window_ref.window_attention(q, k, v, b.cu_seqlens, w),
        (b.q, b.k, b.v), dtype, seed,
    )
    _, lse = window.window_attention(b.q.to(dtype), b.k.to(dtype), b.v.to(dtype), b.cu_seqlens, w, backend="flash_attn")
    _, rl = window_ref.window_attention(b.q.to(dtype), b.k.to(dtype), b.v.to(dtype), b.cu_seqlens, w)
    assert_close(lse, rl, dtype=dtype, name="lse")
