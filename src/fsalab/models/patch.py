"""Attention swap for Hugging Face decoder models: NSA (fsa / fsa_paper / nsa / auto / reference)
or the model's own full attention through a chosen backend.

``patch_model(model, "fsa", nsa_config)`` replaces every decoder layer's ``self_attn`` by an
``NSAAttentionAdapter``. The adapter keeps HF's projection modules (their weights and biases:
Qwen2's q/k/v biases come along), applies Qwen3's per-head q/k RMSNorm before anything else
(as Qwen3Attention does, before RoPE), rotates with the ``position_embeddings`` (cos, sin) that
HF's decoder passes in, and runs the three NSA branches and gates of
``fsalab.modules.NativeSparseAttention`` (its compression weights and gate projection are the
only new parameters). Compression sees keys before RoPE; compressed keys are rotated with the
cos/sin of their window's first token, as DESIGN §4 says. Decode steps rotate inside the step's
kernels, from the model's ``rotary_emb.inv_freq`` and ``attention_scaling`` (DESIGN §9).

Full attention is not swapped: the model is built with ``attn_implementation_for(impl)``
("sdpa" or "flash_attention_2") and ``attention_context(impl)`` pins the SDPA backend
(cuDNN, flash, math) around the whole step, backward and checkpoint recomputation included.

Inputs the adapter accepts: padded ``[B, S, hidden]`` batches without padding (each row one
sequence starting at position 0), or one packed row ``[1, total, hidden]`` with HF's
``cu_seq_lens_q`` kwarg. With an ``NSAModelCache`` (``models/cache.py``) as HF's cache, the first
forward fills each layer's decode cache and later forwards decode one token per row
(``model.generate``); any other HF cache is rejected (call the model with ``use_cache=False`` or
pass an ``NSAModelCache``).
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from ..checks import check_cu_seqlens
from ..config import NSAConfig
from ..modules import NativeSparseAttention
from ..modules.rope import rope_inv_freq
from ..ops import selected
from ..ops.decode import NSADecodeCache
from ..ops.impls import FULL_ATTENTION_IMPLS
from .cache import NSACacheLayer, NSAModelCache

SELECTION_IMPLS = tuple(i for i in selected.IMPLS if i not in selected.PEER_IMPLS)
# Full-attention baselines (DESIGN §2 impl names): the model's own attention through an SDPA
# backend ("sdpa": any), or flash-attn; fsalab's Triton full attention is a kernel baseline only.
# "full" is the paper's baseline on H200: cuDNN.
FULL_IMPLS = (*(i for i in FULL_ATTENTION_IMPLS if i != "triton"), "sdpa")
FULL_ALIASES = {"full": "sdpa_cudnn"}


def canonical_impl(impl: str) -> str:
    """``impl`` with aliases resolved; ValueError for unknown names."""
    impl = FULL_ALIASES.get(impl, impl)
    if impl not in SELECTION_IMPLS + FULL_IMPLS:
        raise ValueError(f"attention impl must be one of {SELECTION_IMPLS + FULL_IMPLS + tuple(FULL_ALIASES)}, got {impl!r}")
    return impl


def is_sparse(impl: str) -> bool:
    return canonical_impl(impl) in SELECTION_IMPLS


def attn_implementation_for(impl: str) -> str:
    """The transformers ``attn_implementation`` a model needs for ``impl``.

    NSA models use "sdpa" too: HF then builds no dense mask for unpadded batches.
    """
    return "flash_attention_2" if canonical_impl(impl) == "flash_attn" else "sdpa"


def attention_context(impl: str):
    """Context pinning torch SDPA's backend for a full-attention impl (a no-op otherwise)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_math": SDPBackend.MATH,
    }
    backend = backends.get(canonical_impl(impl))
    return sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()


class HeadNormProjection(nn.Module):
    """A projection followed by an RMSNorm over each head's ``head_dim`` (Qwen3's QK-norm).

    Keeps the HF modules as ``proj`` and ``norm``; output [..., heads * head_dim].
    """

    def __init__(self, proj: nn.Linear, norm: nn.Module, head_dim: int) -> None:
        super().__init__()
        self.proj, self.norm, self.head_dim = proj, norm, head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return self.norm(y.unflatten(-1, (-1, self.head_dim))).flatten(-2)


