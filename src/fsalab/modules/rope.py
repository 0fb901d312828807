"""Rotary position embedding (rotate-half convention, as in HF Llama/Qwen), with Llama-3 scaling."""

from __future__ import annotations

import math

import torch

from ..ops.attention import rotate


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies float32 [head_dim // 2].

    ``scaling`` follows the HF ``rope_scaling`` dict: None / {"rope_type": "default"}, or
    {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"} (Llama 3.1 frequency-dependent interpolation).
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (default, llama3)")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(medium, blended, out).float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [tokens, head_dim] in ``dtype`` of angle position * inv_freq (rotate-half
    layout: each frequency twice); positions int [tokens]."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, d] by angle position * inv_freq; positions int [tokens]."""
    return rotate(x, *rope_cos_sin(positions, inv_freq, x.dtype))
