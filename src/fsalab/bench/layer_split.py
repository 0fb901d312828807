"""The attention vs MLP split (FSA Fig. 10): one decoder layer's parts timed in isolation.

With activation checkpointing a training step runs each layer as fwd, then recompute fwd + bwd,
so a part's cost per layer in the step is fwd + fwd+bwd (``split_columns``); in prefill it is
the forward alone. Slice and full-depth totals are L x per layer.
"""

from __future__ import annotations

import torch
from torch import nn

from .timing import timed_steps


def settled(t: torch.Tensor) -> torch.Tensor:
    """``t`` with any pending collective waited on. Under tensor parallelism a row-parallel
    layer returns an AsyncCollectiveTensor whose all-reduce is waited on only at its first use,
    so a timed call that discards its output would end before the all-reduce does."""
    wait = getattr(t, "trigger_wait", None)
    return wait() if wait is not None else t


def layer_part_times(lm: nn.Module, p: dict, device: torch.device, dtype: torch.dtype, timing: dict,
                     train: bool, names: tuple[str, ...] = ("attention", "mlp", "layer")) -> dict:
    """Per-layer times (ms) of decoder layer 0's attention, MLP and whole layer (``names``), in
    isolation at the point's shape [batch, N, hidden].

    ``train``: fwd (no grad) and fwd+bwd of attention and MLP; the whole layer as it runs in the
    step (checkpointed when enabled: fwd, then recompute + bwd). Otherwise fwd only (prefill).
    """
    from ..models.patch import attention_context, decoder_layers

    layer = decoder_layers(lm)[0]
    batch, n, hidden = p["batch"], p["N"], lm.config.hidden_size
    # Drawn on the device: a [1, 64K, 5120] fp32 draw takes seconds on one host core, and each
    # point makes two. The same seed on every rank
    # gives tensor-parallel ranks the same replicated input.
    gen = torch.Generator(device=device).manual_seed(p["seed"] + 7)
    x = torch.randn(batch, n, hidden, generator=gen, device=device, dtype=dtype)
    pos = torch.arange(n, device=device)[None].expand(batch, n)
    pe = lm.model.rotary_emb(x, pos)
    dout = torch.randn(batch, n, hidden, generator=gen, device=device, dtype=dtype)

    parts = {
        "attention": lambda t: layer.self_attn(hidden_states=t, position_embeddings=pe, attention_mask=None)[0],
        "mlp": lambda t: layer.mlp(t),
        "layer": lambda t: layer(t, attention_mask=None, position_ids=pos, position_embeddings=pe, use_cache=False),
    }
    out = {}
    with attention_context(p["impl"]):
        for name in names:
            f = parts[name]

            def fwd(f=f):
                with torch.no_grad():
                    return settled(f(x))

            def fwd_bwd(f=f):
                xg = x.detach().requires_grad_(True)
                f(xg).backward(dout)

            if name != "layer":
                out[f"{name}_fwd_ms"] = timed_steps(fwd, device, timing).summary()["median_ms"]
            if train:
                out[f"{name}_fwdbwd_ms"] = timed_steps(fwd_bwd, device, timing).summary()["median_ms"]
            elif name == "layer":
                out["layer_fwd_ms"] = timed_steps(fwd, device, timing).summary()["median_ms"]
    lm.zero_grad(set_to_none=True)
    return out


def split_columns(parts: dict, layers: int, layers_full: int, train: bool, checkpointing: bool) -> dict:
    """Per-layer attention/MLP cost as it appears in the step, and L x that for slice and full depth."""
    out = {}
    for name in ("attention", "mlp"):
        if train:
            per_layer = parts[f"{name}_fwdbwd_ms"] + (parts[f"{name}_fwd_ms"] if checkpointing else 0.0)
        else:
            per_layer = parts[f"{name}_fwd_ms"]
        out[f"{name}_ms_per_layer"] = per_layer
        out[f"{name}_ms_slice"] = per_layer * layers
        out[f"{name}_ms_full_depth"] = per_layer * layers_full
    return out
