"""Whole NSA attention as one op (``ops.attention.nsa_attention``) on CPU, under the interpreter.

Where every branch runs fsalab's kernels the call is one autograd node whose backward kernels add
their gradients into one set of buffers. Against the same kernels composed by autograd (one node
per branch): the same forward bits and selected blocks, gradients within the rounding of the
sums autograd makes in fp16. In fp32 against the branches' fp32 PyTorch references. Every
buffer written (NaN-poisoned allocations), RoPE inside the op, the decode cache a prefill fills,
and clear errors on bad input. Launch counts: tests/test_launch_count.py; bf16 at scale:
tests/test_gpu_models.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from fsalab.config import NSAConfig
from fsalab.ops import attention
from fsalab.ops.decode import NSADecodeCache
from fsalab.testing import LaunchCounter, cu_seqlens_of, make_batch, poisoned_allocations

CFG = NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=2, init_blocks=1, local_blocks=1, window_size=16)
# A sequence of several blocks and compressed tokens, one of one token, one shorter than a block.
LENGTHS = [40, 1, 9, 23]
KERNELS = ("triton", "triton", "triton")  # compression, window, gate


def _inputs(dtype, g=2, h_kv=2, d=16, seed=0, rotary=True):
    """(q, k, v, w_k, w_v, pe, gate_logits) as leaves, cu_seqlens and (cos, sin) or None."""
    b = make_batch(LENGTHS, g * h_kv, h_kv, d, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    w_k, w_v = ((torch.randn(h_kv, CFG.kernel_size * d, d, generator=gen) / d).to(dtype) for _ in range(2))
    pe = (torch.randn(h_kv, CFG.kernel_size, d, generator=gen) * 0.02).to(dtype)
    gates = torch.randn(b.q.shape[0], g * h_kv, 3, generator=gen).to(dtype)
    angles = torch.randn(b.q.shape[0], d // 2, generator=gen)
    emb = torch.cat([angles, angles], dim=-1)
    cos_sin = (emb.cos().to(dtype), emb.sin().to(dtype)) if rotary else None
    leaves = [t.detach().clone().requires_grad_() for t in (b.q, b.k, b.v, w_k, w_v, pe, gates)]
    return leaves, b.cu_seqlens, cos_sin


def _run(leaves, cu, rotary, selection, impls=KERNELS, seed=3):
    """(o, block_idx, gradients of the seven leaves) of one call and its backward."""
    compression, window, gate = impls
    o, block_idx = attention.nsa_attention(*leaves, cu, CFG, rotary, compression, selection, window, gate,
                                           return_indices=True)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed)).to(o.dtype)
    return o, block_idx, torch.autograd.grad(o, leaves, do)


@contextlib.contextmanager
def _branches_composed(monkeypatch, composed: bool = True):
    """Inside it (where ``composed``), the one-node op is off: each branch's own op and autograd node."""
    with monkeypatch.context() as m:
        if composed:
            m.setattr(attention, "fused", lambda *a: False)
        yield


def _composed(monkeypatch, *args, **kwargs):
    """``_run`` with the branches composed."""
    with _branches_composed(monkeypatch):
        return _run(*args, **kwargs)


@pytest.mark.slow(20)
@pytest.mark.parametrize("selection,rotary", [("fsa", True), ("nsa", False), ("fsa_paper", True), ("auto", False)])
def test_one_node_matches_the_composed_branches(selection, rotary, monkeypatch):
    leaves, cu, cos_sin = _inputs(torch.float16, rotary=rotary)
    assert attention.fused(*KERNELS[:1], selection, *KERNELS[1:], leaves[0])
    o, block_idx, grads = _run(leaves, cu, cos_sin, selection)
    o_ref, block_ref, grads_ref = _composed(monkeypatch, leaves, cu, cos_sin, selection)
    assert torch.equal(block_idx, block_ref) and torch.equal(o, o_ref)
    for name, a, b in zip(("q", "k", "v", "w_k", "w_v", "pe", "gate"), grads, grads_ref):
        assert not torch.isnan(a).any(), name
        # Each sum rounds once in the kernels, after each addend in autograd's: a few fp16 ulps.
        bound = 4 * torch.finfo(torch.float16).eps * max(b.abs().max().item(), 1.0)
        assert (a.float() - b.float()).abs().max().item() <= bound, name


