"""A patched decoder layer at GPU-test scale: the architecture's g and head dim, tiny widths."""

from __future__ import annotations

import torch

from fsalab.config import NSAConfig


def tiny_patched_layer(model: str, impl: str, cfg: NSAConfig, device: str = "cuda",
                       dtype: torch.dtype = torch.bfloat16):
    """(the one-layer model, its decoder layer, hidden size) of ``model`` patched with NSA
    ``impl``: 2 KV heads of 64 and the model's group size."""
    from fsalab.models.configs import build_model, get_spec, materialize
    from fsalab.models.patch import decoder_layers, patch_model

    spec = get_spec(model)
    h_kv = 2
    heads = h_kv * (spec.num_heads // spec.num_kv_heads)
    hidden = heads * 64
    overrides = {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": h_kv,
                 "head_dim": 64, "intermediate_size": 2 * hidden, "vocab_size": 128}
    net = materialize(build_model(model, num_layers=1, device="meta", **overrides), device)
    patch_model(net, impl, cfg)
    net.to(device=device, dtype=dtype)
    return net, decoder_layers(net)[0], hidden
