"""impl="auto": rules without profiling, the shape key, the on-disk cache, and the composed
forward/backward (one impl's forward feeding another's backward) against the reference."""

import json

import pytest
import torch
from fsalab.ops.selected import dispatch
from fsalab.testing import check_selected_attention, make_batch, random_block_idx


def test_rules_pick_fsa_forward_and_nsa_backward_for_large_groups():
    assert dispatch.rule(1) == ("fsa", "fsa") and dispatch.rule(5) == ("fsa", "fsa") and dispatch.rule(8) == ("fsa", "fsa")
    assert dispatch.rule(9) == ("fsa", "nsa") and dispatch.rule(16) == ("fsa", "nsa")


def test_shape_key_buckets_tokens_and_records_gradients():
    b = make_batch([300, 200], 8, 2, 64, seed=0)
    block_idx = torch.zeros(500, 2, 4, dtype=torch.int32)
    key = dispatch.shape_key(b.q, b.k, b.v, block_idx, 64)
    assert key == f"{dispatch._KEY_VERSION}|cpu|float32|g4|hkv2|d64|B64|T4|N512|grad0"
    b.v.requires_grad_(True)  # any of q, k, v: the same test the call uses to build a graph
    assert dispatch.shape_key(b.q, b.k, b.v, block_idx, 64).endswith("grad1")


def test_cached_values_round_trip():
    assert dispatch._decode(dispatch._encode(("fsa", "nsa"), grad=True)) == ("fsa", "nsa")
    assert dispatch._encode(("nsa", "fsa"), grad=False) == "nsa"
    assert dispatch._decode("nsa") == ("nsa", "nsa")


def test_cache_round_trip_and_relocation(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "dispatch.json"
    monkeypatch.setenv("FSALAB_DISPATCH_CACHE", str(path))
    dispatch._store("k1", "fsa")
    dispatch._store("k2", "fsa/nsa")
    assert json.loads(path.read_text()) == {"k1": "fsa", "k2": "fsa/nsa"}
    assert dispatch._load() == {"k1": "fsa", "k2": "fsa/nsa"}
    path.write_text("{not json")
    assert dispatch._load() == {}
    monkeypatch.setenv("FSALAB_DISPATCH_CACHE", "")
    assert dispatch.cache_path() is None


def test_auto_on_cpu_follows_the_rules():
    b = make_batch([40], 4, 2, 16, seed=1)
    block_idx = torch.zeros(40, 2, 2, dtype=torch.int32)
    assert dispatch.choose(b.q, b.k, b.v, block_idx, b.cu_seqlens, 16) == ("fsa", "fsa")


def test_auto_rejects_bad_block_size():
    b = make_batch([40], 4, 2, 16, seed=1)
    with pytest.raises(ValueError, match="power of two"):
        dispatch.selected_attention_auto(b.q, b.k, b.v, torch.zeros(40, 2, 2, dtype=torch.int32), b.cu_seqlens, 24)


@pytest.mark.parametrize("fwd,bwd", [("fsa", "nsa"), ("nsa", "fsa"), ("nsa", "nsa")])
@pytest.mark.parametrize("dtype,g", [(torch.float32, 1), (torch.float16, 5)])
def test_composed_forward_and_backward_match_reference(fwd, bwd, dtype, g, seed, gen, device, monkeypatch):
    """Every pairing of forward and backward kernels is exact, lse gradient included."""
    monkeypatch.setattr(dispatch, "choose", lambda *args, **kw: (fwd, bwd))
    batch = make_batch([1, 37, 70], 2 * g, 2, 64, dtype=dtype, device=device, seed=seed)
    block_idx = random_block_idx(batch.cu_seqlens, 2, 3, 16, gen, p_drop=0.3).to(device)
    check_selected_attention(dispatch.selected_attention_auto, batch, block_idx, 16, with_dlse=True)


@pytest.mark.parametrize("fwd", ["fsa", "nsa"])
def test_auto_inference_skips_autograd_and_matches_the_training_path(fwd, gen, device, monkeypatch):
    """Under no_grad auto runs the forward kernel directly: same (o, lse) bits, no graph node."""
    monkeypatch.setattr(dispatch, "choose", lambda *args, **kw: (fwd, "fsa"))
    batch = make_batch([1, 37, 70], 4, 2, 64, dtype=torch.float16, device=device, seed=3)
    block_idx = random_block_idx(batch.cu_seqlens, 2, 3, 16, gen, p_drop=0.3).to(device)
    args = (batch.cu_seqlens, 16)
    q = batch.q.detach().clone().requires_grad_(True)
    o_train, lse_train = dispatch.selected_attention_auto(q, batch.k, batch.v, block_idx, *args)
    with torch.no_grad():
        o_inf, lse_inf = dispatch.selected_attention_auto(q, batch.k, batch.v, block_idx, *args)
    assert o_train.grad_fn is not None and o_inf.grad_fn is None and lse_inf.grad_fn is None
    assert torch.equal(o_inf, o_train.detach()) and torch.equal(lse_inf, lse_train.detach())


@pytest.mark.gpu
def test_auto_profiles_once_and_caches(tmp_path, monkeypatch):
    """The first call of a shape key profiles; a second call, and a call after the in-memory
    cache is dropped (the choice read back from disk), do not."""
    monkeypatch.setenv("FSALAB_DISPATCH_CACHE", str(tmp_path / "d.json"))
    dispatch._memory.clear()
    profiled = []
    profile = dispatch._profile
    monkeypatch.setattr(dispatch, "_profile", lambda *a, **k: profiled.append(1) or profile(*a, **k))
    b = make_batch([4096], 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=2)
    block_idx = (torch.arange(4096, device="cuda") // 64).int()[:, None, None].expand(4096, 2, 1).contiguous()
    b.q.requires_grad_(True)
    fwd, bwd = dispatch.choose(b.q, b.k, b.v, block_idx, b.cu_seqlens, 64)
    assert {fwd, bwd} <= set(dispatch.CANDIDATES)
    assert list(json.loads((tmp_path / "d.json").read_text()).values()) == [f"{fwd}/{bwd}"]
    assert dispatch.choose(b.q, b.k, b.v, block_idx, b.cu_seqlens, 64) == (fwd, bwd)
    dispatch._memory.clear()
    assert dispatch.choose(b.q, b.k, b.v, block_idx, b.cu_seqlens, 64) == (fwd, bwd)
    assert len(profiled) == 1