def _described(x):
    """A launch argument as the kernel sees it, without its address: a tensor's shape, strides
    and dtype (whether it is a view of a call's scratch depends on the shapes run before); anything
    else as it is."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.stride(), x.dtype
    return x


def _forward_launches(monkeypatch, fused: bool, leaves, cu) -> list:
    """(kernel, its arguments, its keywords but the grid function) of each Triton launch of one
    forward without gradients, in order."""
    seen = []

    def record(kernel, args, kwargs):
        seen.append((kernel.fn.__name__, [_described(a) for a in args],
                     {k: _described(v) for k, v in kwargs.items() if k != "grid"}))

    with _branches_composed(monkeypatch, not fused), torch.no_grad(), LaunchCounter(on_triton_launch=record):
        attention.nsa_attention(*leaves, cu, CFG, None, "triton", "fsa", "triton", "triton")
    return seen


@pytest.mark.slow(10)
def test_one_node_forward_launches_the_composed_forwards_kernels(monkeypatch):
    """The node's forward and the composed one launch the same kernels in the same order, with
    the same tiles and arguments (tensors of the same shapes and strides)."""
    leaves, cu, _ = _inputs(torch.float16, rotary=False)
    node = _forward_launches(monkeypatch, True, leaves, cu)
    assert len(node) > 10
    assert node == _forward_launches(monkeypatch, False, leaves, cu)


@pytest.mark.slow(15)
def test_one_node_matches_the_fp32_references_at_g3(monkeypatch):
    """fp32 kernels (g = 3, not a power of two) against the composed fp32 references."""
    leaves, cu, cos_sin = _inputs(torch.float32, g=3, h_kv=1, seed=5)
    o, block_idx, grads = _run(leaves, cu, cos_sin, "fsa")
    o_ref, block_ref, grads_ref = _run(leaves, cu, cos_sin, "reference", impls=("reference",) * 3)
    assert torch.equal(block_idx, block_ref.to(torch.int32))
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    for name, a, b in zip(("q", "k", "v", "w_k", "w_v", "pe", "gate"), grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.slow(8)
def test_every_gradient_element_is_written():
    """NaN-filled allocations: a buffer the op adds to or returns without writing shows up."""
    leaves, cu, cos_sin = _inputs(torch.float16)
    o, _, grads = _run(leaves, cu, cos_sin, "fsa")
    with poisoned_allocations():
        o_p, _, grads_p = _run(leaves, cu, cos_sin, "fsa")
    assert torch.equal(o, o_p)
    for a, b in zip(grads, grads_p):
        assert torch.equal(a, b)


@pytest.mark.slow(8)
def test_a_prefill_fills_the_cache_as_the_composed_branches_do(monkeypatch):
    leaves, cu, cos_sin = _inputs(torch.float16)
    caches = [NSADecodeCache.allocate(len(LENGTHS), 48, 2, 16, CFG, torch.float16, "cpu", num_heads=4) for _ in range(2)]
    with torch.no_grad():
        attention.nsa_attention(*leaves, cu, CFG, cos_sin, "triton", "fsa", "triton", "triton", cache=caches[0])
        with _branches_composed(monkeypatch):
            attention.nsa_attention(*leaves, cu, CFG, cos_sin, "triton", "fsa", "triton", "triton", cache=caches[1])
    for name in ("k", "v", "k_cmp", "v_cmp", "k_recent", "lengths"):
        assert torch.equal(getattr(caches[0], name), getattr(caches[1], name)), name


def test_bad_inputs_are_rejected_before_any_kernel():
    leaves, cu, (cos, sin) = _inputs(torch.float16)
    q, k, v, w_k, w_v, pe, gates = leaves
    call = lambda *a, **kw: attention.nsa_attention(*a, cu, CFG, **kw, selection_impl="fsa", compression_impl="triton",
                                                    window_impl="triton", gate_impl="triton")  # noqa: E731
    with pytest.raises(ValueError, match="gate_logits"):
        call(q, k, v, w_k, w_v, pe, gates[:, :2])
    with pytest.raises(ValueError, match="rotary cos"):
        call(q, k, v, w_k, w_v, pe, gates, rotary=(cos[:-1], sin))
    with pytest.raises(ValueError, match="w_k"):
        call(q, k, v, w_k[:, :-1], w_v, pe, gates)
    with pytest.raises(ValueError, match="cu_seqlens"):
        attention.nsa_attention(q, k, v, w_k, w_v, pe, gates, cu_seqlens_of([40, 1, 9, 22]), CFG, None, "triton", "fsa",
                                "triton", "triton")
    with pytest.raises(TypeError, match="NSAConfig"):
        attention.nsa_attention(q, k, v, w_k, w_v, pe, gates, cu, {"topk": 2})


@pytest.mark.gpu
@pytest.mark.parametrize("selection,g", [("auto", 4), ("fsa", 5), ("nsa", 1)])
def test_one_node_matches_the_composed_branches_on_the_gpu(selection, g, monkeypatch, tmp_path):
    """bf16 at the published config (l = 32, s = 16, (64, 16), w = 512), d = 128, varlen with RoPE:
    the same forward bits and blocks, gradients within bf16 rounding of the composed branches'."""
    monkeypatch.setenv("FSALAB_DISPATCH_CACHE", str(tmp_path / "dispatch.json"))
    cfg = NSAConfig(kernel_size=32, kernel_stride=16, block_size=64, topk=16, init_blocks=1, local_blocks=2,
                    window_size=512)
    lengths, h_kv, d = [5000, 3000, 100, 1], 2, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *shape, s=1.0: (torch.randn(*shape, generator=gen, device="cuda") * s).to(torch.bfloat16)  # noqa: E731
    total = sum(lengths)
    leaves = [t.requires_grad_() for t in (rnd(total, g * h_kv, d), rnd(total, h_kv, d), rnd(total, h_kv, d),
                                          rnd(h_kv, 32 * d, d, s=d ** -0.5 / 4), rnd(h_kv, 32 * d, d, s=d ** -0.5 / 4),
                                          rnd(h_kv, 32, d, s=0.02), rnd(total, g * h_kv, 3))]
    angles = torch.rand(total, d // 2, generator=gen, device="cuda") * 100
    emb = torch.cat([angles, angles], dim=-1)
    rotary = (emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16))
    cu = cu_seqlens_of(lengths, "cuda")
    do = rnd(total, g * h_kv, d)

    def run():
        o, block_idx = attention.nsa_attention(*leaves, cu, cfg, rotary, "auto", selection, "triton", "auto",
                                               return_indices=True)
        return o, block_idx, torch.autograd.grad(o, leaves, do)

    o, block_idx, grads = run()
    with _branches_composed(monkeypatch):
        o_ref, block_ref, grads_ref = run()
    assert torch.equal(block_idx, block_ref) and torch.equal(o, o_ref)
    for name, a, b in zip(("q", "k", "v", "w_k", "w_v", "pe", "gate"), grads, grads_ref):
        assert torch.isfinite(a).all(), name
        bound = 4 * torch.finfo(torch.bfloat16).eps * b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= bound, name


@pytest.mark.slow(40)
def test_the_ab_script_runs(tmp_path):
    """scripts/ab_one_node.py (the GPU A/B behind docs/performance.md's table) still runs against the
    op's API: one tiny CPU shape, the same forward bits both ways, a table and its JSON."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "scripts" / "ab_one_node.py")], capture_output=True, text=True,
                          timeout=600, check=False,
                          env={**os.environ, "AB_SMOKE": "1", "OUT": str(tmp_path), "PYTHONPATH": str(root / "src")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fwd equal True" in proc.stdout, proc.stdout[-2000:]
    rows = json.loads((tmp_path / "ab_node.json").read_text())
    assert rows and rows[0]["launches"]["fused"] < rows[0]["launches"]["composed"]