def nsa_attend(
    nsa: NativeSparseAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: NSADecodeCache | None = None,
) -> torch.Tensor:
    """NSA's branches and gates on projected, not yet rotated q/k/v (DESIGN §4).

    q [total, h, d], k/v [total, h_kv, d]; x [total, hidden] feeds the gates; cos/sin
    [total, d] are the rotary factors of each token (HF's position_embeddings, flattened).
    Uses ``nsa``'s compression weights, gate projection, config and impl choices.
    Returns o [total, h, d] (before the output projection). ``cache``: filled for decode.
    """
    check_cu_seqlens(cu_seqlens, q.shape[0], x.device)
    return nsa.attend(q, k, v, x, cu_seqlens, (cos, sin), cache=cache)


class NSAAttentionAdapter(nn.Module):
    """Drop-in ``self_attn`` for HF Llama / Qwen2 / Qwen3 decoder layers, computing NSA.

    ``self.nsa`` is a ``NativeSparseAttention`` sized to the model whose q/k/v/o projections are
    HF's own modules (wrapped with the per-head norm for Qwen3). Called as HF calls attention:
    ``(hidden_states [B, S, hidden], position_embeddings=(cos, sin), attention_mask=None, **kw)``,
    returns ``(output [B, S, hidden], None)``.
    """

    def __init__(
        self,
        hf_attn: nn.Module,
        nsa_config: NSAConfig,
        selection_impl: str,
        compression_impl: str = "auto",
        window_impl: str = "auto",
        gate_impl: str = "auto",
        rotary: nn.Module | None = None,
    ) -> None:
        super().__init__()
        config = hf_attn.config
        # The model's rotary embedding (not a submodule: the model owns it); decode rotates q, k
        # and the compressed keys (whose positions HF's position_embeddings of the new token do
        # not cover) from its inv_freq and attention_scaling.
        self._rotary = [rotary]
        self.layer_idx = hf_attn.layer_idx
        self.head_dim = hf_attn.head_dim
        h, h_kv = config.num_attention_heads, config.num_key_value_heads
        weight = hf_attn.q_proj.weight
        # The adapter rotates with HF's cos/sin; the module's own frequencies (used only if
        # self.nsa is called directly) are set to the same RoPE where fsalab's rope supports it.
        rope = dict(getattr(config, "rope_parameters", None) or {})
        self._rope = (rope.get("rope_theta", 10000.0), rope if rope.get("rope_type") == "llama3" else None)
        self.nsa = NativeSparseAttention(
            config.hidden_size, h, h_kv, self.head_dim, nsa_config, *self._rope,
            compression_impl=compression_impl, selection_impl=selection_impl, window_impl=window_impl,
            gate_impl=gate_impl, device=weight.device, dtype=weight.dtype,
        )
        q_proj, k_proj = hf_attn.q_proj, hf_attn.k_proj
        if hasattr(hf_attn, "q_norm"):  # Qwen3: RMSNorm per head on q and k, before RoPE
            q_proj = HeadNormProjection(q_proj, hf_attn.q_norm, self.head_dim)
            k_proj = HeadNormProjection(k_proj, hf_attn.k_norm, self.head_dim)
        self.nsa.q_proj, self.nsa.k_proj = q_proj, k_proj
        self.nsa.v_proj, self.nsa.o_proj = hf_attn.v_proj, hf_attn.o_proj

    @torch.no_grad()
    def reset_parameters_fsalab(self) -> None:
        """Initialise the parameters NSA adds to the HF layer (compression weights, position
        embedding) and its RoPE buffer; HF's own modules and the gate Linear are left alone."""
        self.nsa.reset_compression_parameters()
        self.nsa.inv_freq.copy_(rope_inv_freq(self.head_dim, *self._rope))

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        hf_cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if hf_cache is not None and not isinstance(hf_cache, NSAModelCache):
            raise ValueError(f"the NSA adapter keeps its own KV cache: pass past_key_values=fsalab.models.cache.NSAModelCache"
                             f"(model, capacity) or use_cache=False, got {type(hf_cache).__name__}")
        if attention_mask is not None:
            raise ValueError(
                "the NSA adapter takes unpadded causal batches only: build the model with "
                "attn_implementation='sdpa' and pass no padding mask (attention_mask=None)"
            )
        if position_embeddings is None:
            raise ValueError("the NSA adapter needs HF's position_embeddings (cos, sin)")
        batch, seq, hidden = hidden_states.shape
        layer = hf_cache.layers[self.layer_idx] if hf_cache is not None else None
        if layer is not None and layer.nsa is not None:
            return self._decode(hidden_states, layer), None
        total = batch * seq
        cu = kwargs.get("cu_seq_lens_q")
        if cu is not None:
            if batch != 1:
                raise ValueError(f"cu_seq_lens_q needs one packed row [1, total, hidden], got batch {batch}")
            cu = cu.to(torch.int32)
        else:
            cu = torch.arange(batch + 1, device=hidden_states.device, dtype=torch.int32) * seq
        cos, sin = (t.expand(batch, seq, t.shape[-1]).reshape(total, -1) for t in position_embeddings)
        x = hidden_states.reshape(total, hidden)
        nsa, h, h_kv, d = self.nsa, self.nsa.num_heads, self.nsa.num_kv_heads, self.head_dim
        q = nsa.q_proj(x).view(total, h, d)
        k = nsa.k_proj(x).view(total, h_kv, d)
        v = nsa.v_proj(x).view(total, h_kv, d)
        if layer is not None:
            if kwargs.get("cu_seq_lens_q") is not None:
                raise ValueError("an NSAModelCache is filled from a padded [B, S, hidden] prompt, one sequence a row")
            layer.start(nsa.new_cache(batch, layer.capacity), seq)
        o = nsa_attend(nsa, q, k, v, x, cu, cos, sin, layer.nsa if layer is not None else None)
        return nsa.o_proj(o.reshape(total, h * d)).view(batch, seq, hidden), None

    def _decode(self, hidden_states: torch.Tensor, layer: NSACacheLayer) -> torch.Tensor:
        """One new token per row of the cache: hidden_states [B, 1, hidden] -> [B, 1, hidden]."""
        batch, seq, hidden = hidden_states.shape
        if seq != 1:
            raise ValueError(f"after the prompt, an NSAModelCache takes one token per row and step, got {seq}")
        if self._rotary[0] is None:
            raise ValueError("NSA decode needs the model's rotary embedding: patch the model with patch_model")
        nsa, h, h_kv, d = self.nsa, self.nsa.num_heads, self.nsa.num_kv_heads, self.head_dim
        rotary = self._rotary[0]

        def step(x: torch.Tensor) -> torch.Tensor:  # [batch, hidden] -> [batch, hidden]
            q = nsa.q_proj(x).view(batch, h, d)
            k = nsa.k_proj(x).view(batch, h_kv, d)
            v = nsa.v_proj(x).view(batch, h_kv, d)
            # HF's rotary parameters; the decode step computes cos/sin from them inside its
            # kernels. HF takes inv_freq to fp32 too when a cast of the model rounded it.
            inv_freq = rotary.inv_freq if rotary.inv_freq.dtype == torch.float32 else rotary.inv_freq.float()
            o = nsa.attend_decode(q, k, v, x, layer.nsa, inv_freq, rotary.attention_scaling)
            return nsa.o_proj(o.reshape(batch, h * d))

        x = hidden_states.reshape(batch, hidden)
        out = layer.graph(step, x) if layer.graph is not None else step(x)
        layer.seen += 1
        return out.view(batch, 1, hidden)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of an HF causal LM (``model.model.layers``) or base model."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers")
    return layers


