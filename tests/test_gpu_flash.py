"""The FlashAttention kernels (ops/flash.py) and the ops built on them — sliding window
(ops/window), compressed attention (ops/compression), full-attention baselines
(ops/full.py) — at 8K-32K tokens on the GPU, against the fp32 reference.

Every case compares o (and lse where the op returns it) and, with ``backward``, dq, dk, dv with
``fsalab.testing.check_attention``: 2x PyTorch's own error in the dtype plus the dtype floor,
buffers NaN-poisoned. fp16 cases share d = 96 and bf16 cases d = 128 (plus one d = 256), so few
kernel variants are compiled. The backward must also be bitwise deterministic.
"""

from __future__ import annotations

import pytest
import torch

from fsalab.config import NSAConfig
from fsalab.ops.compression import compressed_attention
from fsalab.ops.compression import reference as compression_ref
from fsalab.ops.full import full_attention
from fsalab.ops.window import flash_attn_varlen, window_attention
from fsalab.ops.window import reference as window_ref
from fsalab.testing import check_attention, compressed_inputs, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_flash_buffers")]

CFG = NSAConfig()  # l = 32, s = 16
W = 512
VARLEN_8K = [1, 700, 3000, 4491]  # one token, short and long sequences in one batch
BF16, FP16 = torch.bfloat16, torch.float16

CASES = [
    # mode, impl, lengths, g, h_kv, d, dtype, backward
    ("window", "triton", VARLEN_8K, 4, 2, 128, BF16, True),
    ("window", "triton", VARLEN_8K, 5, 2, 96, FP16, True),
    ("window", "triton", [32768], 16, 1, 128, BF16, True),
    ("window", "triton", [20000, 12768], 5, 2, 96, FP16, False),
    ("window", "triton", [8192], 1, 2, 256, BF16, True),
    ("compressed", "triton", VARLEN_8K, 4, 2, 128, BF16, True),
    ("compressed", "triton", VARLEN_8K, 5, 2, 96, FP16, True),
    ("compressed", "triton", [32768], 16, 1, 128, BF16, True),
    ("compressed", "triton", [20000, 12768], 5, 2, 96, FP16, False),
    ("full", "triton", VARLEN_8K, 4, 2, 128, BF16, True),
    ("full", "triton", VARLEN_8K, 5, 2, 96, FP16, True),
    ("full", "triton", [32768], 4, 1, 128, BF16, False),
    ("full", "triton", [32768], 5, 1, 96, FP16, False),
    ("full", "sdpa_flash", VARLEN_8K, 4, 2, 128, BF16, True),
    ("full", "sdpa_cudnn", [8192], 4, 2, 128, BF16, True),
    ("window", "flash_attn", VARLEN_8K, 4, 2, 128, BF16, True),
    ("full", "flash_attn", VARLEN_8K, 4, 2, 128, BF16, True),
]


def _case_id(case) -> str:
    mode, impl, lengths, g, h_kv, d, dtype, backward = case
    n = f"{sum(lengths) // 1024}K" + ("varlen" if len(lengths) > 1 else "")
    return f"{mode}-{impl}-{n}-g{g}-hkv{h_kv}-d{d}-{str(dtype)[6:]}-{'fwdbwd' if backward else 'fwd'}"


def _inputs(mode, lengths, h, h_kv, d, seed, device):
    """(q, k, v) and the extra arguments: cu_seqlens, and cu_seqlens_cmp for compressed keys."""
    if mode == "compressed":
        batch, k_cmp, v_cmp, cu_cmp = compressed_inputs(lengths, h, h_kv, d, CFG, seed, device)
        return (batch.q, k_cmp, v_cmp), batch.cu_seqlens, cu_cmp
    batch = make_batch(lengths, h, h_kv, d, seed=seed, device=device)
    return (batch.q, batch.k, batch.v), batch.cu_seqlens, None


def _op_and_reference(mode, impl, cu, cu_cmp):
    """(op(q, k, v), ref(q, k, v)) of a mode (window | compressed | full) and impl."""
    if mode == "window":
        ref = lambda q, k, v: window_ref.window_attention(q, k, v, cu, W)  # noqa: E731
    elif mode == "compressed":
        ref = lambda q, k, v: compression_ref.compressed_attention(q, k, v, cu, cu_cmp, CFG)  # noqa: E731
    else:
        ref = lambda q, k, v: window_ref.window_attention(q, k, v, cu, q.shape[0])  # noqa: E731
    if mode == "window":
        return (lambda q, k, v: window_attention(q, k, v, cu, W, backend=impl)), ref
    if mode == "compressed":
        return (lambda q, k, v: compressed_attention(q, k, v, cu, cu_cmp, CFG)), ref
    return (lambda q, k, v: full_attention(q, k, v, cu, impl=impl)), ref


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_reference(case, seed, device):
    mode, impl, lengths, g, h_kv, d, dtype, backward = case
    if impl == "flash_attn" and flash_attn_varlen() is None:
        pytest.skip("flash-attn is not installed")
    tensors, cu, cu_cmp = _inputs(mode, lengths, g * h_kv, h_kv, d, seed, device)
    op, ref = _op_and_reference(mode, impl, cu, cu_cmp)
    check_attention(op, ref, tensors, dtype, seed, grads=backward)


@pytest.mark.parametrize("mode, lengths, g, h_kv", [("window", VARLEN_8K, 4, 2), ("compressed", [32768], 16, 1)],
                         ids=["window-8Kvarlen-g4", "compressed-32K-g16"])
def test_backward_is_bitwise_deterministic(mode, lengths, g, h_kv, seed, device):
    """No atomics and fixed-order sums of the dk/dv chunk partials: two backward passes agree bit for bit."""
    tensors, cu, cu_cmp = _inputs(mode, lengths, g * h_kv, h_kv, 128, seed, device)
    op, _ = _op_and_reference(mode, "triton", cu, cu_cmp)
    q, k, v = (t.to(BF16) for t in tensors)
    do = torch.randn(q.shape, generator=torch.Generator(device=device).manual_seed(seed), device=device).to(BF16)
    grads = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = op(*leaves)
        o = out[0] if isinstance(out, tuple) else out
        grads.append(torch.autograd.grad(o, leaves, do))
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.equal(a, b), f"{name} differs between two backward passes"
