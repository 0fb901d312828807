"""The model an end-to-end point runs: built with its attention swapped, its loss, its batch.

``build_patched_model`` builds the point's published architecture (``fsalab.models``) on the
meta device, swaps its attention for the point's impl, optionally wraps and shards it, then
materialises random weights on the device. ``CausalLMLoss`` / ``chunked_cross_entropy`` give
the next-token loss without holding tokens x vocab fp32 logits. Shared by the train, prefill
and convergence runners.
"""

from __future__ import annotations

import gc

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .points import nsa_config


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean cross-entropy of ``head(hidden)`` against ``labels`` (-100 ignored), fp32.

    hidden [tokens, hidden_size], labels int64 [tokens]. Logits are built one chunk of ``chunk``
    tokens at a time (cast to fp32 inside the chunk only) and rebuilt in backward
    (checkpointed), so peak extra memory is one chunk's logits instead of tokens x vocab.
    """

    def chunk_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(head(h).float(), y, ignore_index=-100, reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start : start + chunk], labels[start : start + chunk]
        total = total + checkpoint(chunk_loss, h, y, use_reentrant=False)
    return total / (labels != -100).sum().clamp(min=1)


class CausalLMLoss(nn.Module):
    """An HF causal LM returning the chunked next-token loss; the unit FSDP2 shards as its root.

    forward(input_ids [B, S], labels [B, S]) -> scalar loss. Labels are the next tokens, -100
    where there is none.
    """

    def __init__(self, lm: nn.Module, chunk: int) -> None:
        super().__init__()
        self.lm, self.chunk = lm, chunk

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return chunked_cross_entropy(hidden.flatten(0, 1), self.lm.lm_head, labels.flatten(), self.chunk)


def build_patched_model(p: dict, device: torch.device, dtype: torch.dtype, wrap=None, shard=None) -> nn.Module:
    """The point's model built on the meta device with its attention swapped, optionally wrapped
    (``wrap(model)``, e.g. CausalLMLoss) and sharded (``shard(root)``, FSDP2), then materialised
    on ``device`` with random weights: no rank ever holds an unsharded copy."""
    from ..models import configs, patch

    impl = patch.canonical_impl(p["impl"])
    model = configs.build_model(p["model"], p.get("layers") or None, "meta", dtype,
                                patch.attn_implementation_for(impl), **p.get("model_overrides", {}))
    patch.patch_model(model, impl, nsa_config(p), p["compression_impl"], p["window_impl"], p["gate_impl"])
    root = wrap(model) if wrap is not None else model
    if shard is not None:
        shard(root)
    root.to_empty(device=device)
    configs.init_random_(model, seed=p["seed"])
    return root


def enable_checkpointing(lm: nn.Module) -> None:
    """Activation checkpointing of every decoder layer (non-reentrant), via transformers' API
    (``activation_checkpointing_enable`` from 5.2x on, ``gradient_checkpointing_enable`` before)."""
    enable = getattr(lm, "activation_checkpointing_enable", None)
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def random_batch(vocab: int, batch: int, n: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids [batch, n] and their next-token labels (-100 at the end of each row)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, n), generator=gen).to(device)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return ids, labels


def linear_params(model: nn.Module, include_head: bool = True) -> int:
    """Parameters of the nn.Linear weights (the matmul FLOP count's P), LM head optional."""
    head = getattr(model, "lm_head", None)
    return sum(m.weight.numel() for m in model.modules()
               if isinstance(m, nn.Linear) and (include_head or m is not head))


def release(device: torch.device) -> None:
    """Free what a finished point held (Python garbage, then the CUDA cache)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
