"""Kernel launches per selected-attention call, and per whole NSA attention call, stay few:
short calls are bound by the host's time to enqueue them (results/h200/checks/profile_launch.log,
scripts/count_launches.py).

The bounds are the counts after the planning was fused into a few Triton kernels (before: fsa
forward 61 aten ops + 2 Triton launches, backward 21 + 4; NSA backward 60 + 3). torch.sort
counts as one launch, however many passes CUDA runs for it.
"""

from __future__ import annotations

import pytest
import torch
from fsalab.ops.selection import selected_attention
from fsalab.testing import LaunchCounter, make_batch, nsa_attention_calls, random_block_idx

# (impl, direction) -> most launches per call.
LIMITS = {
    ("fsa", "fwd"): 9,  # index (3), work list (scan, items), non-finite value blocks, partials (plain, containing), merge
    ("fsa", "bwd"): 6,  # delta, work list (scan, items), dK/dV + dq partials, split-row merge, dq merge
    ("fsa_paper", "fwd"): 9,  # index (3), non-finite value blocks, statistics + merge, main kernel (plain, containing) + sum
    ("fsa_paper", "bwd"): 7,  # delta, dq partials + sum, work list (2), dK/dV, split-row merge
    ("nsa", "fwd"): 2,  # token starts, forward
    ("nsa", "bwd"): 8,  # dq, index (3), segment plan (2), dK/dV, segment merge
}


@pytest.mark.parametrize("impl,direction", sorted(LIMITS))
def test_launches_per_call(impl, direction, monkeypatch, device):
    monkeypatch.setenv("FSALAB_VALUE_CHECKS", "0")  # checks add ops; the benchmark times without them
    batch = make_batch([40, 1, 23], 4, 2, 16, dtype=torch.float16, device=device, seed=0)
    block_idx = random_block_idx(batch.cu_seqlens, 2, 3, 16, torch.Generator().manual_seed(0))
    leaves = [t.clone().requires_grad_(direction == "bwd") for t in (batch.q, batch.k, batch.v)]

    def call():
        return selected_attention(*leaves, block_idx, batch.cu_seqlens, 16, impl=impl)

    if direction == "fwd":
        with torch.no_grad():
            call()  # outside the count: one-time work (compilation, caches)
            with LaunchCounter() as counter:
                call()
    else:
        o, _ = call()
        do = torch.randn_like(o)
        torch.autograd.grad(o, leaves, do, retain_graph=True)
        with LaunchCounter() as counter:
            torch.autograd.grad(o, leaves, do, retain_graph=True)
    assert counter.total <= LIMITS[impl, direction], dict(counter.counts)


# Whole NSA attention (compression, compressed attention, selection, selected and window
# attention, gates), impl -> (fwd, bwd) launches, Triton + aten ops. fsa forward: 10 + 19 before
# the gated sum became one kernel per direction (ops/gate.py), 11 + 13 after, 12 + 1 since the
# compressed offsets are one kernel (compression.compressed_offsets; the aten op left is the
# index's sort), 14 + 1 since FSA's forward keeps NaN/Inf values causal in two extra launches
# (the blocks holding them flagged, their partials recomputed), so that its common path never
# inspects V. Backward: 20 aten ops + 15 Triton, then 12 + 16 since the position-embedding
# gradient is one kernel (its arange/lt/mul/sum/einsum/casts were 8 ops); the 12 left are
# autograd's gradient sums over the three branches (6 adds) and zero fills (6).
NSA_ATTENTION_LIMITS = {"fsa": (15, 28), "nsa": (8, 29)}


@pytest.mark.parametrize("impl", sorted(NSA_ATTENTION_LIMITS))
def test_launches_per_nsa_attention_call(impl, monkeypatch, device):
    monkeypatch.setenv("FSALAB_VALUE_CHECKS", "0")
    for fn, limit in zip(nsa_attention_calls(impl, 128, 1, 1, 16, 32, 4, device=device), NSA_ATTENTION_LIMITS[impl]):
        fn()  # outside the count: one-time work (compilation, caches)
        with LaunchCounter() as counter:
            fn()
        assert counter.total <= limit, dict(counter.counts)