def patch_model(
    model: nn.Module,
    impl: str,
    nsa_config: NSAConfig | None = None,
    compression_impl: str = "auto",
    window_impl: str = "auto",
    gate_impl: str = "auto",
) -> nn.Module:
    """Swap every decoder layer's attention for NSA with selection ``impl`` (in place).

    For a full-attention ``impl`` nothing is swapped: check that the model was built with
    ``attn_implementation_for(impl)`` and run it inside ``attention_context(impl)``.
    """
    impl = canonical_impl(impl)
    if not is_sparse(impl):
        want = attn_implementation_for(impl)
        have = model.config._attn_implementation
        if have != want:
            raise ValueError(f"full-attention impl {impl!r} needs attn_implementation={want!r}, the model has {have!r}")
        return model
    if model.config._attn_implementation != "sdpa":
        raise ValueError("build NSA models with attn_implementation='sdpa' (no dense causal mask is built then)")
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is not None and getattr(rotary, "attention_scaling", 1.0) != 1.0:
        raise ValueError("RoPE variants with attention scaling (YaRN, LongRoPE) are not supported by the NSA adapter")
    cfg = nsa_config or NSAConfig()
    for layer in decoder_layers(model):
        layer.self_attn = NSAAttentionAdapter(layer.self_attn, cfg, impl, compression_impl, window_impl, gate_impl, rotary)
    return model


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's attention module (HF's or the adapter)."""
    return [layer.self_attn for layer in decoder_layers(model)]


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's MLP."""
    return [layer.mlp for layer in decoder_layers(model)]


def hf_modeling_module(model: nn.Module):
    """The transformers modeling module (``transformers.models.llama.modeling_llama``, ...) of ``model``."""
    return sys.modules[type(model).__module__]
