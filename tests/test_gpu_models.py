"""The attention swap and the full-attention baselines on the GPU, in bf16.

A tiny Llama and Qwen3 patched with NSA configured as full attention (topk >= blocks, gates
forced to the selected branch) must reproduce HF's own SDPA logits with each selection kernel;
cuDNN SDPA with GQA (``enable_gqa``, as transformers calls it without a mask) must agree with
flash SDPA; HF must pass ``attention_mask=None`` to the full-attention baseline (no dense mask).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fsalab.config import NSAConfig
from fsalab.models import configs, patch

pytestmark = pytest.mark.gpu

TINY = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 512, "bos_token_id": None, "eos_token_id": None}


@pytest.mark.parametrize("impl", ["fsa", "nsa", "fsa_paper"])
@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-14b"])
def test_swap_as_full_attention_matches_hf(name, impl, device):
    hf = configs.build_model(name, 2, device, torch.bfloat16, **TINY)
    configs.init_random_(hf, seed=0)
    ids = torch.randint(0, TINY["vocab_size"], (2, 1000), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad(), patch.attention_context("sdpa_flash"):
        ref = hf(input_ids=ids, use_cache=False).logits.float()
    model = copy.deepcopy(hf)
    patch.patch_model(model, impl, NSAConfig(block_size=64, topk=16, window_size=64))
    for adapter in patch.attention_modules(model):  # sigma(-100) ~ 0 for compressed and window
        h = adapter.nsa.num_heads
        gate = nn.Linear(adapter.nsa.hidden_size, 3 * h, bias=True, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            gate.weight.zero_()
            gate.bias.copy_(torch.tensor([-100.0, 100.0, -100.0]).repeat(h))
        adapter.nsa.gate_proj = gate
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits.float()
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 3e-2, f"relative max error {err:.2e} against HF SDPA (bf16)"


def test_cudnn_sdpa_with_gqa_matches_flash(device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 32, 8192, 128, device=device, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(1, 8, 8192, 128, device=device, generator=gen).to(torch.bfloat16) for _ in range(2))
    outs = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel([backend]):
            outs[name] = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (outs["cudnn"].float() - outs["flash"].float()).abs().max().item() < 2e-2


def test_hf_full_attention_gets_no_dense_mask(device):
    model = configs.build_model("llama3-8b", 1, device, torch.bfloat16, vocab_size=512, bos_token_id=None,
                                eos_token_id=None)
    seen = {}

    def record_mask(module, args, kwargs):
        seen.setdefault("mask_is_none", kwargs.get("attention_mask") is None)

    model.model.layers[0].self_attn.register_forward_pre_hook(record_mask, with_kwargs=True)
    with torch.no_grad(), patch.attention_context("sdpa_cudnn"):
        model(input_ids=torch.randint(0, 512, (1, 4096), device=device), use_cache=False)
    assert seen["mask_is_none"]
