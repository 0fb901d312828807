"""The fused gated sum (ops/gate/fused.py) against gate.reference.gated_sum: output and all four gradients."""

from __future__ import annotations

import pytest
import torch

from fsalab.ops.gate import fused
from fsalab.ops.gate import reference as gate_ref
from fsalab.testing import assert_close, poison


@pytest.fixture(autouse=True)
def poison_buffers(monkeypatch):
    """Every buffer the kernels must fill starts as NaN: an unwritten element fails the comparison."""
    monkeypatch.setattr(fused, "_empty", poison)


def _check(total, h, d, dtype, gate_dtype, gen, device, logit_scale=1.0):
    outs = [torch.randn(total, h, d, generator=gen) for _ in range(3)]
    logits = torch.randn(total, h, 3, generator=gen) * logit_scale
    tensors = [*outs, logits]
    dtypes = [dtype, dtype, dtype, gate_dtype]
    leaves = [t.to(dt).to(device).requires_grad_() for t, dt in zip(tensors, dtypes)]
    exact = [t.detach().double().requires_grad_() for t in leaves]
    native = [t.detach().clone().requires_grad_() for t in leaves]
    o = fused.gated_sum(*leaves)
    ro = gate_ref.gated_sum(*exact)
    no = gate_ref.gated_sum(*native)
    assert o.dtype == dtype and o.shape == (total, h, d)
    assert_close(o, ro, no, dtype, name="o")
    do = torch.randn(total, h, d, generator=gen).to(device)
    for out in (o, ro, no):
        (out.double() * do.double()).sum().backward()
    for name, a, e, n, dt in zip(("do_cmp", "do_slc", "do_win", "dgate"), leaves, exact, native, dtypes):
        assert a.grad.dtype == dt
        assert_close(a.grad, e.grad, n.grad, dt, name=name)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_matches_reference_every_head_dim(d, gen, device):
    _check(37, 3, d, torch.float16, torch.float16, gen, device)


@pytest.mark.parametrize(
    "total,h,dtype,gate_dtype,logit_scale",
    [
        (1, 1, torch.float32, torch.float32, 1.0),  # a single token
        (200, 5, torch.float16, torch.float32, 1.0),  # g = 5 heads, fp32 logits beside fp16 outputs
        (300, 5, torch.bfloat16, torch.bfloat16, 1.0),  # no tl.dot here, so bf16 runs right under the interpreter too
        (50, 4, torch.float32, torch.float32, 40.0),  # saturated gates: σ = 0 or 1, zero gate gradients
    ],
)
def test_edge_cases(total, h, dtype, gate_dtype, logit_scale, gen, device):
    _check(total, h, 32, dtype, gate_dtype, gen, device, logit_scale)


def test_no_tokens(device):
    outs = [torch.zeros(0, 2, 16, device=device, requires_grad=True) for _ in range(3)]
    logits = torch.zeros(0, 2, 3, device=device, requires_grad=True)
    o = fused.gated_sum(*outs, logits)
    o.sum().backward()
    assert o.shape == (0, 2, 16) and logits.grad.shape == (0, 2, 3)


def test_non_contiguous_inputs(gen, device):
    """A gate view of a wider projection and a transposed output still give the reference."""
    wide = torch.randn(20, 4, 5, generator=gen).to(device)
    o_win = torch.randn(4, 20, 16, generator=gen).to(device).transpose(0, 1)
    o_cmp, o_slc = (torch.randn(20, 4, 16, generator=gen).to(device) for _ in range(2))
    logits = wide[:, :, 1:4]
    assert not logits.is_contiguous() and not o_win.is_contiguous()
    assert_close(fused.gated_sum(o_cmp, o_slc, o_win, logits), gate_ref.gated_sum(o_cmp, o_slc, o_win, logits),
                 dtype=torch.float32, name="o")


def test_errors():
    o = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="o_win"):
        fused.gated_sum(o, o, o.half(), torch.zeros(4, 2, 3))
    with pytest.raises(ValueError, match="gate_logits must be"):
        fused.gated_sum(o, o, o, torch.zeros(4, 2, 2))
    with pytest.raises(TypeError, match="dtype"):
        fused.gated_sum(o.double(), o.double(), o.double(), torch.zeros(4, 2, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("total, h, dtype", [(3000, 8, torch.bfloat16), (8192, 32, torch.bfloat16),
                                             (8192, 32, torch.float16)])
def test_on_gpu(total, h, dtype, gen, device):
    _check(total, h, 128, dtype, dtype, gen, device)


def test_gate_op_picks_by_name():
    """"auto" is the fused kernel on CUDA only; "triton" asks for it anywhere; an unknown name fails."""
    from fsalab.ops import gate_op

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert gate_op("auto", cpu) is gate_ref.gated_sum and gate_op("reference", cuda) is gate_ref.gated_sum
    assert gate_op("auto", cuda) is fused.gated_sum and gate_op("triton", cpu) is fused.gated_sum
    with pytest.raises(ValueError, match="gate impl"):
        gate_op("fused", cpu)
