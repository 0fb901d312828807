"""Selected attention at 4K-64K tokens on the GPU: NSA's query-outer kernel (selected/nsa.py)
and FSA's KV-block-outer kernels (selected/fsa*.py, both variants and the paper's ablation
switches), against the fp32 reference.

Block indices come from NSA's compression path on random inputs (``fsalab.bench.inputs``), as
in the benchmarks. o and lse, and with ``backward`` dq, dk, dv of the loss sum(o * do), must lie
within 2x PyTorch's own error in the dtype plus the dtype floor (``fsalab.testing.assert_close``).
The backward runs where the reference's autograd graph fits (8K); longer cases check the forward.
"""

from __future__ import annotations

import functools

import pytest
import torch

from fsalab.bench import grid
from fsalab.bench.inputs import make_inputs
from fsalab.bench.points import KernelPoint
from fsalab.config import NSAConfig
from fsalab.ops.reference_common import native_precision
from fsalab.ops.selected import reference as selected_ref
from fsalab.ops.selected import resolve
from fsalab.ops.selected.fsa import selected_attention_fsa_paper
from fsalab.testing import assert_close, check_selected_attention, make_batch, selected_blocks

# Fresh allocations poisoned (NaN, integer minimum): back-to-back cases of one shape would
# otherwise be handed the previous case's correct, freed output by the caching allocator.
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_every_allocation")]

# The paper's ablation switches of fsa_paper (FSA Fig. 9): name -> (inner_loop, early_return).
SWITCHES = {"fsa_paper_no_inner_loop": (False, True), "fsa_paper_no_early_return": (True, False),
            "fsa_paper_neither": (False, False)}
MULTI_SHORT = [5] * 40 + [100] * 10 + [7000]  # many short packed sequences and one long one


def _point(n, g, block_size=64, topk=16, dtype="bfloat16", batch=1, h_kv=4, d=128, seed=0) -> KernelPoint:
    return grid.kernel_point({"op": "selected", "impl": "reference", "direction": "fwd", "N": n, "g": g, "h_kv": h_kv,
                              "d": d, "batch": batch, "block_size": block_size, "topk": topk, "dtype": dtype,
                              "seed": seed}, "test_gpu_selection")


CASES = [
    # impl, point, backward
    *((impl, _point(8192, 1), True) for impl in ("nsa", "fsa", "fsa_paper", *SWITCHES)),
    *((impl, _point(8192, 4, dtype="float16"), True) for impl in ("nsa", "fsa", "fsa_paper")),
    *((impl, _point(8192, 5), True) for impl in ("nsa", "fsa", "fsa_paper")),
    *((impl, _point(8192, 8, 128, 8, dtype="float16"), True) for impl in ("fsa", "fsa_paper")),
    *((impl, _point(4096, 4, batch=2), True) for impl in ("fsa", "fsa_paper")),
    *((impl, _point(8192, 5, dtype="float16", d=96, h_kv=2), True) for impl in ("nsa", "fsa")),
    *((impl, _point(32768, 1, dtype="float16"), False) for impl in ("nsa", "fsa", "fsa_paper")),
    *((impl, _point(32768, 8), False) for impl in ("nsa", "fsa", "fsa_paper")),
    *((impl, _point(32768, 16), False) for impl in ("nsa", "fsa")),
    *((impl, _point(65536, 4), False) for impl in ("fsa", "fsa_paper")),
    *((impl, _point(65536, 5, dtype="float16"), False) for impl in ("fsa", "fsa_paper")),
]


def _case_id(case) -> str:
    impl, p, backward = case
    return (f"{impl}-{p['batch']}x{p['N'] // 1024}K-g{p['g']}-hkv{p['h_kv']}-d{p['d']}-B{p['block_size']}"
            f"T{p['topk']}-{p['dtype']}-{'fwdbwd' if backward else 'fwd'}")


def _impl(name: str):
    if name in SWITCHES:
        inner_loop, early_return = SWITCHES[name]
        return functools.partial(selected_attention_fsa_paper, inner_loop=inner_loop, early_return=early_return)
    return resolve(name)


def _run(fn, q, k, v, block_idx, cu, block_size, do, backward):
    """[o, lse(, dq, dk, dv)] of ``fn`` for the loss sum(o * do)."""
    leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    with torch.set_grad_enabled(backward):
        o, lse = fn(*leaves, block_idx, cu, block_size)
        out = [o.detach(), lse.detach()]
        if backward:
            out += list(torch.autograd.grad(o, leaves, do.to(o.dtype)))
    return out


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_reference(case, device):
    impl, p, backward = case
    fn = _impl(impl)
    x = make_inputs(p, device)
    q, k, v = (x.tensors[n] for n in ("q", "k", "v"))
    bs, cu, block_idx = p["block_size"], x.cu_seqlens, x.block_idx
    do = torch.randn(q.shape, generator=torch.Generator(device=device).manual_seed(p["seed"] + 1), device=device)
    actual = _run(fn, q, k, v, block_idx, cu, bs, do, backward)
    expected = _run(selected_ref.selected_attention, q.float(), k.float(), v.float(), block_idx, cu, bs, do, backward)
    with native_precision():
        native = _run(selected_ref.selected_attention, q, k, v, block_idx, cu, bs, do, backward)
    assert actual[0].dtype == q.dtype and actual[1].dtype == torch.float32
    for name, a, e, n in zip(("o", "lse", "dq", "dk", "dv"), actual, expected, native):
        assert_close(a, e, n, dtype=q.dtype, name=name)


def test_packed_short_sequences_match_reference(device):
    """Fifty short sequences and one long one in a batch (most rows select fewer than T blocks)."""
    cfg = NSAConfig()
    batch = make_batch(MULTI_SHORT, 32, 2, 128, dtype=torch.bfloat16, device=device, seed=3)
    block_idx = selected_blocks(batch, cfg, torch.Generator().manual_seed(4))
    for impl in ("nsa", "fsa", "fsa_paper"):
        check_selected_attention(resolve(impl), batch, block_idx, cfg.block_size)
