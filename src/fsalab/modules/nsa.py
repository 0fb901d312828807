"""NativeSparseAttention: projections, RoPE, the three NSA branches and per-head gates."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..checks import check_cu_seqlens, check_lengths, check_tensor
from ..config import NSAConfig
from ..ops import COMPRESSION_IMPLS, GATE_IMPLS, WINDOW_IMPLS
from ..ops.attention import nsa_attention
from ..ops.decode import DECODE_IMPLS, NSADecodeCache, decode_ops
from ..ops.selected import IMPLS as SELECTION_IMPLS
from ..varlen import local_positions
from .rope import rope_cos_sin, rope_inv_freq


class NativeSparseAttention(nn.Module):
    """NSA attention layer (NSA paper §3, DESIGN §4) over packed or padded batches.

    Branches share the q/k/v projections (as the FSA code does). Compression runs on keys before
    RoPE; RoPE is then applied to q, k and to each compressed key at its window's start position.
    Gates: sigmoid of a linear map of the hidden state, one per branch and query head.

    Each branch's op is chosen by name: ``compression_impl`` ("reference" | "triton" | "auto"),
    ``selection_impl`` (see ``fsalab.ops.selected``; None means "auto"), ``window_impl``
    ("reference" | "triton" | "flash_attn" | "auto"), ``gate_impl`` ("reference" | "triton" |
    "auto"; the gated sum of the three branches), ``decode_impl`` ("reference" | "triton" |
    "auto"; the decode step, ``decode``). "auto" is the kernels on CUDA tensors and the fp32
    reference elsewhere; an unknown name fails here, not at the first forward.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int | None = None,
        config: NSAConfig | None = None,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        qkv_bias: bool = False,
        compression_impl: str = "auto",
        selection_impl: str | None = None,
        window_impl: str = "auto",
        gate_impl: str = "auto",
        decode_impl: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        for name, value, known in (("compression_impl", compression_impl, COMPRESSION_IMPLS),
                                   ("selection_impl", selection_impl or "auto", tuple(SELECTION_IMPLS)),
                                   ("window_impl", window_impl, WINDOW_IMPLS), ("gate_impl", gate_impl, GATE_IMPLS),
                                   ("decode_impl", decode_impl, DECODE_IMPLS)):
            if value not in known:
                raise ValueError(f"{name} must be one of {known}, got {value!r}")
        if head_dim is None and hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads}), "
                             "or give head_dim")
        self.cfg = config or NSAConfig()
        self.hidden_size = hidden_size
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.compression_impl, self.selection_impl, self.window_impl = compression_impl, selection_impl, window_impl
        self.gate_impl, self.decode_impl = gate_impl, decode_impl
        d, l = self.head_dim, self.cfg.kernel_size
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden_size, num_heads * d, bias=qkv_bias, **factory)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * d, bias=qkv_bias, **factory)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * d, bias=qkv_bias, **factory)
        self.o_proj = nn.Linear(num_heads * d, hidden_size, bias=False, **factory)
        self.gate_proj = nn.Linear(hidden_size, 3 * num_heads, bias=False, **factory)
        self.compress_k = nn.Parameter(torch.empty(num_kv_heads, l * d, d, **factory))
        self.compress_v = nn.Parameter(torch.empty(num_kv_heads, l * d, d, **factory))
        self.compress_pe = nn.Parameter(torch.empty(num_kv_heads, l, d, **factory))
        # On the module's device: a CPU buffer would be copied to the GPU (a host sync) every call.
        inv_freq = rope_inv_freq(d, rope_theta, rope_scaling).to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.reset_compression_parameters()

    def reset_compression_parameters(self) -> None:
        # Variance-preserving for a map from l*d inputs to d outputs.
        bound = 1.0 / math.sqrt(self.cfg.kernel_size * self.head_dim)
        nn.init.uniform_(self.compress_k, -bound, bound)
        nn.init.uniform_(self.compress_v, -bound, bound)
        nn.init.normal_(self.compress_pe, std=0.02)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        cache: NSADecodeCache | None = None,
    ) -> torch.Tensor:
        """Packed ``[total, hidden]`` with ``cu_seqlens`` (int32 [batch + 1]), or padded
        ``[batch, seq, hidden]`` with optional right-padding ``lengths`` ([batch]); same layout out.
        Padded positions of the output are zero. With a ``cache`` (packed input only) the prefill
        fills it for ``decode`` (DESIGN §9).
        """
        if hidden_states.dim() == 3:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens is for packed [total, hidden] input; padded input takes lengths")
            if cache is not None:
                raise ValueError("a decode cache is filled from packed input: pass [total, hidden] with cu_seqlens")
            return self._forward_padded(hidden_states, lengths)
        check_tensor("hidden_states", hidden_states, 2)
        if cu_seqlens is None:
            raise ValueError("packed hidden_states [total, hidden] need cu_seqlens (int32 [batch + 1])")
        if lengths is not None:
            raise ValueError("lengths is for padded [batch, seq, hidden] input; packed input takes cu_seqlens")
        return self._forward_packed(hidden_states, cu_seqlens, cache)

    def _forward_padded(self, x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
        batch, seq, hidden = x.shape
        starts = torch.arange(batch + 1, device=x.device, dtype=torch.int32) * seq
        if lengths is None:
            cu = starts
            valid = None
        else:
            check_lengths(lengths, batch, seq, x.device)
            # Padding tokens form sequences of their own, so no host sync is needed to pack. Bad
            # lengths are reported above; the clamp only keeps the packing in bounds when value
            # checks are off (the setting value_checks=False).
            ends = starts[:-1] + lengths.to(torch.int32).clamp(0, seq)
            cu = torch.stack([starts[:-1], ends], dim=1).flatten()
            cu = torch.cat([cu, starts[-1:]])
            valid = torch.arange(seq, device=x.device)[None, :] < lengths.to(x.device)[:, None]
        out = self._forward_packed(x.reshape(batch * seq, hidden), cu).view(batch, seq, hidden)
        # Selected, not multiplied: a NaN in a padded position must not survive as NaN * 0.
        return out if valid is None else out.masked_fill(~valid[..., None], 0.0)

    def _check_hidden(self, x: torch.Tensor) -> None:
        hidden = x.shape[-1]
        if hidden != self.hidden_size:
            raise ValueError(f"hidden_states must have hidden size {self.hidden_size}, got {hidden}")
        if x.dtype != self.q_proj.weight.dtype:
            raise TypeError(f"hidden_states has dtype {x.dtype} but the module's parameters are "
                            f"{self.q_proj.weight.dtype}; cast one to the other")

    def _forward_packed(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cache: NSADecodeCache | None = None) -> torch.Tensor:
        total, hidden = x.shape
        self._check_hidden(x)
        check_cu_seqlens(cu_seqlens, total, x.device)
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(total, h, d)
        k = self.k_proj(x).view(total, h_kv, d)
        v = self.v_proj(x).view(total, h_kv, d)

        o = self.attend(q, k, v, x, cu_seqlens, cache=cache)
        return self.o_proj(o.reshape(total, h * d))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: NSADecodeCache | None = None,
    ) -> torch.Tensor:
        """NSA's three branches and gates on projected q/k/v before RoPE; o [total, h, d]
        (``ops.attention.nsa_attention``: one autograd node where every branch runs fsalab's kernels).

        q [total, h, d], k/v [total, h_kv, d]; x [total, hidden] feeds the gates. ``rotary``:
        (cos, sin) [total, d] in q's dtype, the rotary embedding of each packed token in the
        rotate-half convention; the default is this module's RoPE at local positions. Compressed
        keys are rotated at the first raw token of their window. ``cache``: filled with this
        prefill's keys, values and compressed tokens (one sequence of cu_seqlens per cache row).
        """
        total, h, _ = q.shape
        if rotary is None:
            rotary = rope_cos_sin(local_positions(cu_seqlens, total), self.inv_freq, q.dtype)
        gates = self.gate_proj(x).view(total, h, 3)
        # The module's "auto" (and None) as for the other branches: the kernels on CUDA, the reference elsewhere.
        selection = None if self.selection_impl == "auto" else self.selection_impl
        return nsa_attention(q, k, v, self.compress_k, self.compress_v, self.compress_pe, gates, cu_seqlens, self.cfg,
                             rotary, self.compression_impl, selection, self.window_impl, self.gate_impl, cache)

    # ------------------------------------------------------------------------------------------
    # Decode (DESIGN §9)
    # ------------------------------------------------------------------------------------------

    def new_cache(self, batch: int, capacity: int, device: torch.device | str | None = None) -> NSADecodeCache:
        """An empty decode cache for ``batch`` sequences of up to ``capacity`` tokens, in the
        module's dtype and device; fill it with ``forward(x, cu_seqlens, cache=cache)``."""
        weight = self.gate_proj.weight  # q_proj may be wrapped (Qwen3's QK-norm in the model swap)
        return NSADecodeCache.allocate(batch, capacity, self.num_kv_heads, self.head_dim, self.cfg, weight.dtype,
                                       device if device is not None else weight.device, num_heads=self.num_heads)

    def decode(self, hidden_states: torch.Tensor, cache: NSADecodeCache) -> torch.Tensor:
        """One new token per sequence: hidden_states [batch, hidden] -> [batch, hidden].

        Appends the token to ``cache`` (filled by a prefill) and attends over it; the output
        equals the prefill output of the same token. Static shapes, no host sync on CUDA.
        """
        check_tensor("hidden_states", hidden_states, 2)
        self._check_hidden(hidden_states)
        x = hidden_states
        batch = x.shape[0]
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(batch, h, d)
        k = self.k_proj(x).view(batch, h_kv, d)
        v = self.v_proj(x).view(batch, h_kv, d)
        o = self.attend_decode(q, k, v, x, cache)
        return self.o_proj(o.reshape(batch, h * d))

    def attend_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        x: torch.Tensor,
        cache: NSADecodeCache,
        inv_freq: torch.Tensor | None = None,
        attention_scaling: float = 1.0,
    ) -> torch.Tensor:
        """``attend`` for one new token per sequence of ``cache``: q [batch, h, d], k/v
        [batch, h_kv, d] projected, before RoPE; x [batch, hidden] feeds the gates. RoPE at each
        sequence's position from ``inv_freq`` (float32 [d / 2]; default: this module's) and
        ``attention_scaling`` (the factor HF multiplies cos and sin by), computed inside the
        step's kernels (``ops.decode.append_token``). Returns o [batch, h, d] (before the output
        projection). Launches: ``append_token``'s two, the gate projection, ``nsa_decode``'s five.
        """
        if not isinstance(cache, NSADecodeCache):
            raise TypeError(f"cache must be an NSADecodeCache, got {type(cache).__name__}")
        if cache.cfg != self.cfg:
            raise ValueError(f"the cache was built for {cache.cfg}, the module uses {self.cfg}")
        batch, h, _ = q.shape
        if batch != cache.batch:
            raise ValueError(f"{batch} new tokens for a cache of batch {cache.batch}: one token per sequence")
        cache.check_step()
        ops = decode_ops(self.decode_impl, x.device)
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        q = ops.append_token(cache, q, k, v, self.compress_k, self.compress_v, self.compress_pe, inv_freq,
                             attention_scaling)
        gates = self.gate_proj(x).view(batch, h, 3)
        o, _ = ops.nsa_decode(q, cache, gates)
        return o.to(q.dtype)
