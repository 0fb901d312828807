"""impl="auto": rules without profiling, the shape key, and the on-disk cache."""

import json

import pytest
import torch

from fsalab.ops.selection import dispatch
from fsalab.testing import make_batch


def test_rules_pick_fsa_for_small_groups_and_nsa_for_large():
    assert dispatch.rule(1) == "fsa" and dispatch.rule(5) == "fsa"
    assert dispatch.rule(16) == "nsa"


def test_shape_key_buckets_tokens_and_records_gradients():
    b = make_batch([300, 200], 8, 2, 64, seed=0)
    block_idx = torch.zeros(500, 2, 4, dtype=torch.int32)
    key = dispatch.shape_key(b.q, b.k, block_idx, 64)
    assert key == "cpu|float32|g4|hkv2|d64|B64|T4|N512|grad0"
    b.q.requires_grad_(True)
    assert dispatch.shape_key(b.q, b.k, block_idx, 64).endswith("grad1")


def test_cache_round_trip_and_relocation(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "dispatch.json"
    monkeypatch.setenv("FSALAB_DISPATCH_CACHE", str(path))
    dispatch._store("k1", "fsa")
    dispatch._store("k2", "nsa")
    assert json.loads(path.read_text()) == {"k1": "fsa", "k2": "nsa"}
    assert dispatch._load() == {"k1": "fsa", "k2": "nsa"}
    path.write_text("{not json")
    assert dispatch._load() == {}
    monkeypatch.setenv("FSALAB_DISPATCH_CACHE", "")
    assert dispatch.cache_path() is None


def test_auto_on_cpu_follows_the_rules():
    b = make_batch([40], 4, 2, 16, seed=1)
    assert dispatch.choose(b.q, b.k, b.v, torch.zeros(40, 2, 2, dtype=torch.int32), b.cu_seqlens, 16) == "fsa"


@pytest.mark.gpu
def test_auto_profiles_once_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("FSALAB_DISPATCH_CACHE", str(tmp_path / "d.json"))
    dispatch._memory.clear()
    b = make_batch([4096], 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=2)
    block_idx = (torch.arange(4096, device="cuda") // 64).int()[:, None, None].expand(4096, 2, 1).contiguous()
    impl = dispatch.choose(b.q, b.k, b.v, block_idx, b.cu_seqlens, 64)
    assert impl in dispatch.CANDIDATES
    assert list(json.loads((tmp_path / "d.json").read_text()).values()) == [impl]
