"""Kernel launches per selected-attention call, and per whole NSA attention call, stay few:
short calls are bound by the host's time to enqueue them (docs/performance.md, "Whole NSA
attention"; scripts/count_launches.py).

The bounds are the counts after the planning was fused into a few Triton kernels (before: fsa
forward 61 aten ops + 2 Triton launches, backward 21 + 4; NSA backward 60 + 3). torch.sort
counts as one launch, however many passes CUDA runs for it.
"""

from __future__ import annotations

import pytest
import torch
from fsalab import settings
from fsalab.bench.kernel import nsa_attention_calls
from fsalab.ops.selected import selected_attention
from fsalab.testing import LaunchCounter, make_batch, nsa_module_forward, random_block_idx

# (impl, direction) -> most launches per call.
LIMITS = {
    ("fsa", "fwd"): 9,  # index (3), work list (scan, items), non-finite value blocks, partials (plain, containing), merge
    ("fsa", "bwd"): 6,  # delta, work list (scan, items), dK/dV + dq partials, split-row merge, dq merge
    ("fsa_paper", "fwd"): 9,  # index (3), non-finite value blocks, statistics + merge, main kernel (plain, containing) + sum
    ("fsa_paper", "bwd"): 7,  # delta, dq partials + sum, work list (2), dK/dV, split-row merge
    ("nsa", "fwd"): 2,  # token starts, forward
    ("nsa", "bwd"): 8,  # dq, index (3), segment plan (2), dK/dV, segment merge
}


# (impl, direction) -> the kernels that do the work, each launched at least once: a call that
# launched nothing, or skipped a pass, fails however few launches it made.
REQUIRED = {
    ("fsa", "fwd"): {"_entry_keys_kernel", "_csr_kernel", "_partial_kernel", "_merge_kernel"},
    ("fsa", "bwd"): {"_delta_kernel", "_dkdv_kernel", "_dkdv_merge_kernel", "_merge_kernel"},
    ("fsa_paper", "fwd"): {"_entry_keys_kernel", "_csr_kernel", "_partial_kernel", "_merge_kernel"},
    ("fsa_paper", "bwd"): {"_delta_kernel", "_partial_kernel", "_merge_kernel", "_dkdv_kernel", "_dkdv_merge_kernel"},
    ("nsa", "fwd"): {"_token_start_kernel", "_fwd_kernel"},
    ("nsa", "bwd"): {"_bwd_dq_kernel", "_csr_kernel", "_bwd_dkdv_kernel"},
}


def triton_kernels(counter: LaunchCounter) -> set[str]:
    """Names of the Triton kernels the counter saw launched, without a leading underscore (the
    block selection's Triton kernel is ``_select_kernel``, its Gluon kernel on Hopper
    ``select_kernel``: either does the work)."""
    return {name.removeprefix("triton:").lstrip("_") for name, n in counter.counts.items()
            if n and name.startswith("triton:")}


def launched(required: set[str], counter: LaunchCounter) -> bool:
    """Whether every kernel of ``required`` (source names) was launched."""
    return {name.lstrip("_") for name in required} <= triton_kernels(counter)


@pytest.mark.parametrize("impl,direction", sorted(LIMITS))
def test_launches_per_call(impl, direction, device):
    """At most LIMITS launches, among them every kernel of REQUIRED."""
    settings.configure(value_checks=False)  # checks add ops; the benchmark times without them
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
    assert launched(REQUIRED[impl, direction], counter), dict(counter.counts)


