"""NativeSparseAttention: gradients, packed vs padded input, RoPE, the kernel branches against the references."""

import pytest
import torch
from torch.func import functional_call

from fsalab.config import NSAConfig
from fsalab.modules import NativeSparseAttention
from fsalab.modules.rope import apply_rope, rope_inv_freq
from fsalab.testing import cu_seqlens_of

TINY = NSAConfig(kernel_size=8, kernel_stride=4, block_size=16, topk=2, init_blocks=1, local_blocks=1, window_size=8)
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def tiny_module(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    return NativeSparseAttention(16, 4, 2, head_dim=4, config=TINY, dtype=dtype, **kw)


def test_gradcheck_float64():
    module = tiny_module(rope_scaling=LLAMA3_SCALING, rope_theta=500000.0)
    cu = cu_seqlens_of([40, 9, 3])
    x = torch.randn(52, 16, dtype=torch.float64, requires_grad=True)
    names = ["compress_k", "compress_v", "compress_pe", "gate_proj.weight", "q_proj.weight"]
    params = {n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters() if n in names}

    def f(x, *tensors):
        return functional_call(module, dict(zip(params, tensors)), (x, cu))

    assert torch.autograd.gradcheck(f, (x, *params.values()), fast_mode=True)


def test_padded_batch_equals_packed_sequences():
    module = tiny_module(dtype=torch.float32)
    lengths = torch.tensor([37, 12, 50])
    x = torch.randn(3, 50, 16)
    out = module(x, lengths=lengths)
    assert out.shape == x.shape
    for b, n in enumerate(lengths.tolist()):
        alone = module(x[b, :n], cu_seqlens_of([n]))
        torch.testing.assert_close(out[b, :n], alone, atol=1e-5, rtol=1e-5)
        assert torch.equal(out[b, n:], torch.zeros_like(out[b, n:]))
    full = module(x)
    torch.testing.assert_close(full[2], module(x[2], cu_seqlens_of([50])), atol=1e-5, rtol=1e-5)


def test_forward_backward_default_config():
    module = NativeSparseAttention(64, 4, 1, config=NSAConfig(topk=4, window_size=128))
    x = torch.randn(600, 64, requires_grad=True)
    out = module(x, cu_seqlens_of([450, 150]))
    out.square().mean().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters())
    assert module.compress_pe.grad.abs().sum() > 0, "the PE must receive gradient through compressed attention"


def test_rope_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=4, head_dim=128, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING,
        max_position_embeddings=131072,
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, LLAMA3_SCALING), theirs.float(), rtol=1e-6, atol=0)


def test_rope_rotates_pairs_and_keeps_norms():
    inv_freq = rope_inv_freq(8, 10000.0)
    x = torch.randn(5, 2, 8, dtype=torch.float64)
    pos = torch.arange(5)
    y = apply_rope(x, pos, inv_freq)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[0], x[0])
    # Relative property: <R(p)a, R(p)b> depends only on the offset.
    a, b = x[0, 0], x[1, 0]
    dots = [(apply_rope(a[None, None], torch.tensor([p]), inv_freq) * apply_rope(b[None, None], torch.tensor([p + 3]), inv_freq)).sum() for p in range(3)]
    torch.testing.assert_close(dots[0], dots[2])


