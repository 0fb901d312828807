"""Every class of bad input gets a ValueError/TypeError that names the argument."""

import dataclasses

import pytest
import torch

from fsalab.config import NSAConfig
from fsalab.modules import NativeSparseAttention
from fsalab.ops.flash import flash_attention
from fsalab.ops.full import full_attention
from fsalab.ops.selected import selected_attention
from fsalab.testing import cu_seqlens_of


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kernel_size": 24}, "kernel_size must be a power of two"),
        ({"kernel_size": 16, "kernel_stride": 32}, "kernel_size .* multiple of kernel_stride"),
        ({"block_size": 48}, "block_size must be a power of two"),
        ({"kernel_size": 128, "block_size": 64}, "must not exceed block_size"),
        ({"block_size": 8, "kernel_size": 8, "kernel_stride": 8}, "block_size must be >= 16"),
        ({"topk": 2}, "topk .* must cover the forced blocks"),
        ({"topk": 0}, "topk must be a positive int"),
        ({"init_blocks": -1}, "init_blocks must be a non-negative int"),
        ({"window_size": 0}, "window_size must be a positive int"),
        ({"block_size": 64.0}, "block_size must be a positive int"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NSAConfig(**kwargs)


def test_config_defaults():
    cfg = NSAConfig()
    assert (cfg.kernel_size, cfg.kernel_stride, cfg.block_size, cfg.topk) == (32, 16, 64, 16)
    assert (cfg.init_blocks, cfg.local_blocks, cfg.window_size) == (1, 2, 512)
    assert cfg.num_compressed(31) == 0 and cfg.num_compressed(32) == 1 and cfg.num_compressed(63) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.topk = 3


def inputs(total=20, h=4, h_kv=2, d=16, topk=2, dtype=torch.float32):
    q = torch.randn(total, h, d, dtype=dtype)
    k = torch.randn(total, h_kv, d, dtype=dtype)
    v = torch.randn(total, h_kv, d, dtype=dtype)
    block_idx = torch.full((total, h_kv, topk), -1, dtype=torch.int32)
    block_idx[..., 0] = 0
    return {"q": q, "k": k, "v": v, "block_idx": block_idx, "cu_seqlens": cu_seqlens_of([total]), "block_size": 32}


def bad(**changes):
    args = inputs()
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "args,error,match",
    [
        (bad(q=torch.randn(20, 64)), ValueError, "q must have 3 dimensions"),
        (bad(q=[1, 2]), TypeError, "q must be a torch.Tensor"),
        (bad(k=torch.randn(20, 2, 8), v=torch.randn(20, 2, 8)), ValueError, "k has head dim 8, q has 16"),
        (bad(v=torch.randn(20, 1, 16)), ValueError, "k and v must have the same shape"),
        (bad(q=torch.randn(20, 3, 16)), ValueError, r"q heads \(3\) must be a multiple of k/v heads \(2\)"),
        (bad(q=torch.randn(20, 34, 16)), ValueError, "g = h / h_kv = 17 exceeds 16"),
        (inputs(d=264), ValueError, "head dim d = 264 exceeds 256"),
        (bad(q=torch.randint(0, 3, (20, 4, 16))), TypeError, "q has dtype torch.int64"),
        (bad(k=torch.randn(20, 2, 16, dtype=torch.float64), v=torch.randn(20, 2, 16, dtype=torch.float64)), TypeError, "share one dtype"),
        (bad(k=torch.randn(20, 2, 16, device="meta"), v=torch.randn(20, 2, 16, device="meta")), ValueError, "k is on meta"),
        (bad(cu_seqlens=torch.tensor([0, 20], dtype=torch.int64)), TypeError, "cu_seqlens has dtype torch.int64"),
        (bad(cu_seqlens=torch.tensor([0, 12, 8, 20], dtype=torch.int32)), ValueError, "cu_seqlens must be non-decreasing"),
        (bad(cu_seqlens=torch.tensor([0, 19], dtype=torch.int32)), ValueError, r"cu_seqlens\[-1\] must equal total_tokens = 20"),
        (bad(cu_seqlens=torch.tensor([3, 20], dtype=torch.int32)), ValueError, r"cu_seqlens\[0\] must be 0"),
        (bad(cu_seqlens=torch.tensor([20], dtype=torch.int32)), ValueError, "cu_seqlens must hold batch"),
        (bad(block_idx=torch.zeros(20, 2, 2, dtype=torch.int64)), TypeError, "block_idx has dtype torch.int64"),
        (bad(block_idx=torch.zeros(20, 3, 2, dtype=torch.int32)), ValueError, "block_idx must have shape"),
        (bad(block_idx=torch.full((20, 2, 2), 1, dtype=torch.int32)), ValueError, "outside \\[0, own block\\]"),
        (bad(block_idx=torch.tensor([[[-1, 0]] * 2] * 20, dtype=torch.int32)), ValueError, "ascending order, valid entries before -1"),
    ],
)
def test_selected_attention_rejects_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        selected_attention(**args, impl="reference")


