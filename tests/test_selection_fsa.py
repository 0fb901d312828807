"""FSA KV-block-outer selected attention (ops/selected/fsa*.py) against the fp32 reference.

Both variants: ``fsa_paper`` (statistics + main + sum-reduction kernels, with every ablation
switch combination) and ``fsa`` (log-sum-exp merged partials, grouped heads, fused backward).
Forward o and lse and gradients dq/dk/dv are compared with the float64 reference, bounded by
2x PyTorch's own error in the input dtype (the reference run under native_precision). Kernel allocations, partial buffers
included, are NaN-poisoned: an element a kernel forgets to write, or a partial a merge reads
without it being written, fails the comparison. Shapes stay tiny: on CPU every program runs
through the Triton interpreter.

The comparison is ``fsalab.testing.check_selected_attention``, shared with the NSA and peer tests.
"""

from __future__ import annotations

import functools

import pytest
import torch
from fsalab.config import NSAConfig
from fsalab.ops.selected import fsa, fsa_plan, selected_attention
from fsalab.ops.selected.fsa_partials import DQ
from fsalab.testing import (
    LaunchCounter,
    attention_and_grads,
    check_selected_attention,
    make_batch,
    poisoned_allocations,
    random_block_idx,
    selected_blocks,
)

PAPER_SWITCHES = [(True, True), (False, True), (True, False), (False, False)]  # (inner_loop, early_return)


def impl_fn(impl: str, inner_loop: bool = True, early_return: bool = True):
    if impl == "fsa":
        return fsa.selected_attention_fsa
    return functools.partial(fsa.selected_attention_fsa_paper, inner_loop=inner_loop, early_return=early_return)


# The paper variant runs one program per query head, so it gets the cheaper half of the cases.
@pytest.mark.parametrize(
    "impl,dtype,d,g,block_size,topk",
    [
        ("fsa", torch.float32, 64, 1, 16, 3),
        ("fsa_paper", torch.float32, 64, 1, 16, 3),
        ("fsa", torch.float16, 96, 3, 32, 3),
        ("fsa_paper", torch.float16, 96, 2, 32, 3),
        ("fsa", torch.float32, 128, 4, 16, 4),
        ("fsa", torch.float16, 192, 5, 16, 3),
        ("fsa_paper", torch.float16, 192, 5, 32, 2),
        ("fsa", torch.float16, 256, 2, 64, 2),
        ("fsa_paper", torch.float32, 256, 1, 64, 2),
        ("fsa", torch.float16, 64, 6, 32, 3),
        ("fsa", torch.float32, 64, 7, 16, 2),
        ("fsa_paper", torch.float32, 64, 7, 16, 2),
        ("fsa", torch.float16, 64, 8, 32, 3),
        ("fsa", torch.float32, 128, 16, 16, 2),
        ("fsa_paper", torch.float16, 64, 16, 64, 2),
    ],
)
def test_fsa_random_selection(impl, dtype, d, g, block_size, topk, seed, gen, device):
    h_kv = 2 if g <= 3 else 1  # h_kv > 1 exercises the head offsets; each program is costly here
    batch = make_batch([1, 37, 70], g * h_kv, h_kv, d, dtype=dtype, device=device, seed=seed)
    block_idx = random_block_idx(batch.cu_seqlens, h_kv, topk, block_size, gen, p_drop=0.3)
    check_selected_attention(impl_fn(impl), batch, block_idx, block_size)


@pytest.mark.parametrize("inner_loop,early_return", PAPER_SWITCHES[1:])
def test_fsa_paper_ablation_switches(inner_loop, early_return, seed, gen, device):
    """Without the inner loop (one program per query batch) and/or without early return
    (programs run the longest non-sink row's range, masked): same results."""
    batch = make_batch([30, 70], 2, 1, 64, dtype=torch.float16, device=device, seed=seed)
    block_idx = random_block_idx(batch.cu_seqlens, 1, 3, 16, gen, p_drop=0.2)
    check_selected_attention(impl_fn("fsa_paper", inner_loop, early_return), batch, block_idx, 16)


@pytest.mark.parametrize("impl", ["fsa", "fsa_paper"])
def test_fsa_real_selection(impl, seed, gen, device):
    """block_idx from NSA's compression + top-k path (init and local blocks forced)."""
    cfg = NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=4, init_blocks=1, local_blocks=2)
    batch = make_batch([9, 120], 4, 2, 64, dtype=torch.float16, device=device, seed=seed)
    check_selected_attention(impl_fn(impl), batch, selected_blocks(batch, cfg, gen), cfg.block_size)


