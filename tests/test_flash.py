"""The generic FlashAttention kernels (ops/flash.py): forward o/lse and dq/dk/dv against the fp32
reference, for both masks, every head dim and group size, large logits, chunked dk/dv, and the
NaN-poisoned buffers (``poison_flash_buffers``, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from fsalab.config import NSAConfig
from fsalab.ops import flash
from fsalab.ops.compression import reference as compression_ref
from fsalab.ops.window import reference as window_ref
from fsalab.testing import LaunchCounter, assert_close, check_attention, compressed_inputs, make_batch

pytestmark = pytest.mark.usefixtures("poison_flash_buffers")


def _window(window_size):
    def op(q, k, v, cu):
        return flash.flash_attention(q, k, v, cu, mask="window", window_size=window_size)

    def ref(q, k, v, cu):
        return window_ref.window_attention(q, k, v, cu, window_size)

    return op, ref


def _compressed(cfg, cu_cmp):
    def op(q, k, v, cu):
        return flash.flash_attention(
            q, k, v, cu, cu_cmp, mask="compressed", kernel_size=cfg.kernel_size, kernel_stride=cfg.kernel_stride
        )

    def ref(q, k, v, cu):
        return compression_ref.compressed_attention(q, k, v, cu, cu_cmp, cfg)

    return op, ref


_SMALL_CFG = NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=4)


def _run(mask, lengths, h, h_kv, d, dtype, seed, device="cpu", window=16, cfg=_SMALL_CFG, q_scale=1.0):
    """check_attention of flash_attention(mask) on a random batch."""
    if mask == "window":
        b = make_batch(lengths, h, h_kv, d, seed=seed, q_scale=q_scale, device=device)
        (op, ref), tensors = _window(window), (b.q, b.k, b.v)
    else:
        b, k_cmp, v_cmp, cu_cmp = compressed_inputs(lengths, h, h_kv, d, cfg, seed, device)
        (op, ref), tensors = _compressed(cfg, cu_cmp), (b.q * q_scale, k_cmp, v_cmp)
    cu = b.cu_seqlens
    return check_attention(lambda q, k, v: op(q, k, v, cu), lambda q, k, v: ref(q, k, v, cu), tensors, dtype, seed)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_head_dims(d, seed, device):
    _run("window" if d % 128 else "compressed", [37, 20], 2, 1, d, torch.float16, seed, device)


@pytest.mark.parametrize(
    "g,mask,dtype",
    [(1, "window", torch.float32), (2, "compressed", torch.float16), (3, "window", torch.float16),
     (3, "compressed", torch.float32), (5, "compressed", torch.float32), (6, "compressed", torch.float16),
     (7, "window", torch.float32), (8, "window", torch.float32), (16, "compressed", torch.float16)],
)
def test_group_sizes(g, mask, dtype, seed, device):
    _run(mask, [29, 41] if g <= 5 else [19, 25], g, 1, 32, dtype, seed, device)


@pytest.mark.parametrize("mask", ["window", "compressed"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_large_logits(mask, dtype, seed, device):
    _run(mask, [70, 9], 2, 2, 32, dtype, seed, device, q_scale=16.0)


@pytest.mark.parametrize("mask,g", [("window", 2), ("compressed", 5)])
def test_query_chunks(mask, g, seed, device, monkeypatch):
    """dk/dv split over query chunks (fp32 partials summed in order), as on GPUs with few key tiles.

    3 chunks of 42 rows: chunk edges fall inside query tiles, rows past them belong to the next chunk."""
    monkeypatch.setattr(flash, "_num_query_chunks", lambda *args: 3)
    _run(mask, [80, 3, 41], g, 1, 32, torch.float32, seed, device, window=40)


@pytest.mark.parametrize("window", [5, 16, 47])
def test_window_tile_edges(window, seed, device):
    """Windows below, at and off the tile sizes (interpreter tiles: 32x16 query-outer, 16x32 dk/dv):
    the masked edge tiles of both sides share one loop, the interior another, over g = 3 heads."""
    _run("window", [50, 1, 33, 17], 3, 1, 32, torch.float32, seed, device, window=window)


def test_backward_is_deterministic(seed, device):
    b = make_batch([70, 25], 2, 1, 32, dtype=torch.float16, seed=seed, device=device, requires_grad=True)
    do = torch.randn(b.q.shape, generator=torch.Generator().manual_seed(seed)).half().to(device)
    grads = []
    for _ in range(2):
        o, _ = flash.flash_attention(b.q, b.k, b.v, b.cu_seqlens, window_size=1000)
        grads.append(torch.autograd.grad(o, (b.q, b.k, b.v), do))
    for first, second in zip(*grads):
        assert torch.equal(first, second)


def test_strided_inputs(seed, device):
    """q/k/v as views of one packed qkv projection (token stride != h * d) need no copy."""
    b = make_batch([50, 21], 4, 2, 32, seed=seed, device=device)
    qkv = torch.cat([b.q, b.k, b.v], dim=1)  # [total, h + 2 h_kv, d]
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    with LaunchCounter() as launches:
        o, lse = flash.flash_attention(q, k, v, b.cu_seqlens, window_size=20)
    copies = {op: n for op, n in launches.counts.items() if op in ("aten:clone", "aten:copy_", "aten:_to_copy")}
    assert not copies, copies
    ro, rl = window_ref.window_attention(b.q, b.k, b.v, b.cu_seqlens, 20)
    assert_close(o, ro, name="o")
    assert_close(lse, rl, name="lse")


def test_rows_that_see_nothing_have_zero_finite_grads(seed, device):
    """Compressed mask: queries before the first full compression window get o = 0, lse = -inf."""
    cfg = NSAConfig(kernel_size=32, kernel_stride=16, block_size=32, topk=3)
    b, k_cmp, v_cmp, cu_cmp = compressed_inputs([20, 45], 2, 1, 32, cfg, seed, device)
    q = b.q.requires_grad_()
    k_cmp.requires_grad_()
    o, lse = flash.flash_attention(q, k_cmp, v_cmp, b.cu_seqlens, cu_cmp, mask="compressed", kernel_size=32, kernel_stride=16)
    blind = torch.cat([torch.ones(20, dtype=torch.bool), torch.arange(45) < 31]).to(device)
    assert torch.all(o[blind] == 0) and torch.all(lse[blind] == float("-inf")) and torch.isfinite(lse[~blind]).all()
    o.sum().backward()
    assert torch.all(q.grad[blind] == 0) and torch.isfinite(q.grad).all() and torch.isfinite(k_cmp.grad).all()


def test_input_validation():
    b = make_batch([8, 8], 4, 2, 16)
    with pytest.raises(ValueError, match="mask"):
        flash.flash_attention(b.q, b.k, b.v, b.cu_seqlens, mask="causal", window_size=4)
    with pytest.raises(ValueError, match="window_size"):
        flash.flash_attention(b.q, b.k, b.v, b.cu_seqlens, window_size=0)
    with pytest.raises(ValueError, match="cu_seqlens_k=None"):
        flash.flash_attention(b.q, b.k, b.v, b.cu_seqlens, b.cu_seqlens, window_size=4)
    with pytest.raises(ValueError, match="kernel_stride"):
        flash.flash_attention(b.q, b.k, b.v, b.cu_seqlens, b.cu_seqlens, mask="compressed", kernel_size=4)
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        flash.flash_attention(b.q, b.k, b.v, b.cu_seqlens, b.cu_seqlens.long(), mask="compressed", kernel_size=4, kernel_stride=2)
    with pytest.raises(ValueError, match="multiple"):
        flash.flash_attention(b.q[:, :3], b.k, b.v, b.cu_seqlens, window_size=4)
    with pytest.raises(ValueError, match="scale"):
        flash.flash_attention(b.q, b.k, b.v, b.cu_seqlens, window_size=4, scale=-0.5)
    with pytest.raises(ValueError, match="head dim"):
        big = make_batch([4], 1, 1, 264)
        flash.flash_attention(big.q, big.k, big.v, big.cu_seqlens, window_size=4)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["window", "compressed"])
@pytest.mark.parametrize("d", [96, 128, 256])
def test_bf16_gpu(mask, d, seed, device):
    _run(mask, [300, 17, 1, 700], 8, 2, d, torch.bfloat16, seed, device, window=64)