def test_unknown_impl_is_named():
    with pytest.raises(ValueError, match="impl must be one of"):
        selected_attention(**inputs(), impl="nope")


@pytest.mark.parametrize("scale", ["x", 0.0, -1.0, float("nan"), float("inf"), True, [0.25]])
@pytest.mark.parametrize("op", ["selected", "window", "full"])
def test_bad_scale_is_named(op, scale):
    args = inputs()
    calls = {
        "selected": lambda: selected_attention(**args, scale=scale, impl="reference"),
        "window": lambda: flash_attention(args["q"], args["k"], args["v"], args["cu_seqlens"], window_size=8,
                                          scale=scale),
        "full": lambda: full_attention(args["q"], args["k"], args["v"], args["cu_seqlens"], scale=scale,
                                       impl="sdpa_math"),
    }
    with pytest.raises(ValueError, match="scale must be a positive finite number or None"):
        calls[op]()


def test_unknown_module_impl_fails_at_construction():
    """A misspelt selection_impl is refused when the module is built, like the other branches'."""
    cfg = NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=3)
    with pytest.raises(ValueError, match="selection_impl must be one of .* got 'fsaa'"):
        NativeSparseAttention(32, 4, 2, config=cfg, selection_impl="fsaa")
    for impl in (None, "auto", "reference", "fsa"):
        assert NativeSparseAttention(32, 4, 2, config=cfg, selection_impl=impl).selection_impl == impl


def test_module_rejects_bad_input():
    module = NativeSparseAttention(32, 4, 2, config=NSAConfig(kernel_size=16, kernel_stride=8, block_size=16, topk=3))
    with pytest.raises(ValueError, match="need cu_seqlens"):
        module(torch.randn(10, 32))
    with pytest.raises(ValueError, match="hidden size 32"):
        module(torch.randn(10, 16), cu_seqlens_of([10]))
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\] must equal"):
        module(torch.randn(10, 32), cu_seqlens_of([9]))
    with pytest.raises(ValueError, match="hidden_states must have 2 dimensions"):
        module(torch.randn(32), cu_seqlens_of([1]))
    with pytest.raises(ValueError, match="lengths must have shape"):
        module(torch.randn(2, 10, 32), lengths=torch.tensor([3]))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        NativeSparseAttention(32, 3, 2)


def test_unchanged_offsets_are_checked_once(monkeypatch):
    """A cu_seqlens tensor that passed is not checked again while it is unchanged; an in-place
    write, another token count or an inference tensor (no version counter) checks again."""
    from fsalab import checks

    calls = []
    real = checks._expect
    monkeypatch.setattr(checks, "_expect", lambda cond, msg: (calls.append(msg), real(cond, msg)))
    cu = cu_seqlens_of([5, 7])
    checks.check_cu_seqlens(cu, 12, cu.device)
    assert len(calls) == 3
    checks.check_cu_seqlens(cu, 12, cu.device)
    assert len(calls) == 3, "unchanged offsets checked twice"
    checks.check_cu_seqlens(cu_seqlens_of([5, 7]), 12, cu.device)
    assert len(calls) == 6, "an equal but distinct tensor must be checked"
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must equal total_tokens = 13"):
        checks.check_cu_seqlens(cu, 13, cu.device)
    cu[1] = 9  # in place: still valid, checked again
    checks.check_cu_seqlens(cu, 12, cu.device)
    assert len(calls) == 12
    cu[1] = 13  # in place: no longer ascending
    with pytest.raises(ValueError, match="non-decreasing"):
        checks.check_cu_seqlens(cu, 12, cu.device)
    with torch.inference_mode():
        frozen = cu_seqlens_of([5, 7])
    before = len(calls)
    checks.check_cu_seqlens(frozen, 12, frozen.device)
    checks.check_cu_seqlens(frozen, 12, frozen.device)
    assert len(calls) == before + 6, "inference tensors have no version counter: checked every time"