@pytest.mark.parametrize("impl", ["fsa", "fsa_paper"])
def test_fsa_two_key_tiles(impl, seed, gen, device):
    """block_size 128: dK/dV walk two key sub-tiles (the dq partial is read back and added)."""
    cfg = NSAConfig(kernel_size=32, kernel_stride=16, block_size=128, topk=2, init_blocks=1, local_blocks=1)
    batch = make_batch([260], 2, 1, 64, dtype=torch.float16, device=device, seed=seed)
    check_selected_attention(impl_fn(impl), batch, selected_blocks(batch, cfg, gen), cfg.block_size)


@pytest.mark.parametrize("impl", ["fsa", "fsa_paper"])
@pytest.mark.parametrize(
    "lengths,topk",
    [
        ([1], 2),  # a single token
        ([2, 1, 3, 5, 1, 4, 2, 90], 3),  # many short sequences packed with a long one
        ([20, 45], 8),  # topk above the causal block count: rows padded with -1
    ],
)
def test_fsa_edge_lengths(impl, lengths, topk, seed, gen, device):
    batch = make_batch(lengths, 4, 2, 64, dtype=torch.float16, device=device, seed=seed)
    block_idx = random_block_idx(batch.cu_seqlens, 2, topk, 16, gen, p_drop=0.0)
    check_selected_attention(impl_fn(impl), batch, block_idx, 16)


@pytest.mark.parametrize("impl", ["fsa", "fsa_paper"])
def test_fsa_empty_selections(impl, seed, gen, device):
    """Tokens and heads that select nothing: o = 0, lse = -inf, zero gradients."""
    batch = make_batch([20, 40], 6, 2, 64, dtype=torch.float16, device=device, seed=seed)
    block_idx = random_block_idx(batch.cu_seqlens, 2, 3, 16, gen, p_drop=0.5)
    block_idx[::3] = -1  # every third token selects nothing on either head
    block_idx[1::3, 0] = -1  # some tokens select nothing on head 0 only
    check_selected_attention(impl_fn(impl), batch, block_idx, 16)
    nothing = torch.full_like(block_idx, -1)
    with poisoned_allocations():
        o, lse = impl_fn(impl)(batch.q, batch.k, batch.v, nothing, batch.cu_seqlens, 16)
    assert bool((o == 0).all()) and bool((lse == float("-inf")).all())


@pytest.mark.parametrize("impl", ["fsa", "fsa_paper"])
@pytest.mark.parametrize("dtype,q_scale", [(torch.float16, 16.0), (torch.float32, 32.0)])
def test_fsa_large_logits(impl, dtype, q_scale, seed, gen, device):
    batch = make_batch([30, 45], 8, 2, 64, dtype=dtype, device=device, seed=seed, q_scale=q_scale)
    block_idx = random_block_idx(batch.cu_seqlens, 2, 3, 16, gen, p_drop=0.2)
    check_selected_attention(impl_fn(impl), batch, block_idx, 16)


@pytest.mark.parametrize("impl", ["fsa", "fsa_paper"])
def test_fsa_lse_gradient(impl, seed, gen, device):
    """A loss on lse too: the backward folds dlse into delta."""
    batch = make_batch([25, 60], 6, 2, 64, dtype=torch.float32, device=device, seed=seed)
    block_idx = random_block_idx(batch.cu_seqlens, 2, 3, 16, gen, p_drop=0.0)  # no empty rows: lse finite
    check_selected_attention(impl_fn(impl), batch, block_idx, 16, with_dlse=True)


@pytest.mark.parametrize("g,parts", [(1, [1]), (4, [4]), (5, [4, 1]), (6, [4, 2]), (7, [4, 2, 1]), (12, [8, 4])])
def test_pow2_chunks_cover_each_head_once(g, parts):
    """The forward's chunks as power-of-two parts, largest first, every head of each chunk once."""
    for chunk in (fsa_plan.Chunk(0, 3, 0, g), fsa_plan.Chunk(1, 1, 2, g)):
        split = fsa_plan.pow2_chunks([chunk])
        assert [c.heads for c in split] == parts
        assert [c.j0 for c in split] == [chunk.j0 + sum(parts[:i]) for i in range(len(parts))]
        assert all((c.hk0, c.n_kv) == (chunk.hk0, chunk.n_kv) for c in split)
    assert fsa_plan.head_parts(g) == (parts[0], g - parts[0])


