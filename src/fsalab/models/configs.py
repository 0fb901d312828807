"""The paper's end-to-end architectures (FSA §4.1): Llama3-8B, Qwen3-14B, Qwen2.5-32B.

No weights are needed: each model is built by transformers from its published ``config.json``
(values copied below, one source per model), on the meta device, then materialised with random
weights where it runs (``materialize``).

Sources (the Hugging Face model repositories' ``config.json``, checked against mirrors):

- Llama3-8B: https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
  (``rope_scaling: null``: the llama3 frequency scaling was introduced with Llama 3.1; the 3.0
  8B model the paper names has none. ``max_position_embeddings`` is 8192; RoPE itself has no
  length limit, so 32K/64K sequences run with the published frequencies.)
- Qwen3-14B: https://huggingface.co/Qwen/Qwen3-14B/blob/main/config.json (QK-norm: RMSNorm over
  the head dim of q and k, before RoPE; ``head_dim`` 128 is explicit since 40 x 128 != 5120).
- Qwen2.5-32B: https://huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json (q/k/v biases,
  no o_proj bias, sliding window disabled).

Parameter counts built this way (transformers 5.17 and 5.24): 8,030,261,248 / 14,768,307,200 /
32,763,876,352, i.e. the published 8.03B / 14.77B / 32.76B.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """One published architecture: transformers classes and the config.json fields."""

    name: str
    hf_id: str
    config_class: str
    model_class: str
    config: dict = field(repr=False)
    num_params: int

    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]

    @property
    def num_heads(self) -> int:
        return self.config["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        return self.config["num_key_value_heads"]

    @property
    def head_dim(self) -> int:
        return self.config.get("head_dim") or self.config["hidden_size"] // self.num_heads


MODELS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec(
        name="llama3-8b",
        hf_id="meta-llama/Meta-Llama-3-8B",
        config_class="LlamaConfig",
        model_class="LlamaForCausalLM",
        config={
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_act": "silu",
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": 128000,
            "eos_token_id": 128001,
        },
        num_params=8_030_261_248,
    ),
    "qwen3-14b": ModelSpec(
        name="qwen3-14b",
        hf_id="Qwen/Qwen3-14B",
        config_class="Qwen3Config",
        model_class="Qwen3ForCausalLM",
        config={
            "vocab_size": 151936,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 40,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "hidden_act": "silu",
            "max_position_embeddings": 40960,
            "max_window_layers": 40,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "sliding_window": None,
            "use_sliding_window": False,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
        },
        num_params=14_768_307_200,
    ),
    "qwen2.5-32b": ModelSpec(
        name="qwen2.5-32b",
        hf_id="Qwen/Qwen2.5-32B",
        config_class="Qwen2Config",
        model_class="Qwen2ForCausalLM",
        config={
            "vocab_size": 152064,
            "hidden_size": 5120,
            "intermediate_size": 27648,
            "num_hidden_layers": 64,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "hidden_act": "silu",
            "max_position_embeddings": 131072,
            "max_window_layers": 64,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "sliding_window": 131072,
            "use_sliding_window": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "bos_token_id": 151643,
            "eos_token_id": 151643,
        },
        num_params=32_763_876_352,
    ),
}

# Spellings used by the paper and by the Hugging Face repositories.
_ALIASES = {
    "llama3-8b": "llama3-8b", "llama-3-8b": "llama3-8b", "meta-llama-3-8b": "llama3-8b",
    "qwen3-14b": "qwen3-14b", "qwen2.5-32b": "qwen2.5-32b", "qwen25-32b": "qwen2.5-32b",
}


def get_spec(name: str) -> ModelSpec:
    """The spec of ``name`` (case-insensitive; "Llama3-8B", "Qwen/Qwen3-14B", ... accepted)."""
    key = _ALIASES.get(name.lower().split("/")[-1])
    if key is None:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[key]


def hf_config(name: str, num_layers: int | None = None, attn_implementation: str = "sdpa", **overrides):
    """The transformers config of ``name``; ``num_layers`` keeps only the first L decoder layers.

    ``overrides`` replace published fields (tests use it for tiny widths). The attention
    implementation is fixed on the config ("sdpa", "flash_attention_2", "eager").
    """
    import transformers

    spec = get_spec(name)
    fields = {**spec.config, **overrides}
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        fields["num_hidden_layers"] = num_layers
        if "max_window_layers" in fields:
            fields["max_window_layers"] = min(fields["max_window_layers"], num_layers)
    config = getattr(transformers, spec.config_class)(**fields)
    config._attn_implementation = attn_implementation
    return config


def build_model(
    name: str,
    num_layers: int | None = None,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str = "sdpa",
    **overrides,
) -> nn.Module:
    """``<Model>ForCausalLM`` of ``name`` built from its config on ``device`` in ``dtype``.

    On "meta" nothing is allocated (shapes and parameter counts only); call ``materialize`` to
    give it random weights on a real device. Elsewhere transformers' own init runs. Built through
    ``_from_config(dtype=...)`` so that fp32 buffers (rotary frequencies) stay fp32.
    """
    import transformers

    spec = get_spec(name)
    config = hf_config(name, num_layers, attn_implementation, **overrides)
    cls = getattr(transformers, spec.model_class)
    with torch.device(device):
        return cls._from_config(config, dtype=dtype)


def count_parameters(model: nn.Module) -> int:
    """Parameters of ``model``, each shared tensor once (works on the meta device)."""
    return sum(p.numel() for p in model.parameters())


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)


@torch.no_grad()
def init_random_(model: nn.Module, std: float | None = None, seed: int = 0) -> nn.Module:
    """Random weights in place, HF-style: Linear/Embedding ~ N(0, std) (bias 0), RMSNorm = 1.

    ``std`` defaults to the config's ``initializer_range``. Modules with their own
    ``reset_parameters_fsalab`` (the NSA adapter) initialise their extra parameters themselves.
    Non-persistent buffers (rotary inverse frequencies) are recomputed, since ``to_empty`` leaves
    them uninitialised. Works on FSDP2-sharded (DTensor) parameters.
    """
    config = getattr(model, "config", None)
    std = std if std is not None else getattr(config, "initializer_range", 0.02)
    torch.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif _is_norm(module):
            module.weight.fill_(1.0)
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq"):
            _reset_rotary(module)
        reset = getattr(module, "reset_parameters_fsalab", None)
        if reset is not None:
            reset()
    return model


def _reset_rotary(module: nn.Module) -> None:
    """Recompute an HF rotary embedding's buffers from its config (on CPU, then copied)."""
    fresh = type(module)(config=module.config)
    for name, buf in fresh.named_buffers(recurse=False):
        getattr(module, name).copy_(buf)
    module.attention_scaling = fresh.attention_scaling


def materialize(model: nn.Module, device: torch.device | str, seed: int = 0) -> nn.Module:
    """Allocate a meta (or FSDP2-sharded meta) model on ``device`` and fill it with random weights."""
    model.to_empty(device=device)
    return init_random_(model, seed=seed)
