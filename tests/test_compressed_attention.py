"""Compressed attention (ops/compression.compressed_attention) equals reference.compressed_attention,
in the compressed-buffer layout of compress_kv (total // s rows, padding rows past cu_seqlens_cmp[-1])."""

from __future__ import annotations

import pytest
import torch

from fsalab.config import NSAConfig
from fsalab.ops.compression import compressed_attention
from fsalab.ops.compression import reference as compression_ref
from fsalab.testing import check_attention, compressed_inputs

pytestmark = pytest.mark.usefixtures("poison_flash_buffers")

DEFAULT = NSAConfig()
SMALL = NSAConfig(kernel_size=16, kernel_stride=16, block_size=16, topk=3)


def _check(lengths, h, h_kv, d, cfg, dtype, seed, device, q_scale=1.0):
    b, k_cmp, v_cmp, cu_cmp = compressed_inputs(lengths, h, h_kv, d, cfg, seed, device)
    cu = b.cu_seqlens
    return check_attention(
        lambda q, k, v: compressed_attention(q, k, v, cu, cu_cmp, cfg),
        lambda q, k, v: compression_ref.compressed_attention(q, k, v, cu, cu_cmp, cfg),
        (b.q * q_scale, k_cmp, v_cmp), dtype, seed,
    )


@pytest.mark.parametrize(
    "lengths,cfg,dtype",
    [
        # shorter than kernel_size, exactly kernel_size, one stride past it, a longer one
        ([5, 31, 32, 48, 120], DEFAULT, torch.float32),
        ([5, 31, 32, 48, 120], DEFAULT, torch.float16),
        # many short sequences (several see nothing) and a long one; stride = kernel_size
        ([3, 16, 1, 20, 7, 15, 33, 2, 90], SMALL, torch.float16),
    ],
)
def test_matches_reference(lengths, cfg, dtype, seed, device):
    _check(lengths, 4, 2, 32, cfg, dtype, seed, device)


def test_large_logits(seed, device):
    _check([40, 100], 2, 1, 64, SMALL, torch.float16, seed, device, q_scale=16.0)


def test_padding_rows_unread_and_zero_grad(seed, device):
    b, k_cmp, v_cmp, cu_cmp = compressed_inputs([50, 70], 2, 1, 32, DEFAULT, seed, device)
    n_valid = int(cu_cmp[-1])
    assert n_valid < k_cmp.shape[0]  # the layout has padding rows
    k_pad, v_pad = k_cmp.clone(), v_cmp.clone()
    k_pad[n_valid:], v_pad[n_valid:] = float("nan"), float("nan")
    o, lse = compressed_attention(b.q, k_pad, v_pad, b.cu_seqlens, cu_cmp, DEFAULT)
    ro, rl = compressed_attention(b.q, k_cmp, v_cmp, b.cu_seqlens, cu_cmp, DEFAULT)
    assert torch.equal(o, ro) and torch.equal(lse, rl)
    k_cmp.requires_grad_()
    v_cmp.requires_grad_()
    o, _ = compressed_attention(b.q, k_cmp, v_cmp, b.cu_seqlens, cu_cmp, DEFAULT)
    o.sum().backward()
    assert torch.all(k_cmp.grad[n_valid:] == 0) and torch.all(v_cmp.grad[n_valid:] == 0)


def test_single_token_sees_nothing(seed, device):
    o, lse = _check([1], 2, 2, 16, SMALL, torch.float32, seed, device)
    assert torch.all(o == 0) and torch.all(lse == float("-inf"))


def test_rejects_non_config(seed):
    b, k_cmp, v_cmp, cu_cmp = compressed_inputs([40], 2, 1, 16, SMALL, seed)
    with pytest.raises(TypeError, match="NSAConfig"):
        compressed_attention(b.q, k_cmp, v_cmp, b.cu_seqlens, cu_cmp, {"kernel_size": 16})


@pytest.mark.gpu
@pytest.mark.parametrize("g", [1, 4, 5])
def test_bf16_gpu(g, seed, device):
    _check([2000, 31, 1, 900], 2 * g, 2, 128, DEFAULT, torch.bfloat16, seed, device)