# Whole NSA attention (compression, compressed attention, selection, selected and window
# attention, gates; ``ops.attention.nsa_attention``), impl -> (fwd, bwd) launches, Triton + aten
# ops. fsa forward: 10 + 19 before the gated sum became one kernel per direction (ops/gate/fused.py),
# 11 + 13 after, 12 + 1 since the compressed offsets are one kernel (the aten op left is the index's
# sort), 14 + 1 since FSA's forward keeps NaN/Inf values causal in two extra launches (the blocks
# holding them flagged, their partials recomputed), so that its common path never inspects V.
# Backward: 20 aten ops + 15 Triton, then 12 + 16 since the position-embedding gradient is one
# kernel, then 0 + 16 since the whole attention is one autograd node whose branch kernels add
# their dq/dk/dv into one set of buffers (the 12 were autograd's 6 gradient sums over the three
# branches and 6 zero fills: two lse gradients, the compressed keys' padding rows, the
# compression's uncovered tokens). NSA's backward builds the selection index (its sort is the
# one aten op).
NSA_ATTENTION_LIMITS = {"fsa": (15, 16), "nsa": (8, 17)}
# aten ops the backward may launch: none but the index's sort (gradients are summed in the kernels).
NSA_ATTENTION_BWD_ATEN = {"fsa": set(), "nsa": {"aten:sort"}}
# Kernels every whole NSA attention call launches, forward and backward: compression, compressed
# attention (ops/flash.py's kernels; the window's backend may be flash-attn's instead, on a GPU
# that has it), block selection and the gated sum, plus the selected attention's own (REQUIRED).
NSA_ATTENTION_REQUIRED = (
    {"_compress_fwd_kernel", "_fwd_kernel", "_select_kernel", "_gated_sum_fwd"},
    {"_compress_dx_kernel", "_compress_dw_kernel", "_compress_dpe_kernel", "_stats_kernel", "_dq_kernel",
     "_dkdv_kernel", "_gated_sum_bwd"},
)


@pytest.mark.parametrize("impl", ["fsa", "nsa"])
def test_value_checks_add_no_launches_to_a_repeated_module_call(impl, device):
    """With value checks on (the default), a module forward over offsets it has already checked
    launches what it launches with checks off: unchanged cu_seqlens are not checked again
    (``fsalab.checks``) and the selection's own block indices are not re-checked. (Before, the
    checks added 35 launches per call at fsa: five ops checking the offsets, one the indices;
    ``scripts/count_launches.py --op module``.) Both counts are of the same launches, kernel by
    kernel, and include the selected attention's own kernels (a forward that launched nothing
    would otherwise match itself)."""
    fwd = nsa_module_forward(impl, device)
    counts = {}
    for checks in (False, True):
        settings.configure(value_checks=checks)
        fwd()  # outside the count: one-time work, and the offsets' first check
        with LaunchCounter() as counter:
            fwd()
        counts[checks] = counter.counts
        assert launched(REQUIRED[impl, "fwd"], counter), dict(counter.counts)
    assert counts[True] == counts[False], {checks: dict(c) for checks, c in counts.items()}


@pytest.mark.parametrize("impl", sorted(NSA_ATTENTION_LIMITS))
def test_launches_per_nsa_attention_call(impl, device):
    """At most NSA_ATTENTION_LIMITS launches per direction, among them every branch's kernels."""
    settings.configure(value_checks=False)
    calls = nsa_attention_calls(impl, 128, 1, 1, 16, 32, 4, device=device)
    limits, required_kernels = NSA_ATTENTION_LIMITS[impl], NSA_ATTENTION_REQUIRED
    for fn, limit, required, direction in zip(calls, limits, required_kernels, ("fwd", "bwd")):
        fn()  # outside the count: one-time work (compilation, caches)
        with LaunchCounter() as counter:
            fn()
        assert counter.total <= limit, dict(counter.counts)
        assert launched(required | REQUIRED[impl, direction], counter), dict(counter.counts)
        if direction == "bwd":
            aten = {name for name, n in counter.counts.items() if n and name.startswith("aten:")}
            assert aten <= NSA_ATTENTION_BWD_ATEN[impl], dict(counter.counts)


# A decode step of NSA attention (``attend_decode``: RoPE, append, compression, gate projection,
# attention) is ``append_token``'s two Triton launches, the gate projection and ``nsa_decode``'s
# five. Before the bookkeeping became two kernels it was ~85 launches (HF's rotary embedding called
# three times, the cache's where / remainder / index_put_ chains, a separate compression launch).
DECODE_STEP_LIMIT = 8
# One decoder layer's attention in a patched model's decode forward: the above plus HF's q, k, v
# and o projections (85 before the bookkeeping became two kernels).
DECODE_LAYER_LIMIT = DECODE_STEP_LIMIT + 4
# The decode step's Triton kernels: append (RoPE'd k, v into the cache), the compression step,
# compressed attention partials, block scores, top-T, window (sliding) partials, the combine.
DECODE_KERNELS = {"_append_kernel", "_compress_step_kernel", "_cmp_partial_kernel", "_score_kernel", "_topk_kernel",
                  "_sw_partial_kernel", "_combine_kernel"}  # fmt: skip


