"""Hugging Face ``generate()`` on the patched architectures through ``NSAModelCache`` (DESIGN §9):
greedy tokens equal those of re-running the whole prefix at every step (tiny configs, CPU)."""

import pytest
import torch

pytest.importorskip("transformers")

from fsalab import NSAConfig
from fsalab.models import configs, patch
from fsalab.models.cache import NSAModelCache, cache_kwarg, generate

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 64, "bos_token_id": None, "eos_token_id": None}
CFG = NSAConfig(kernel_size=8, kernel_stride=4, block_size=16, topk=2, init_blocks=1, local_blocks=1, window_size=8)


def _model(name, decode_impl="reference"):
    model = configs.build_model(name, 2, "cpu", torch.float32, **TINY)
    patch.patch_model(model, "reference", CFG)
    configs.init_random_(model, seed=0, std=0.2)  # wide logits: greedy choices far from ties
    for attn in patch.attention_modules(model):
        attn.nsa.decode_impl = decode_impl
    return model.eval()


def _greedy_by_prefix(model, ids, steps):
    seq = ids
    for _ in range(steps):
        logits = model(seq, use_cache=False).logits[:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    return seq


@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-14b", "qwen2.5-32b"])
@torch.no_grad()
def test_generate_equals_full_prefix_rerun(name):
    model = _model(name)
    ids = torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(0))
    out = generate(model, ids, 25)  # crosses compressed tokens, blocks 1 and 2 and the window
    assert out.shape == (2, 36)
    assert torch.equal(out, _greedy_by_prefix(model, ids, 25))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the Triton interpreter")
@torch.no_grad()
def test_generate_with_triton_decode_step():
    model = _model("qwen3-14b", "triton")
    ids = torch.randint(0, TINY["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(1))
    assert torch.equal(generate(model, ids, 6), _greedy_by_prefix(model, ids, 6))


@torch.no_grad()
def test_generate_errors():
    model = _model("llama3-8b")
    ids = torch.randint(0, TINY["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="cache full"):
        generate(model, ids, 6, capacity=10)
    from transformers import DynamicCache

    with pytest.raises(ValueError, match="keeps its own KV cache"):
        model(ids, **{cache_kwarg(model): DynamicCache()})
    with pytest.raises(ValueError, match="capacity"):
        NSAModelCache(model, 0)


def test_cuda_graphs_option():
    model = _model("llama3-8b")
    assert NSAModelCache(model, 16).cuda_graphs is False  # default: on CUDA only
    assert all(layer.graph_pool is None for layer in NSAModelCache(model, 16).layers)
    with pytest.raises(ValueError, match="CUDA device"):
        NSAModelCache(model, 16, cuda_graphs=True)
    with pytest.raises(TypeError, match="cuda_graphs"):
        NSAModelCache(model, 16, cuda_graphs="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-14b"])
@torch.no_grad()
def test_generate_replays_cuda_graphs_with_the_eager_tokens(name):
    """Each layer's decode step recorded at the second step and replayed after: the tokens equal
    the eager decode's and a re-run of the whole prefix (fp32, Triton kernels everywhere)."""
    model = configs.build_model(name, 2, "cuda", torch.float32, **TINY)
    patch.patch_model(model, "fsa", CFG, compression_impl="triton", window_impl="triton", gate_impl="triton")
    configs.init_random_(model, seed=0, std=0.2)
    model.eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(0)).cuda()
    cache = NSAModelCache(model, 40)
    assert cache.cuda_graphs
    replayed = model.generate(ids, max_new_tokens=25, do_sample=False, pad_token_id=0,
                              attention_mask=torch.ones_like(ids), **{cache_kwarg(model): cache})
    assert all(layer.graph.graph is not None and layer.graph.calls == 2 for layer in cache.layers)
    assert torch.equal(replayed, generate(model, ids, 25, cuda_graphs=False))
    assert torch.equal(replayed, _greedy_by_prefix(model, ids, 25))