def test_gate_impl_reaches_the_gated_sum():
    """The module's gate_impl picks the gated sum: the fused kernels (under the interpreter here)
    run forward and backward for "triton" and not for "reference", and both give the same output
    and input gradient; an unknown branch name fails at construction."""
    from fsalab.testing import LaunchCounter

    x = torch.randn(60, 16)
    cu = cu_seqlens_of([45, 15])
    outs, grads = [], []
    for impl in ("reference", "triton"):
        xi = x.clone().requires_grad_()
        with LaunchCounter() as launches:
            out = tiny_module(dtype=torch.float32, gate_impl=impl)(xi, cu)
            out.square().sum().backward()
        fused = {k: launches.counts[f"triton:_gated_sum_{k}"] for k in ("fwd", "bwd")}
        assert fused == ({"fwd": 1, "bwd": 1} if impl == "triton" else {"fwd": 0, "bwd": 0}), (impl, fused)
        outs.append(out.detach())
        grads.append(xi.grad)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-5)
    for bad in ({"gate_impl": "fused"}, {"window_impl": "flash"}, {"compression_impl": "cuda"}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be one of"):
            tiny_module(dtype=torch.float32, **bad)


@pytest.mark.slow(20)
@pytest.mark.parametrize("selection_impl,dtype", [("fsa", torch.float32), ("nsa", torch.float16)])
@pytest.mark.usefixtures("poison_every_allocation")
def test_kernel_branches_match_the_reference_module(selection_impl, dtype):
    """Every branch on its Triton kernel (compress_kv, compressed attention, block selection, the
    selected attention, window, gated sum; interpreted here) against the same weights on the
    PyTorch references in float64: the output, the input's gradient and every parameter's, within
    twice what the reference module makes in the dtype itself, with every allocation poisoned (an
    element a kernel leaves unwritten fails). The packed batch holds one token, fewer tokens than
    kernel_size, a block and a bit, and several blocks; g = 3, d = 16. A fixed seed: a near-tie
    between two blocks' scores would pick another block, not a rounding error."""
    from fsalab.ops.reference_common import native_precision
    from fsalab.testing import LaunchCounter, assert_close

    cfg = NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=2, init_blocks=1, local_blocks=1,
                    window_size=16)
    references = dict(compression_impl="reference", selection_impl="reference", window_impl="reference",
                      gate_impl="reference")

    def build(dtype, **impls):
        torch.manual_seed(0)
        return NativeSparseAttention(48, 6, 2, head_dim=16, config=cfg, dtype=dtype, **impls)

    kernels = build(dtype, compression_impl="triton", selection_impl=selection_impl, window_impl="triton",
                    gate_impl="triton")
    exact, native = build(torch.float64, **references), build(dtype, **references)
    exact.load_state_dict({k: v.double() for k, v in kernels.state_dict().items()})
    native.load_state_dict(kernels.state_dict())
    cu = cu_seqlens_of([1, 15, 20, 70])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(106, 48, generator=gen)
    dout = torch.randn(106, 48, generator=gen)

    def output_and_grads(module, dt):
        xi = x.to(dt).clone().requires_grad_()
        out = module(xi, cu)
        (out.double() * dout.double()).sum().backward()
        grads = {f"{n}.grad": p.grad for n, p in module.named_parameters()}
        return {"output": out.detach(), "x.grad": xi.grad, **grads}

    with LaunchCounter() as launches:
        got = output_and_grads(kernels, dtype)
    want = output_and_grads(exact, torch.float64)
    with native_precision():
        own = output_and_grads(native, dtype)
    # every branch ran on its kernels, forward and backward
    ran = {name.removeprefix("triton:") for name, n in launches.counts.items() if n}
    want_ran = {"_compress_fwd_kernel", "_compress_dx_kernel", "_compress_dw_kernel", "_compress_dpe_kernel",
                "_select_kernel", "_fwd_kernel", "_dq_kernel", "_dkdv_kernel", "_gated_sum_fwd", "_gated_sum_bwd",
                {"fsa": "_merge_kernel", "nsa": "_bwd_dq_kernel"}[selection_impl]}
    assert want_ran <= ran, sorted(want_ran - ran)
    for name in got:
        assert got[name] is not None, f"{name} got no gradient"
        assert_close(got[name], want[name], own[name], dtype=dtype, name=name)


@pytest.mark.parametrize("selection_impl", ["auto", None])
def test_auto_is_the_reference_off_cuda(selection_impl, monkeypatch):
    """"auto" (the default) means the kernels on CUDA and the reference elsewhere, for the
    selection branch as for the others: on a CPU without the Triton interpreter it runs."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(60, 16, dtype=torch.float64)
    cu = cu_seqlens_of([40, 20])
    auto = tiny_module(selection_impl=selection_impl)
    reference = tiny_module(selection_impl="reference", compression_impl="reference", window_impl="reference",
                            gate_impl="reference")
    assert torch.equal(auto(x, cu), reference(x, cu))