@pytest.mark.parametrize("n,g,fwd,chunks", [
    (32768, 1, True, [(0, 4)]),  # two heads' budget (1 GiB) holds all four at 32K
    (65536, 1, True, [(0, 3), (3, 1)]),
    (65536, 1, False, [(0, 4)]),  # the fused backward's bf16 dq partials
    (131072, 1, True, [(0, 1), (1, 1), (2, 1), (3, 1)]),  # over half the floor: a head a chunk
    (65536, 4, True, [(0, 1), (1, 1), (2, 1), (3, 1)]),  # g = 4: the group's own budget (2 GiB)
])
def test_head_chunks_budget(n, g, fwd, chunks):
    """Head chunks of 4 KV heads at (64, 16), d = 128, bf16 partials, within
    max(g, MIN_BUDGET_HEADS) x BUFFER_BUDGET_BYTES: at g = 1 the budget is two heads', so short
    calls run in fewer chunks (three launches each)."""
    per_head = fsa_plan.partial_bytes(n, 16, 128, 2, with_lse=fwd)
    plan = fsa_plan.head_chunks(4, g, per_head, allow_partial_groups=fwd)
    assert [(c.hk0, c.n_kv) for c in plan] == chunks
    assert all((c.j0, c.heads) == (0, g) for c in plan)


def record_split_work_lists(monkeypatch) -> list:
    """The work lists fsa_plan.work_list builds with split rows (``slots`` set), appended as built."""
    split_lists, work_list = [], fsa_plan.work_list

    def recorded(*args, **kwargs):
        work = work_list(*args, **kwargs)
        if work.slots is not None:
            split_lists.append(work)
        return work

    monkeypatch.setattr(fsa_plan, "work_list", recorded)
    return split_lists


