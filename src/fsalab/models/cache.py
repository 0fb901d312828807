"""A transformers ``Cache`` holding one ``NSADecodeCache`` per NSA decoder layer (DESIGN §9).

``model.generate(input_ids, past_key_values=NSAModelCache(model, capacity), ...)`` runs a
patched model (``patch.patch_model``) through Hugging Face's cache API: the first forward (the
prompt, one unpadded sequence per batch row) fills each layer's cache from the packed prefill,
every later forward brings one token per row and runs the NSA decode step. HF's own layers'
``update`` is never called: the adapter reads and appends to ``layers[i].nsa`` itself.

The sequence length that HF asks for (``get_seq_length``, ``get_mask_sizes``) is a host int
counted from the forwards' shapes, so nothing reads the device lengths back.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from ..ops.decode_cache import NSADecodeCache


class NSACacheLayer(CacheLayerMixin):
    """One decoder layer's NSA decode cache, allocated at the prefill (``nsa``), and the tokens
    seen so far (``seen``, host int)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.nsa: NSADecodeCache | None = None
        self.seen = 0

    def lazy_initialization(self, *args, **kwargs) -> None:
        """Nothing to do: the NSA adapter allocates ``nsa`` at the prefill."""

    def update(self, *args, **kwargs):
        raise TypeError("NSAModelCache layers are filled by fsalab's NSA adapter, not by HF attention: "
                        "patch the model with fsalab.models.patch_model first")

    def get_seq_length(self, *args) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.capacity

    def get_max_cache_shape(self) -> int:
        return self.capacity

    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        """(kv_length, kv_offset) for HF's mask builder; ``query`` is the query length (an int) or,
        in older transformers, the cache positions (a tensor)."""
        query_length = query if isinstance(query, int) else query.shape[0]
        return self.seen + query_length, 0

    def reset(self) -> None:
        self.nsa, self.seen = None, 0


class NSAModelCache(Cache):
    """One ``NSACacheLayer`` per decoder layer of ``model``; ``capacity``: tokens per sequence
    (prompt plus generated), fixed at construction so every step has static shapes."""

    def __init__(self, model: nn.Module, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        super().__init__(layers=[NSACacheLayer(capacity) for _ in range(model.config.num_hidden_layers)])
        self.capacity = capacity


def cache_kwarg(model: nn.Module) -> str:
    """The name under which ``model`` takes its cache: "cache" (transformers >= 5.20-ish, where
    "past_key_values" is deprecated) or "past_key_values" (earlier 5.x)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, capacity: int | None = None, **kwargs):
    """Greedy ``model.generate`` of a patched model through an ``NSAModelCache``.

    input_ids [batch, prompt] (one unpadded prompt a row; padding is not supported by the NSA
    adapter); ``capacity`` defaults to prompt + max_new_tokens. Other keyword arguments go to
    ``generate``. Returns the token ids [batch, prompt + generated].
    """
    capacity = capacity if capacity is not None else input_ids.shape[1] + max_new_tokens
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("pad_token_id", model.config.eos_token_id or 0)
    # All ones: generate would otherwise infer padding from tokens equal to pad_token_id.
    kwargs.setdefault("attention_mask", torch.ones_like(input_ids))
    kwargs[cache_kwarg(model)] = NSAModelCache(model, capacity)
    return model.generate(input_ids, max_new_tokens=max_new_tokens, **kwargs)