def _decode_ready_module(device):
    from fsalab.config import NSAConfig
    from fsalab.modules import NativeSparseAttention
    from fsalab.testing import cu_seqlens_of

    cfg = NSAConfig(kernel_size=8, kernel_stride=4, block_size=16, topk=2, init_blocks=1, local_blocks=1, window_size=8)
    torch.manual_seed(0)
    module = NativeSparseAttention(32, 4, 2, head_dim=8, config=cfg, decode_impl="triton", dtype=torch.float16,
                                   device=device)
    cache = module.new_cache(2, 48)
    module(torch.randn(23, 32, dtype=torch.float16, device=device), cu_seqlens_of([20, 3], device), cache=cache)
    return module, cache


@torch.no_grad()
def test_launches_per_decode_step(device):
    settings.configure(value_checks=False)
    module, cache = _decode_ready_module(device)
    x = torch.randn(2, 32, dtype=torch.float16, device=device)
    q, k, v = module.q_proj(x).view(2, 4, 8), module.k_proj(x).view(2, 2, 8), module.v_proj(x).view(2, 2, 8)
    module.attend_decode(q, k, v, x, cache)  # outside the count: one-time work
    with LaunchCounter() as counter:
        module.attend_decode(q, k, v, x, cache)
    assert counter.total <= DECODE_STEP_LIMIT, dict(counter.counts)
    assert sum(n for name, n in counter.counts.items() if name.startswith("aten:")) == 1, dict(counter.counts)
    assert launched(DECODE_KERNELS, counter), dict(counter.counts)


@torch.no_grad()
def test_launches_per_patched_model_decode_layer(device):
    """Launches inside each decoder layer's attention during a patched Llama's decode forward
    (through ``NSAModelCache``, as ``model.generate`` runs it)."""
    pytest.importorskip("transformers")
    from fsalab.config import NSAConfig
    from fsalab.models import configs, patch
    from fsalab.models.cache import NSAModelCache, cache_kwarg

    settings.configure(value_checks=False)
    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 64, "bos_token_id": None, "eos_token_id": None}
    cfg = NSAConfig(kernel_size=8, kernel_stride=4, block_size=16, topk=2, init_blocks=1, local_blocks=1, window_size=8)
    model = configs.build_model("llama3-8b", 2, device, torch.float16, **tiny)
    patch.patch_model(model, "fsa", cfg)
    configs.init_random_(model, seed=0, std=0.2)
    for attn in patch.attention_modules(model):
        attn.nsa.decode_impl = "triton"
    model.eval()
    cache = {cache_kwarg(model): NSAModelCache(model, 24)}
    model(torch.randint(0, 64, (1, 9), device=device), **cache, use_cache=True)
    token = torch.randint(0, 64, (1, 1), device=device)
    model(token, **cache, use_cache=True)  # outside the count: one-time work
    counters = []

    def start(module, args, kwargs):
        counters.append(LaunchCounter().__enter__())

    def stop(module, args, kwargs, out):
        counters[-1].__exit__(None, None, None)

    for attn in patch.attention_modules(model):
        attn.register_forward_pre_hook(start, with_kwargs=True)
        attn.register_forward_hook(stop, with_kwargs=True)
    model(token, **cache, use_cache=True)
    assert len(counters) == 2
    for counter in counters:
        assert counter.total <= DECODE_LAYER_LIMIT, dict(counter.counts)
        # the decode step's kernels, and HF's q, k, v, o projections plus the gate projection
        assert launched(DECODE_KERNELS, counter), dict(counter.counts)
        assert counter.counts["aten:mm"] >= 5, dict(counter.counts)