@pytest.mark.parametrize("impl", ["fsa", "fsa_paper"])
def test_fsa_head_chunks_and_split_rows(impl, monkeypatch, seed, gen, device):
    """Partial buffers over budget: heads run in chunks (whole groups, then parts of a group,
    where the fast backward computes dK/dV apart from dq); long rows split over programs."""
    # the second sequence is longer than a backward tile's tokens (64 here), so its block-0 row splits
    batch = make_batch([50, 140], 10, 2, 64, dtype=torch.float16, device=device, seed=seed)
    block_idx = random_block_idx(batch.cu_seqlens, 2, 3, 16, gen, p_drop=0.2)
    block_idx[:, :, 0] = torch.where(block_idx[:, :, 0] >= 0, 0, -1)  # block 0 selected by every non-empty row
    monkeypatch.setattr(fsa_plan, "MIN_SPLIT_TILES", 1)
    # partial bytes per query head: forward o (q's dtype) + lse (fp32); the fused backward's dq
    # partials are in q's dtype too
    per_head_fwd, per_head_dq = batch.total * 3 * (64 * 2 + 4), batch.total * 3 * 64 * batch.q.element_size()
    # g = 5: one KV head per chunk (fused backward); then the forward in 2 + 2 + 1 heads and the
    # backward's dq one head at a time, dK/dV apart (the paper's loops see chunks only there).
    budgets = (5 * per_head_dq, 2 * per_head_fwd) if impl == "fsa" else (2 * per_head_fwd,)
    plans, head_chunks = [], fsa_plan.head_chunks

    def recorded_chunks(*args, **kwargs):
        plans.append(head_chunks(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(fsa_plan, "head_chunks", recorded_chunks)
    split_lists = record_split_work_lists(monkeypatch)
    for budget in budgets:  # the budget is per query head of a group
        monkeypatch.setattr(fsa_plan, "BUFFER_BUDGET_BYTES", budget // 5)
        check_selected_attention(impl_fn(impl), batch, block_idx, 16)
    # every call ran in more than one chunk, and some chunk held part of a group only
    assert plans and all(len(chunks) > 1 for chunks in plans), plans
    assert any(c.heads < 5 for chunks in plans for c in chunks), plans
    # the dK/dV work lists split a long row (block 0's) over programs: partial slots in use
    assert split_lists and any(int(w.slots[-1]) > 0 for w in split_lists)


@pytest.mark.slow(30)
@pytest.mark.parametrize("impl,g", [("fsa", 8), ("fsa_paper", 8), ("fsa", 3)])
def test_fsa_dkdv_alone_two_key_tiles(impl, g, monkeypatch, seed, gen, device):
    """The H200 failure case, small: fp16, g = 8, d = 128, 128-key blocks (two key sub-tiles) from
    real selection, split rows, dK/dV computed apart from dq (always in fsa_paper; in fsa once a
    group's dq partials exceed the budget). There, fsa_paper's dK was wrong while its dV was right.
    g = 3: the same path walking two head parts (2 + 1) per key sub-tile program. The launches
    are recorded and the forced path checked: every dK/dV launch unfused with one program per key
    sub-tile (two), a split-row work list with partial slots in use, dq from its own DQ-mode
    partials, and the head parts the group's size gives."""
    cfg = NSAConfig(kernel_size=32, kernel_stride=16, block_size=128, topk=8, init_blocks=1, local_blocks=2)
    batch = make_batch([300], g, 1, 128, dtype=torch.float16, device=device, seed=seed)
    monkeypatch.setattr(fsa_plan, "MIN_SPLIT_TILES", 1)
    if impl == "fsa":
        monkeypatch.setattr(fsa_plan, "BUFFER_BUDGET_BYTES", 1)
    split_lists = record_split_work_lists(monkeypatch)
    dkdv, modes = [], []  # (key sub-tile programs, FUSED_DQ, NUM_KT, (G_HI, G_LO)) per _dkdv_kernel launch

    def record(kernel, args, kwargs):
        constant = lambda name: getattr(kwargs[name], "value", kwargs[name])  # noqa: E731
        if kernel.__name__ == "_dkdv_kernel":
            parts = (constant("G_HI"), constant("G_LO"))
            dkdv.append((kwargs["grid"][1], constant("FUSED_DQ"), constant("NUM_KT"), parts))
        elif kernel.__name__ == "_partial_kernel":
            modes.append(constant("MODE"))

    with LaunchCounter(on_triton_launch=record):
        check_selected_attention(impl_fn(impl), batch, selected_blocks(batch, cfg, gen), cfg.block_size)
    # dK/dV alone (no fused dq), one program per key sub-tile of two; g = 3 walks parts 2 + 1
    assert dkdv and set(dkdv) == {(2, False, 2, {8: (8, 0), 3: (2, 1)}[g])}, dkdv
    assert split_lists and any(int(w.slots[-1]) > 0 for w in split_lists)  # a row split over programs
    assert DQ.value in modes, modes  # dq from partials of its own, apart from dK/dV


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["fsa", "fsa_paper"])
def test_fsa_fp16_g8_block128(impl, seed, gen, device):
    """The H200 failure case at a few thousand tokens (sink row split over programs)."""
    cfg = NSAConfig(kernel_size=32, kernel_stride=16, block_size=128, topk=8, init_blocks=1, local_blocks=2)
    batch = make_batch([4096], 16, 2, 128, dtype=torch.float16, device=device, seed=seed)
    check_selected_attention(impl_fn(impl), batch, selected_blocks(batch, cfg, gen), cfg.block_size)


def test_registry_and_determinism(seed, gen, device):
    batch = make_batch([33, 20], 4, 1, 64, dtype=torch.float16, device=device, seed=seed)
    block_idx = random_block_idx(batch.cu_seqlens, 1, 3, 16, gen, p_drop=0.2)
    do = torch.randn_like(batch.q)
    for impl in ("fsa", "fsa_paper"):
        fn = functools.partial(selected_attention, impl=impl)
        first = attention_and_grads(fn, batch.q, batch.k, batch.v, block_idx, batch.cu_seqlens, 16, do, None)
        second = attention_and_grads(fn, batch.q, batch.k, batch.v, block_idx, batch.cu_seqlens, 16, do, None)
        for a, b in zip(first, second):
            assert torch.equal(a, b)


@pytest.mark.parametrize("impl", ["fsa", "fsa_paper"])
def test_fsa_rejects_bad_block_size(impl, device):
    batch = make_batch([8], 2, 1, 64, device=device, seed=0)
    block_idx = torch.zeros(8, 1, 1, dtype=torch.int32, device=device)
    for bad in (24, 8):
        with pytest.raises(ValueError, match="block_size"):
            impl_fn(impl)(batch.q, batch.k, batch.v, block_idx, batch.cu_seqlens, bad)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["fsa", "fsa_paper"])
@pytest.mark.parametrize(
    "d,g,lengths",
    [
        (64, 1, [1, 300, 700, 64]),
        (128, 4, [1, 300, 700, 64]),
        (96, 5, [1, 300, 700, 64]),
        (192, 16, [1, 300, 700, 64]),
        (256, 2, [1, 300, 700, 64]),
        (128, 3, [3000, 40]),  # the sink row (3000 entries) is split over programs
    ],
)
def test_fsa_bf16(impl, d, g, lengths, seed, gen, device):
    h_kv = 2
    batch = make_batch(lengths, g * h_kv, h_kv, d, dtype=torch.bfloat16, device=device, seed=seed)
    for inner_loop, early_return in PAPER_SWITCHES if impl == "fsa_paper" else PAPER_SWITCHES[:1]:
        fn = impl_fn(impl, inner_loop, early_return)
        cfg = NSAConfig(block_size=64, topk=4)
        check_selected_attention(fn, batch, selected_blocks(batch, cfg, gen), cfg.block_size)
        block_idx = random_block_idx(batch.cu_seqlens, h_kv, 8, 32, gen, p_drop=0.3)
        check_selected_attention(fn, batch, block_idx, 32)
